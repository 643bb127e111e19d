-- Force-disconnect across the cluster (ADR 0024): an order travels on the bus; every node that
-- carried it out reports how many sockets it closed here, and the node that took the request
-- sums the reports of the live nodes. Rows are pruned with the outbox.
CREATE TABLE disconnect_reports (
    request_id  uuid        NOT NULL,
    node_id     text        NOT NULL,
    closed      integer     NOT NULL,
    reported_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (request_id, node_id)
);
CREATE INDEX disconnect_reports_by_time ON disconnect_reports (reported_at);

-- Presence across the cluster (ADR 0024): each node incarnation's open connections per
-- (conversation, participant). A change takes an advisory lock on its (conversation,
-- participant), so the count it reads back is the cluster's, and exactly one change sees it go
-- from 0 to 1 or from 1 to 0. A dead incarnation's rows are deleted by the node that notices it
-- first, which announces the participants it took offline.
CREATE TABLE presence_connections (
    conversation_id uuid    NOT NULL,
    participant_id  text    NOT NULL,
    node_id         text    NOT NULL,
    generation      bigint  NOT NULL,
    connections     integer NOT NULL,
    PRIMARY KEY (conversation_id, participant_id, node_id, generation)
);
CREATE INDEX presence_by_node ON presence_connections (node_id, generation);
