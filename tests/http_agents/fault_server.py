"""A scripted AG-UI agent that misbehaves on request, for tests/http_agents.rs.

Events are built with the `ag-ui-protocol` package's own types and `EventEncoder`, so what the
well-behaved modes send is what a real AG-UI server sends. The mode is the request path (all
POST); "attempt" counts the calls with the same path and `Idempotency-Key`, which lets a test
see a retry of the same turn succeed where the first try failed.

Usage: fault_server.py [--port N]; prints `READY <port>` once listening.
Control: GET /calls, POST /reset (clears calls), POST /health {"healthy": bool} (for /toggle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ag_ui.core import (
    BaseEvent,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    StateDeltaEvent,
    StateSnapshotEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
)
from ag_ui.encoder import EventEncoder
from serving import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

CALLS: list[dict[str, Any]] = []
HEALTH = {"healthy": True}
ENCODER = EventEncoder()


class Run:
    """One agent call: its parsed body and which attempt it is."""

    def __init__(self, request: Request, body: dict[str, Any]) -> None:
        self.thread_id = str(body.get("threadId", ""))
        self.run_id = str(body.get("runId", ""))
        self.text = last_user_text(body)
        key = request.headers.get("idempotency-key")
        path = request.url.path
        self.attempt = 1 + sum(
            1 for c in CALLS if c["path"] == path and c["key"] == key
        )
        self.record: dict[str, Any] = {
            "path": path,
            "key": key,
            "attempt": self.attempt,
        }
        CALLS.append(self.record)

    def started(self) -> RunStartedEvent:
        return RunStartedEvent(thread_id=self.thread_id, run_id=self.run_id)

    def finished(self) -> RunFinishedEvent:
        return RunFinishedEvent(thread_id=self.thread_id, run_id=self.run_id)


def last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(
                content, list
            ):  # AG-UI multimodal content: keep the text parts
                return "".join(
                    p.get("text", "") for p in content if isinstance(p, dict)
                )
            return content if isinstance(content, str) else ""
    return ""


def sse(events: AsyncIterator[BaseEvent]) -> StreamingResponse:
    async def encoded() -> AsyncIterator[str]:
        async for event in events:
            yield ENCODER.encode(event)

    return StreamingResponse(encoded(), media_type=ENCODER.get_content_type())


async def text_message(
    message_id: str, deltas: list[str], pause: float = 0.0
) -> AsyncIterator[BaseEvent]:
    yield TextMessageStartEvent(message_id=message_id, role="assistant")
    for i, delta in enumerate(deltas):
        if i and pause:
            await asyncio.sleep(pause)
        yield TextMessageContentEvent(message_id=message_id, delta=delta)
    yield TextMessageEndEvent(message_id=message_id)


async def ok_events(
    run: Run, deltas: list[str] | None = None, pause: float = 0.0
) -> AsyncIterator[BaseEvent]:
    if deltas is None:
        # AG-UI rejects an empty delta, so an empty user text adds none.
        deltas = ["fault server: ", *([run.text] if run.text else [])]
    yield run.started()
    async for event in text_message(f"m-{run.attempt}", deltas, pause):
        yield event
    yield StateSnapshotEvent(snapshot={"mode": "ok", "attempt": run.attempt})
    yield run.finished()


class CutResponse(Response):
    """Starts an SSE stream, sends a few events, then returns without finishing the body.

    Chosen over raising inside a StreamingResponse generator: uvicorn reacts the same way
    (closes the connection mid chunked body, so the client sees a truncated stream, not a clean
    end), but logs one error line instead of a traceback.
    """

    def __init__(self, events: list[BaseEvent]) -> None:
        super().__init__()
        self.chunks = [ENCODER.encode(event).encode() for event in events]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", ENCODER.get_content_type().encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})


def server_error() -> Response:
    return PlainTextResponse("boom", status_code=500)


async def ok(run: Run, request: Request) -> Response:
    return sse(ok_events(run))


async def fail_first(run: Run, request: Request) -> Response:
    return (
        server_error()
        if run.attempt <= int(request.path_params["n"])
        else sse(ok_events(run))
    )


async def cut_first(run: Run, request: Request) -> Response:
    if run.attempt > 1:
        return sse(ok_events(run))
    start = TextMessageStartEvent(message_id="m-1", role="assistant")
    return CutResponse(
        [
            run.started(),
            start,
            TextMessageContentEvent(message_id="m-1", delta="partial "),
        ]
    )


async def hang_first(run: Run, request: Request) -> Response:
    if run.attempt > 1:
        return sse(ok_events(run))

    async def hang() -> AsyncIterator[BaseEvent]:
        yield run.started()
        # Starlette cancels this when the client disconnects (it listens for http.disconnect).
        await asyncio.sleep(3600)

    return sse(hang())


async def run_error(run: Run, request: Request) -> Response:
    async def events() -> AsyncIterator[BaseEvent]:
        yield run.started()
        yield RunErrorEvent(message="scripted failure", code="scripted")

    return sse(events())


async def invalid(run: Run, request: Request) -> Response:
    async def chunks() -> AsyncIterator[str]:
        yield 'data: {"type": "NOT_AN_EVENT"}\n\n'
        yield "data: not json\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def slow(run: Run, request: Request) -> Response:
    # "ended" tells a test whether the caller read the whole run or went away mid-way.
    async def events() -> AsyncIterator[BaseEvent]:
        try:
            async for event in ok_events(
                run, [f"w{i} " for i in range(10)], pause=0.15
            ):
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            run.record["ended"] = "disconnected"
            raise
        run.record["ended"] = "complete"

    return sse(events())


async def always_500(run: Run, request: Request) -> Response:
    return server_error()


async def toggle(run: Run, request: Request) -> Response:
    return sse(ok_events(run)) if HEALTH["healthy"] else server_error()


async def json_reply(run: Run, request: Request) -> Response:
    message = {
        "id": f"j-{run.attempt}",
        "role": "assistant",
        "content": f"json: {run.text}",
    }
    return JSONResponse({"messages": [message], "state": {"json": True}})


async def delta(run: Run, request: Request) -> Response:
    async def events() -> AsyncIterator[BaseEvent]:
        yield run.started()
        yield StateSnapshotEvent(snapshot={"count": 1, "items": []})
        patch = [
            {"op": "replace", "path": "/count", "value": 2},
            {"op": "add", "path": "/items/-", "value": "x"},
        ]
        yield StateDeltaEvent.model_validate({"delta": patch})
        async for event in text_message(f"m-{run.attempt}", ["delta"]):
            yield event
        yield run.finished()

    return sse(events())


async def big(run: Run, request: Request) -> Response:
    # 200 x 10,000 characters: about 2 MB of deltas, to trip a response size cap.
    async def events() -> AsyncIterator[BaseEvent]:
        yield run.started()
        async for event in text_message(
            f"m-{run.attempt}", ["0123456789" * 1000] * 200
        ):
            yield event
        yield run.finished()

    return sse(events())


Mode = Callable[[Run, Request], Awaitable[Response]]


def agent_route(path: str, mode: Mode) -> Route:
    async def endpoint(request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        return await mode(Run(request, body if isinstance(body, dict) else {}), request)

    return Route(path, endpoint, methods=["POST"])


async def calls(request: Request) -> Response:
    return JSONResponse(CALLS)


async def reset(request: Request) -> Response:
    CALLS.clear()
    return JSONResponse({"ok": True})


async def health(request: Request) -> Response:
    HEALTH["healthy"] = bool((await request.json()).get("healthy", True))
    return JSONResponse(HEALTH)


MODES: dict[str, Mode] = {
    "/ok": ok,
    "/fail-first/{n:int}": fail_first,
    "/cut-first": cut_first,
    "/hang-first": hang_first,
    "/run-error": run_error,
    "/invalid": invalid,
    "/slow": slow,
    "/always-500": always_500,
    "/toggle": toggle,
    "/json": json_reply,
    "/delta": delta,
    "/big": big,
}

app = Starlette(
    routes=[
        Route("/calls", calls),
        Route("/reset", reset, methods=["POST"]),
        Route("/health", health, methods=["POST"]),
        *(agent_route(path, mode) for path, mode in MODES.items()),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(serve(app, parser.parse_args().port))


if __name__ == "__main__":
    main()
