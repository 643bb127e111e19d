// The REST client against a real node: tenants, channels, tokens, history pages, the tenant's
// conversation list, stopping a turn, and the typed errors.

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { AuthenticationError, NotFoundError, RestError } from "../src/errors.js";
import { RestClient } from "../src/rest.js";
import { LIMIT, RawAgent, setupTenant, withNode } from "./support.js";

const mainNode = withNode();

describe("RestClient", () => {
    test("tenants, channels and tokens", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const channels = await tenant.rest.listChannels(tenant.apiKey);
        assert.deepEqual(
            channels.map((channel) => channel.id),
            [tenant.channelId],
        );
        assert.equal(channels[0]?.secret, undefined, "secrets are shown once");
        assert.equal(channels[0]?.status, "active");
        const issued = await tenant.rest.generateToken(tenant.channelSecret, { userId: "alice" });
        assert.ok(issued.token.length > 0);
        assert.ok((issued.expiresIn ?? 0) > 0);
        const refreshed = await tenant.rest.refreshToken(issued.token);
        assert.ok(refreshed.token.length > 0);
        const created = await tenant.rest.createConversation(refreshed.token);
        assert.equal(created.userId, "alice");
        assert.match(created.conversationId, /^[0-9a-f-]{36}$/);
        assert.ok(await tenant.rest.ready());
    });

    test("history pages: activities after a watermark, page by page", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const { conversationId, token } = await tenant.conversation("alice");
        for (const text of ["one", "two", "three", "four", "five"]) {
            await tenant.rest.postActivity(token, conversationId, text);
        }
        const posted = await tenant.rest.postActivity(token, conversationId, "six", {
            idempotencyKey: "k-6",
        });
        const repeated = await tenant.rest.postActivity(token, conversationId, "six", {
            idempotencyKey: "k-6",
        });
        assert.equal(repeated.duplicate, true);
        assert.equal(repeated.seq, posted.seq);

        const first = await tenant.rest.listActivities(token, conversationId, { limit: 2 });
        assert.deepEqual(
            first.activities.map((message) => message.text),
            ["one", "two"],
        );
        assert.equal(first.hasMore, true);
        assert.equal(first.watermark, 2);
        const second = await tenant.rest.listActivities(token, conversationId, {
            watermark: first.watermark,
            limit: 2,
        });
        assert.deepEqual(
            second.activities.map((message) => message.seq),
            [3, 4],
        );
        const all = await tenant.rest.allActivities(token, conversationId);
        assert.deepEqual(
            all.map((message) => message.text),
            ["one", "two", "three", "four", "five", "six"],
        );
        assert.equal(all[0]?.sender?.id, "alice");
        const last = await tenant.rest.listActivities(token, conversationId, { watermark: 6 });
        assert.deepEqual(last.activities, []);
        assert.equal(last.hasMore, false);
    });

    test("the tenant's conversations, stopping a turn, closing", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        const agent = await RawAgent.connect(tenant.url, await tenant.agentToken());
        try {
            const { conversationId, token } = await tenant.conversation("bob");
            const listed = await tenant.rest.listConversations(tenant.apiKey, { userId: "bob" });
            assert.deepEqual(
                listed.conversations.map((conversation) => conversation.id),
                [conversationId],
            );
            const one = await tenant.rest.getConversation(tenant.apiKey, conversationId);
            assert.deepEqual([one.id, one.userId, one.status], [conversationId, "bob", "open"]);

            assert.deepEqual(await tenant.rest.stopTurn(token, conversationId), {
                stopped: false,
                seq: undefined,
            });
            await tenant.rest.postActivity(token, conversationId, "long question");
            await agent.nextTurn(conversationId);
            assert.deepEqual(await tenant.rest.stopTurn(token, conversationId), {
                stopped: true,
                seq: 1,
            });

            const closed = await tenant.rest.closeConversation(token, conversationId, "done");
            assert.ok(JSON.stringify(closed).includes("closed"));
            const reread = await tenant.rest.getConversation(tenant.apiKey, conversationId);
            assert.equal(reread.status, "closed");
        } finally {
            await agent.close();
        }
    });

    test("errors are typed by status, with the body's code", LIMIT, async () => {
        const tenant = await setupTenant(mainNode());
        await assert.rejects(tenant.rest.listChannels("cvg_key_wrong"), (error: unknown) => {
            assert.ok(error instanceof AuthenticationError);
            assert.equal(error.status, 401);
            return true;
        });
        const { token } = await tenant.conversation("alice");
        await assert.rejects(
            tenant.rest.listActivities(token, "00000000-0000-7000-8000-000000000000"),
            (error: unknown) =>
                error instanceof RestError && error.status >= 400 && error.status < 500,
        );
        await assert.rejects(
            tenant.rest.getConversation(tenant.apiKey, "00000000-0000-7000-8000-000000000000"),
            NotFoundError,
        );
        const unreachable = new RestClient("http://127.0.0.1:9", { timeoutMs: 2000 });
        await assert.rejects(unreachable.ready());
    });
});
