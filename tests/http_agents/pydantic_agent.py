"""A real Pydantic AI agent behind Pydantic AI's own AG-UI endpoint, for tests/http_agents.rs.

The model is a scripted `FunctionModel`, so no network or LLM is involved, but everything between
the HTTP request and the SSE events (input validation, `StateDeps`, tool calls, the AG-UI event
encoding) is the installed Pydantic AI's real code. Each run: the model calls the `remember` tool,
which bumps the AG-UI state and publishes it as a STATE_SNAPSHOT; then it streams
"echo: <last user text>" in several TEXT_MESSAGE_CONTENT deltas.

Usage: pydantic_agent.py [--port N]; prints `READY <port>` once listening. With AGENT_SECRET set,
requests must carry a valid `X-Converger-Signature`. `GET /calls` lists the requests seen.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from ag_ui.core import StateSnapshotEvent
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext, ToolReturn
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import (
    AgentInfo,
    DeltaToolCall,
    DeltaToolCalls,
    FunctionModel,
)
from pydantic_ai.ui import StateDeps
from pydantic_ai.ui.ag_ui import AGUIAdapter
from serving import serve
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# How far a signature's timestamp may be from now, as the gateway's contract says.
SIGNATURE_TOLERANCE_S = 300


class TurnState(BaseModel):
    """The AG-UI state the gateway round-trips; validated from `RunAgentInput.state`."""

    turns: int = 0
    last: str = ""


def last_user_text(messages: list[ModelMessage]) -> str:
    for message in reversed(messages):
        if isinstance(message, ModelRequest):
            for part in reversed(message.parts):
                if isinstance(part, UserPromptPart):
                    if isinstance(part.content, str):
                        return part.content
                    return "".join(
                        item for item in part.content if isinstance(item, str)
                    )
    return ""


async def script(
    messages: list[ModelMessage], info: AgentInfo
) -> AsyncIterator[str | DeltaToolCalls]:
    text = last_user_text(messages)
    latest = messages[-1]
    if not (
        isinstance(latest, ModelRequest)
        and any(isinstance(part, ToolReturnPart) for part in latest.parts)
    ):
        # First model request of the run: nothing has been remembered yet.
        yield {0: DeltaToolCall(name="remember", json_args=json.dumps({"text": text}))}
        return
    reply = f"echo: {text}"
    # Word-sized deltas, or characters when that gives fewer than three, so the client always
    # sees a message assembled from several TEXT_MESSAGE_CONTENT events.
    chunks = re.findall(r"\S+\s*", reply)
    for chunk in chunks if len(chunks) >= 3 else list(reply):
        yield chunk


agent = Agent(FunctionModel(stream_function=script), deps_type=StateDeps[TurnState])


@agent.tool
async def remember(ctx: RunContext[StateDeps[TurnState]], text: str = "") -> ToolReturn:
    state = ctx.deps.state
    state.turns += 1
    state.last = text
    # Pydantic AI's AG-UI stream emits AG-UI events found in a tool return's metadata verbatim,
    # right after the TOOL_CALL_RESULT: that is its way of publishing state.
    return ToolReturn(
        return_value=f"remembered turn {state.turns}",
        metadata=[StateSnapshotEvent(snapshot=state.model_dump())],
    )


CALLS: list[dict[str, Any]] = []


async def run_agent(request: Request) -> Response:
    # Fresh deps per request: the adapter writes the validated input state into them.
    return await AGUIAdapter.dispatch_request(
        request, agent=agent, deps=StateDeps(TurnState())
    )


async def calls(request: Request) -> Response:
    return JSONResponse(CALLS)


def signature_ok(secret: bytes, header: str | None, body: bytes) -> bool:
    if not header:
        return False
    fields = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
    stamp, given = fields.get("t", ""), fields.get("v1", "")
    if not stamp.isdigit() or abs(time.time() - int(stamp)) > SIGNATURE_TOLERANCE_S:
        return False
    expected = hmac.new(
        secret, stamp.encode() + b"." + body, hashlib.sha256
    ).hexdigest()
    return hmac.compare_digest(expected, given)


class SignatureCheck:
    """Records each request and, with a secret, rejects unsigned or badly signed ones.

    Pure ASGI rather than BaseHTTPMiddleware: it must read the raw body to check the HMAC and
    then hand the same bytes to the app, while later `receive` calls (the disconnect the SSE
    response listens for) still reach the real connection.
    """

    def __init__(self, app: ASGIApp, secret: bytes | None) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The test's own GET /calls is neither checked nor recorded.
        if scope["type"] != "http" or scope["path"] == "/calls":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = Headers(scope=scope)
        signed = None
        if self.secret is not None:
            signed = signature_ok(
                self.secret, headers.get("x-converger-signature"), body
            )
        CALLS.append(
            {
                "key": headers.get("idempotency-key"),
                "signed": signed,
                "path": scope["path"],
            }
        )
        if signed is False:
            await PlainTextResponse("invalid signature", status_code=401)(
                scope, receive, send
            )
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    secret = os.environ.get("AGENT_SECRET")
    app = Starlette(
        routes=[
            Route("/calls", calls),
            Route("/{path:path}", run_agent, methods=["POST"]),
        ]
    )
    asyncio.run(
        serve(SignatureCheck(app, secret.encode() if secret else None), args.port)
    )


if __name__ == "__main__":
    main()
