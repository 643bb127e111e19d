#!/usr/bin/env python3
"""A converger agent in plain Python: joins a group and answers every turn with an echo,
counting the turns of each conversation in the conversation's runtime state.

    pip install websockets   # Python 3.11+
    CONVERGER_WS_URL=ws://127.0.0.1:8080/socket/converger/v1 \
    CONVERGER_AGENT_TOKEN=<channel-scope token> python3 docs/examples/agent.py [--once]

docs/agents.md explains the protocol rules this file follows.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

URL = os.environ.get("CONVERGER_WS_URL", "ws://127.0.0.1:8080/socket/converger/v1")
GROUP = os.environ.get("CONVERGER_AGENT_GROUP", "python")
RESEND_AFTER = 5.0  # seconds without an ack before the same result is sent again
FATAL_CLOSES = {4400, 4401, 4403}  # bad hello, bad or expired token, inactive channel
MEMORY = 10_000  # bound on the per-conversation memories below


class Fatal(Exception):
    pass


def remember(table, key, value):
    table[key] = value
    if len(table) > MEMORY:  # dicts keep insertion order: drop the oldest entry
        table.pop(next(iter(table)))


class EchoAgent:
    def __init__(self, token, once):
        self.token, self.once = token, once
        self.unacked = {}  # clientId -> [envelope text, last send time, (turn, frame seq)]
        self.answered = {}  # turn keys already answered or in flight: replays repeat turns
        self.runtime = {}  # conversationId -> (version, state) as this agent last wrote it
        self.seen = {}  # conversationId -> highest seq received, for hello.watermarks
        self.finished = asyncio.Event()  # set on the first ack when --once
        self.attempt = 0  # failed connections in a row, for the backoff

    async def run(self):
        while not self.finished.is_set():
            retry_after = 0.0
            try:
                async with connect(URL, subprotocols=["converger.v1"]) as ws:
                    await self.serve(ws)
            except ConnectionClosed as closed:
                frame = closed.rcvd
                if frame is not None and frame.code in FATAL_CLOSES:
                    raise Fatal(f"closed {frame.code} {frame.reason}")
                try:  # 1012 (draining) and 4503 (slow consumer) tell us when to come back
                    retry_after = json.loads(frame.reason)["retryAfterMs"] / 1000
                except (AttributeError, ValueError, KeyError, TypeError):
                    pass
                log(f"disconnected: {closed}")
            except InvalidStatus as refused:  # HTTP 503 + Retry-After while the node drains
                retry_after = float(refused.response.headers.get("Retry-After", 0))
                log(f"upgrade refused: {refused}")
            except (OSError, WebSocketException) as error:  # TimeoutError is an OSError
                log(f"cannot connect: {error}")
            if self.finished.is_set():
                break
            # Full jitter: many agents cut off together (a node drains) do not come back together.
            self.attempt += 1
            delay = max(retry_after, random.uniform(0, min(30.0, 0.5 * 2**self.attempt)))
            log(f"reconnecting in {delay:.1f}s")
            await asyncio.sleep(delay)

    async def serve(self, ws):
        # Turns committed while we were away are not pushed to a new member; watermarks ask for
        # the frames after what we saw, per conversation (ones we answered are skipped below).
        await ws.send(json.dumps({"type": "hello", "protocol": "converger/1", "token": self.token,
                                  "group": GROUP, "watermarks": self.seen}))
        welcome = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if welcome.get("type") != "welcome":
            raise Fatal(f"refused at hello: {welcome}")
        data = welcome["data"]
        self.attempt = 0  # we were welcomed: the next outage starts again from a short delay
        # On stdout so scripts (and tests/python_agent.rs) know when turns will reach us.
        print(f"joined group {GROUP} as {data['connectionId']} since {data['since']}", flush=True)
        for entry in self.unacked.values():  # results of the last connection still unacked
            entry[1] = time.monotonic()
            await ws.send(entry[0])
        resender = asyncio.create_task(self.resend(ws))
        try:
            # The server pings every heartbeatIntervalMs and closes 4408 after idleTimeoutMs of
            # silence: websockets answers those pings with pongs by itself (and pings the server
            # too, to notice a dead link). `heartbeat` frames need no answer.
            async for text in ws:
                await self.on_message(ws, json.loads(text))
                if self.finished.is_set():
                    return
        finally:
            resender.cancel()

    async def resend(self, ws):
        # The same clientId and the same content: the server answers a repeat with the original
        # ack (duplicate: true), so a lost ack never gives the user a second answer.
        try:
            while True:
                await asyncio.sleep(1)
                for entry in list(self.unacked.values()):
                    if time.monotonic() - entry[1] >= RESEND_AFTER:
                        entry[1] = time.monotonic()
                        await ws.send(entry[0])
        except ConnectionClosed:
            pass  # the reader sees the close too and reconnects; unacked results go again then

    async def on_message(self, ws, message):
        if "frame" not in message:  # bare: heartbeat (nothing to answer) or a connection error
            if message.get("type") == "error":
                log(f"connection error: {message['data']}")  # a close frame follows if fatal
            return
        conversation, frame = message["conversationId"], message["frame"]
        kind = frame.get("type")
        if frame.get("seq", 0) > self.seen.get(conversation, 0):
            remember(self.seen, conversation, frame["seq"])
        if kind == "ack" and frame.get("clientId") in self.unacked:
            self.unacked.pop(frame["clientId"])
            log(f"acked {frame['turn']} -> seqs {frame['seqs']}"
                + (" (duplicate)" if frame.get("duplicate") else ""))
            if self.once:
                self.finished.set()
        elif kind == "error":
            await self.on_error(ws, conversation, frame["data"])
        elif "turn" in frame.get("meta", {}):
            await self.answer(ws, conversation, frame)
        # Anything else (other parties' frames, typing, forwarded frames) is not for an echo.

    async def answer(self, ws, conversation, frame):
        turn, runtime = frame["meta"]["turn"], frame["meta"].get("runtime", {})
        if turn["key"] in self.answered:
            return
        remember(self.answered, turn["key"], True)
        # The delivered runtime was read when the turn was delivered; a turn that arrives while
        # our previous answer is still in flight carries an older version. Build on the newest.
        version, state = runtime.get("version", 0), runtime.get("state", {})
        mine = self.runtime.get(conversation)
        if mine and mine[0] > version:
            version, state = mine
        count = state.get("count", 0) + 1
        text = frame.get("data", {}).get("text", "")
        # One clientId per turn revision (the Rust client's scheme); resends reuse it.
        client_id = f"result-{conversation.replace('-', '')}-{turn['seq']}-{turn['revision']}"
        result = {"type": "turnResult", "clientId": client_id,
                  "turn": {"seq": turn["seq"], "revision": turn["revision"]},
                  "frames": [{"type": "text", "data": {"text": f"echo {count}: {text}"}}],
                  "runtime": {"version": version, "state": {**state, "count": count}}}
        envelope = json.dumps({"conversationId": conversation, "frame": result})
        remember(self.runtime, conversation, (version + 1, result["runtime"]["state"]))
        self.unacked[client_id] = [envelope, time.monotonic(), (turn, frame.get("seq"))]
        await ws.send(envelope)

    async def on_error(self, ws, conversation, data):
        entry = self.unacked.get(data.get("clientId"))
        code = data.get("code")
        log(f"refused {code}: {data.get('message')} {data.get('details', '')}")
        if entry is None:
            return
        if code == "internal":  # the database failed; the resend loop sends it again
            return
        del self.unacked[data["clientId"]]
        turn, frame_seq = entry[2]
        if code == "stale_runtime":
            # Someone else wrote the runtime (another member, a takeover). Forget what we
            # thought it was and ask for the turn again: a replayed turn carries the runtime
            # as of now, and we answer it afresh.
            self.runtime.pop(conversation, None)
            self.answered.pop(turn["key"], None)
            sync = {"type": "sync", "watermark": max((frame_seq or 1) - 1, 0)}
            await ws.send(json.dumps({"conversationId": conversation, "frame": sync}))
        # turn_conflict (answered elsewhere), turn_superseded (the user edited or regenerated;
        # the new revision is delivered to us), bad_request, invalid_message: drop the result.


def log(line):
    print(line, file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="exit 0 after the first acked result")
    args = parser.parse_args()
    token = os.environ.get("CONVERGER_AGENT_TOKEN")
    if not token:
        sys.exit("CONVERGER_AGENT_TOKEN is required (a channel-scope token)")
    try:
        asyncio.run(EchoAgent(token, args.once).run())
    except Fatal as error:
        sys.exit(f"giving up: {error}")
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
