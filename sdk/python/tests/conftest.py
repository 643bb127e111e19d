"""Fixtures: a real node per test (fresh database, or the node's embedded Postgres), a tenant
with a channel on it, and a fault-injecting proxy."""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from support import (
    Env,
    Node,
    Proxy,
    create_database,
    drop_database,
    postgres_server,
    start_node,
)

from converger import RestClient


@pytest.fixture(scope="session")
def database_server() -> str | None:
    """The shared Postgres of the run, or None (each node then starts its own)."""
    return postgres_server()


@pytest.fixture
def node(database_server: str | None, request: pytest.FixtureRequest) -> Iterator[Node]:
    """A `converger serve` process over a database of its own.

    `@pytest.mark.node_env({...})` adds environment variables (configuration) for the node.
    """
    marker = request.node.get_closest_marker("node_env")
    extra: dict[str, str] = dict(marker.args[0]) if marker else {}
    name: str | None = None
    if database_server is not None:
        name, url = create_database(database_server)
    else:
        url = ""
    started = start_node(url, extra)
    try:
        yield started
    finally:
        started.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            tail = "\n".join(list(started.logs)[-60:])
            print(f"\n--- last node log lines ---\n{tail}")
        if database_server is not None and name is not None:
            drop_database(database_server, name)
        shutil.rmtree(started.state_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


@pytest_asyncio.fixture
async def env(node: Node) -> AsyncIterator[Env]:
    """A tenant with one channel on the node."""
    async with RestClient(node.base_url) as rest:
        tenant = await rest.create_tenant(node.admin_token, f"acme-{uuid.uuid4().hex[:8]}")
        channel = await rest.create_channel(tenant.api_key, "web")
        assert channel.secret is not None
        yield Env(node, rest, tenant.api_key, channel.id, channel.secret)


@pytest_asyncio.fixture
async def proxy(node: Node) -> AsyncIterator[Proxy]:
    """A proxy in front of the node, for network faults."""
    started = await Proxy(node.port).start()
    try:
        yield started
    finally:
        await started.close()


@pytest.fixture(autouse=True)
def _sdk_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="converger")
