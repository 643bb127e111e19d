"""Test support: a real `converger serve` process per test, a TCP proxy that injects network
faults, and helpers that wait for observable events (never for a guessed amount of time).

Mirrors tests/support/cluster.rs of the repository: the node gets its settings from
environment variables, picks its ports itself, and its addresses are read from its JSON logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from converger import Backoff, Conversation, Message, RestClient

SDK_ROOT = Path(__file__).resolve().parents[1]
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
SETTLE_MS = 300
NODE_START_TIMEOUT = 60.0
WAIT = 15.0  # the longest any single observable event may take in these tests
FAST = Backoff(initial=0.05, maximum=0.3)  # faults are injected on purpose: come back quickly


def test_secrets() -> tuple[str, str]:
    """(secret_key, admin_token) of config/test.toml."""
    path = REPO_ROOT / "config" / "test.toml"
    try:
        config = tomllib.loads(path.read_text())
        return str(config["secret_key"]), str(config["admin_token"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "test-secret-key-0123456789abcdef0123456789", "test-admin-token-0123456789"


def converger_bin() -> str:
    """CONVERGER_BIN, else the debug build in CARGO_TARGET_DIR (as cargo test left it), else in
    <repo root>/target."""
    if binary := os.environ.get("CONVERGER_BIN"):
        return binary
    target = os.environ.get("CARGO_TARGET_DIR") or str(REPO_ROOT / "target")
    return str(Path(target) / "debug" / "converger")


# --- Postgres -------------------------------------------------------------------------
#
# The psql client is used rather than a Python driver: it is there wherever the PostgreSQL
# server binaries are (which the node's embedded fallback needs anyway), it speaks the same
# URLs as the node (libpq), and the SDK's test extra stays free of a database dependency.


def _psql(url: str, sql: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", url, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PGCONNECT_TIMEOUT": "5"},
        check=False,
    )


def postgres_server() -> str | None:
    """The maintenance URL of the test Postgres, or None when nothing answers there."""
    url = os.environ.get("CONVERGER_TEST_DATABASE_URL") or DEFAULT_DATABASE_URL
    if shutil.which("psql") is None:
        print("psql is not installed; the nodes start their embedded Postgres", file=sys.stderr)
        return None
    try:
        answered = _psql(url, "SELECT 1", timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        answered = False
    if not answered:
        print(f"nothing answers at {url}; the nodes start their embedded Postgres", file=sys.stderr)
        return None
    return url


def with_database(url: str, name: str) -> str:
    """`url` naming the database `name`."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def create_database(server_url: str) -> tuple[str, str]:
    """A fresh database: (name, url)."""
    name = f"converger_sdk_{uuid.uuid4().hex}"
    done = _psql(server_url, f"CREATE DATABASE {name}")
    if done.returncode != 0:
        raise RuntimeError(f"cannot create {name}: {done.stderr}")
    return name, with_database(server_url, name)


def drop_database(server_url: str, name: str) -> None:
    """Drops a test database (ending leftover connections)."""
    done = _psql(server_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    if done.returncode != 0:
        print(f"could not drop {name}: {done.stderr}", file=sys.stderr)


# --- The node process ---------------------------------------------------------------------


@dataclass
class Node:
    """One `converger serve` process."""

    process: subprocess.Popen[bytes]
    base_url: str
    gossip_addr: str
    state_dir: Path
    admin_token: str
    database_url: str
    logs: deque[str] = field(repr=False)
    guest: bool = False  # embedded mode: uses another node's private Postgres

    @property
    def embedded(self) -> bool:
        """Whether the node runs its own private Postgres."""
        return self.database_url == ""

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://", 1) + "/socket/converger/v1"

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def stop(self) -> None:
        """Ends the process: SIGKILL over a shared Postgres, SIGTERM with the embedded one
        (so it stops its private Postgres), SIGKILL if that takes too long."""
        if self.process.poll() is None:
            if self.embedded:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.process.kill()
            else:
                self.process.kill()
        self.process.wait()
        if self.embedded and not self.guest:
            _stop_leftover_postgres(self.state_dir / "postgres")


def _stop_leftover_postgres(data_dir: Path) -> None:
    pid_file = data_dir / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGQUIT)


def start_node(
    database_url: str, extra_env: dict[str, str] | None = None, state_dir: Path | None = None
) -> Node:
    """Starts a node over `database_url` ("" = the embedded Postgres under its state dir) and
    waits until its logs show it listening (HTTP, gossip and the event bus).

    With `state_dir` of a running embedded-mode node, the new node reuses that node's private
    Postgres (a second node over the same database).
    """
    secret_key, admin_token = test_secrets()
    guest = state_dir is not None
    state_dir = state_dir or Path(tempfile.mkdtemp(prefix="converger-sdk-"))
    env = {
        **os.environ,
        "CONVERGER_DATABASE_URL": database_url,
        "CONVERGER_HTTP_ADDR": "127.0.0.1:0",
        "CONVERGER_GOSSIP_ADDR": "127.0.0.1:0",
        "CONVERGER_SECRET_KEY": secret_key,
        "CONVERGER_ADMIN_TOKEN": admin_token,
        "CONVERGER_STATE_DIR": str(state_dir),
        "CONVERGER_GROUP_SETTLE_MS": str(SETTLE_MS),
        "CONVERGER_DRAIN__BATCH_INTERVAL_MS": "10",
        "CONVERGER_DRAIN__RETRY_AFTER_MS": "50",
        "CONVERGER_DRAIN__TIMEOUT_MS": "2000",
        "CONVERGER_LOG_FORMAT": "json",
        "RUST_LOG": os.environ.get("NODE_LOG_FILTER", "info,sqlx=warn,chitchat=warn"),
        **(extra_env or {}),
    }
    binary = converger_bin()
    if not Path(binary).exists():
        raise RuntimeError(
            f"{binary} is missing: build it (cargo build -p converger-cli) or set CONVERGER_BIN"
        )
    process = subprocess.Popen(
        [binary, "serve"],
        env=env,
        cwd=state_dir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    logs: deque[str] = deque(maxlen=2000)
    found: dict[str, str] = {}
    ready = threading.Event()

    def drain() -> None:
        # Reads every line until the process ends, so it never blocks on a full pipe.
        assert process.stderr is not None
        for raw in process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            logs.append(line)
            try:
                fields = json.loads(line).get("fields", {})
            except (ValueError, AttributeError):
                continue
            message = fields.get("message")
            if message == "converger listening":
                found["http"] = str(fields.get("addr"))
            elif message == "gossip started":
                found["gossip"] = str(fields.get("gossip_addr"))
            elif message == "event bus listening":
                found["bus"] = "yes"
            if len(found) == 3:
                ready.set()
        ready.set()

    threading.Thread(target=drain, name="node-stderr", daemon=True).start()
    if not ready.wait(NODE_START_TIMEOUT) or len(found) < 3:
        process.kill()
        process.wait()
        tail = "\n".join(list(logs)[-30:])
        raise RuntimeError(f"the node did not start in time:\n{tail}")
    return Node(
        process=process,
        base_url=f"http://{found['http']}",
        gossip_addr=found["gossip"],
        state_dir=state_dir,
        admin_token=admin_token,
        database_url=database_url,
        logs=logs,
        guest=guest,
    )


# --- A tenant and a channel on a node -----------------------------------------------------


@dataclass
class Env:
    """A node with a tenant and one channel, and a REST client for it."""

    node: Node
    rest: RestClient
    api_key: str
    channel_id: str
    secret: str

    @property
    def url(self) -> str:
        return self.node.base_url

    async def agent_token(self, user_id: str | None = None) -> str:
        return await self.rest.mint_agent_token(self.secret, user_id=user_id)

    async def conversation(self, user_id: str = "alice") -> tuple[str, str]:
        """A new conversation of `user_id`: (conversation id, bound token)."""
        created = await self.rest.mint_conversation(self.secret, user_id)
        return created.conversation_id, created.token

    async def frames(self, conversation_id: str) -> list[Message]:
        """Every stored frame of the conversation (agent view, over REST)."""
        token = await self.agent_token()
        return await self.rest.all_activities(token, conversation_id)

    def sql(self, statement: str) -> str:
        """Runs one SQL statement on the node's database (shared Postgres only) and returns
        psql's unaligned output; skips the test when the node runs its embedded Postgres."""
        if self.node.embedded:
            pytest.skip("needs the shared test Postgres (the node runs its embedded one)")
        done = _psql(self.node.database_url, statement)
        if done.returncode != 0:
            raise RuntimeError(f"{statement!r} failed: {done.stderr}")
        return done.stdout.strip()

    async def answers(self, conversation_id: str) -> list[Message]:
        """The agents' frames of the conversation, over REST."""
        return [
            frame
            for frame in await self.frames(conversation_id)
            if frame.sender is not None and frame.sender.role == "agent"
        ]


def turn_of(answer: Message) -> int:
    """The turn seq an answer of the test agents names: their text starts `#<seq> `."""
    text = answer.text or ""
    assert text.startswith("#"), text
    return int(text[1:].split(" ", 1)[0])


# --- Waiting for things -------------------------------------------------------------------


async def eventually(
    what: str, condition: Callable[[], Any], timeout: float = WAIT, every: float = 0.02
) -> None:
    """Polls an observable condition (sync or async) until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(every)


async def next_message(
    conversation: Conversation, predicate: Callable[[Message], bool], timeout: float = WAIT
) -> Message:
    """The next persistent frame matching `predicate` (others are skipped)."""
    async with asyncio.timeout(timeout):
        while True:
            message = await conversation.next_message()
            if predicate(message):
                return message


async def first_of(
    iterator: AsyncIterator[Any], predicate: Callable[[Any], bool], timeout: float = WAIT
) -> Any:
    """The next item of an async iterator matching `predicate` (others are skipped)."""
    async with asyncio.timeout(timeout):
        async for item in iterator:
            if predicate(item):
                return item
    raise AssertionError("the iterator ended")


async def collect(iterator: AsyncIterator[Any], count: int, timeout: float = WAIT) -> list[Any]:
    """The next `count` items of an async iterator."""
    items: list[Any] = []
    async with asyncio.timeout(timeout):
        async for item in iterator:
            items.append(item)
            if len(items) == count:
                break
    return items


class Recorder:
    """A list that can be awaited until it holds enough items, or a matching one."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._waiters: list[tuple[Callable[[list[Any]], bool], asyncio.Future[None]]] = []

    def append(self, item: Any) -> None:
        self.items.append(item)
        for condition, future in self._waiters:
            if not future.done() and condition(self.items):
                future.set_result(None)

    def __len__(self) -> int:
        return len(self.items)

    async def wait_until(
        self, condition: Callable[[list[Any]], bool], what: str, timeout: float = WAIT
    ) -> list[Any]:
        if not condition(self.items):
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append((condition, future))
            try:
                async with asyncio.timeout(timeout):
                    await future
            except TimeoutError:
                raise AssertionError(f"timed out waiting for {what}: {self.items}") from None
        return self.items

    async def wait_for(self, count: int, timeout: float = WAIT) -> list[Any]:
        return await self.wait_until(lambda items: len(items) >= count, f"{count} items", timeout)


# --- Ownership (ADR 0006) -------------------------------------------------------------------

_MASK = (1 << 64) - 1


def owner_hash(conversation_id: str, connection_id: str) -> int:
    """converger's owner_hash: SplitMix64 of 64-bit FNV-1a over conversation, 0, connection."""
    value = 0xCBF29CE484222325
    for byte in conversation_id.encode() + b"\x00" + connection_id.encode():
        value ^= byte
        value = (value * 0x100000001B3) & _MASK
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def owner(conversation_id: str, connection_ids: list[str]) -> str:
    """The member owning a conversation among members that are all eligible."""
    return max(connection_ids, key=lambda member: (owner_hash(conversation_id, member), member))


# --- A TCP proxy that injects network faults ------------------------------------------------


class Proxy:
    """Forwards 127.0.0.1:<port> to the node, and breaks the connections on demand.

    - `drop_downstream = True`: bytes from the node are discarded (a lost ack);
    - `accepting = False`: new connections are closed at once (the node is unreachable);
    - `cut()`: every open connection is reset on both sides (a dead network path).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.accepting = True
        self.drop_downstream = False
        self.accepted = 0
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/socket/converger/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if not self.accepting:
                writer.transport.abort()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:
                writer.transport.abort()
                return
            self.accepted += 1
            pair = (writer, up_writer)
            self._pairs.add(pair)
            try:
                await asyncio.gather(
                    self._pump(reader, up_writer, downstream=False),
                    self._pump(up_reader, writer, downstream=True),
                )
            finally:
                self._pairs.discard(pair)
                writer.transport.abort()
                up_writer.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, downstream: bool
    ) -> None:
        try:
            while True:
                data = await source.read(65536)
                if not data:
                    break
                if downstream and self.drop_downstream:
                    continue
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.transport.abort()

    def cut(self) -> None:
        """Resets every open connection, both sides."""
        for client, upstream in list(self._pairs):
            client.transport.abort()
            upstream.transport.abort()

    async def close(self) -> None:
        self.accepting = False
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)


# --- Processes (examples, helper agents) ----------------------------------------------------


class Script:
    """A Python script run as a child process with its stdout read line by line."""

    def __init__(self, path: Path, env: dict[str, str]) -> None:
        self.path = path
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(SDK_ROOT / "src"), os.environ.get("PYTHONPATH", "")]
            ),
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.process: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self.stderr = b""

    async def start(self) -> Script:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(self.path),
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self.process.stderr is not None
        self._stderr_task = asyncio.create_task(self._read_stderr())
        return self

    async def _read_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        self.stderr = await self.process.stderr.read()

    async def line(self, prefix: str, timeout: float = WAIT) -> str:
        """The next stdout line starting with `prefix`."""
        assert self.process is not None and self.process.stdout is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    raw = await self.process.stdout.readline()
                    if not raw:
                        raise AssertionError(f"{self.path.name} exited: {await self.error_text()}")
                    line = raw.decode().rstrip("\n")
                    self.lines.append(line)
                    if line.startswith(prefix):
                        return line
        except TimeoutError:
            raise AssertionError(
                f"{self.path.name} printed no {prefix!r} line: {self.lines} {self.stderr[-2000:]!r}"
            ) from None

    async def error_text(self) -> str:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._stderr_task
        return self.stderr.decode(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    async def terminate(self, timeout: float = WAIT) -> int:
        """SIGTERM, then the exit status."""
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(timeout):
            return await self.process.wait()

    async def wait_killed(self) -> None:
        assert self.process is not None
        async with asyncio.timeout(WAIT):
            await self.process.wait()
