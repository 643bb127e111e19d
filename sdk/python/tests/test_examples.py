"""The examples, run as processes with their environment variables, driven by an end user."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from support import FAST, SDK_ROOT, Env, Script, first_of, next_message

from converger import Conversation, ErrorEvent, Message, StreamUpdate, Typing

EXAMPLES = SDK_ROOT / "examples"


async def start_example(
    env: Env, name: str, group: str, extra: dict[str, str] | None = None
) -> Script:
    script = Script(
        EXAMPLES / name,
        {
            "CONVERGER_URL": env.url,
            "CONVERGER_AGENT_TOKEN": await env.agent_token(),
            "CONVERGER_AGENT_GROUP": group,
            **(extra or {}),
        },
    )
    await script.start()
    ready = await script.line("ready ")
    since = int(ready.split()[2])
    await asyncio.sleep(max(since / 1000 - time.time() + 0.02, 0))  # the node clock passes since
    return script


async def stop_example(script: Script) -> None:
    status = await script.terminate()
    assert status == 0, await script.error_text()


async def test_the_echo_agent_example(env: Env) -> None:
    script = await start_example(env, "echo_agent.py", "echo")
    try:
        _, user_token = await env.conversation()
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            events = user.events()
            await user.send_text("hello")
            typing = await first_of(events, lambda e: isinstance(e, Typing))
            assert typing.is_typing
            first = await next_message(user, lambda m: m.from_ == "bot")
            assert first.text == "echo 1: hello"
            await user.send_text("again")
            second = await next_message(user, lambda m: m.from_ == "bot")
            assert second.text == "echo 2: again"  # the count lives in the runtime state
    finally:
        await stop_example(script)


async def streamed_answer(user: Conversation) -> tuple[list[StreamUpdate], Message]:
    """The updates of the next streamed answer, up to its end, and its stored frame."""
    updates = user.stream_updates()
    seen = [await first_of(updates, lambda _: True)]
    while seen[-1].end is None:
        seen.append(await first_of(updates, lambda _: True))
    stored = await next_message(user, lambda m: m.from_ == "bot")
    return seen, stored


async def test_the_echo_agent_example_streams_its_echo_when_asked(env: Env) -> None:
    script = await start_example(env, "echo_agent.py", "echo", {"CONVERGER_ECHO_STREAM": "1"})
    try:
        _, user_token = await env.conversation()
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            await user.send_text("hello there")
            updates, stored = await streamed_answer(user)
            assert [u.chunk.text for u in updates if u.chunk] == ["echo ", "1: ", "hello ", "there"]
            assert updates[-1].stream.committed
            assert (stored.id, stored.text) == (updates[-1].stream_id, "echo 1: hello there")
            await user.send_text("again")
            _, second = await streamed_answer(user)
            assert second.text == "echo 2: again"  # the count lives in the runtime state
    finally:
        await stop_example(script)


async def test_the_llm_example_streams_words_then_commits_the_whole_answer(env: Env) -> None:
    script = await start_example(env, "llm_agent.py", "llm", {"CONVERGER_WORD_DELAY_MS": "10"})
    try:
        conversation_id, user_token = await env.conversation()
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            await user.send_text("what is streaming?")
            updates, stored = await streamed_answer(user)
            chunks = [u.chunk for u in updates if u.chunk is not None]
            assert len(chunks) > 20 and [c.index for c in chunks] == list(range(len(chunks)))
            assert chunks[0].text == "You " and chunks[0].sender is not None
            assert chunks[0].sender.id == "llm"  # the group: the agent token has no user
            stream = updates[-1].stream
            assert updates[-1].end is not None and stream.committed
            assert stream.text.startswith('You said "what is streaming?". Here is')
            # the stored answer is exactly what was streamed, under the stream's id
            assert (stored.id, stored.text) == (stream.stream_id, stream.text)
            assert stored.raw["streamId"] == stream.stream_id
        stored_answers = await env.answers(conversation_id)
        assert [(m.id, m.text) for m in stored_answers] == [(stream.stream_id, stream.text)]
    finally:
        await stop_example(script)


async def test_the_llm_example_stops_streaming_when_the_user_stops_it(env: Env) -> None:
    script = await start_example(env, "llm_agent.py", "llm", {"CONVERGER_WORD_DELAY_MS": "50"})
    try:
        conversation_id, user_token = await env.conversation()
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            await user.send_text("tell me everything")
            updates = user.stream_updates()
            seen = [await first_of(updates, lambda _: True)]
            while len([u for u in seen if u.chunk is not None]) < 3:
                seen.append(await first_of(updates, lambda _: True))
            stopped, seq = await env.rest.stop_turn(user_token, conversation_id)
            assert stopped and seq == 1
            while seen[-1].end is None:
                seen.append(await first_of(updates, lambda _: True))
            stream = seen[-1].stream
            assert not stream.committed and seen[-1].end is not None
            assert seen[-1].end.reason == "stopped"
            # The handler was cancelled: the turn's one result is the gateway's settlement of
            # exactly what was streamed.
            settled = await next_message(user, lambda m: m.from_ == "bot")
            assert settled.text == stream.text and settled.data["status"] == "stopped"
            assert stream.text.startswith("You said")
        frames = await env.frames(conversation_id)
        assert [m.text for m in frames if m.from_ != "user"] == [stream.text]
    finally:
        await stop_example(script)


async def test_the_tool_calling_example_asks_through_an_interrupt_and_resumes(env: Env) -> None:
    script = await start_example(env, "tool_agent.py", "tools")
    try:
        _, user_token = await env.conversation("bob")
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            await user.send_text("a table for 4 at 19:00 please")
            call = await next_message(user, lambda m: m.type == "tool_call")
            assert call.data == {"name": "find_table", "arguments": {"party": 4, "time": "19:00"}}
            result = await next_message(user, lambda m: m.type == "tool_result")
            assert result.data["result"]["table"] == "T4"
            interrupt = await next_message(user, lambda m: m.type == "interrupt")
            assert interrupt.data["question"] == "Book table T4 for 4 at 19:00?"

            # the open interrupt is listed to every new connection until it is resolved
            async with Conversation(env.url, user_token) as other:
                assert [p.id for p in other.pending_interrupts] == [interrupt.id]

            events = user.events()
            await user.resume({"interruptId": "int-unknown", "answer": "yes"})
            refused = await first_of(events, lambda e: isinstance(e, ErrorEvent))
            assert refused.error.code == "not_interrupted"

            await user.resume({"interruptId": interrupt.id, "answer": "yes"})
            resolved = await next_message(user, lambda m: m.type == "interrupt_resolved")
            assert resolved.id == interrupt.id and resolved.data == {"answer": "yes"}
            done = await next_message(user, lambda m: m.type == "text" and m.from_ == "bot")
            assert done.text == "Booked table T4 for 4 at 19:00 (B-1)."
            async with Conversation(env.url, user_token) as later:
                assert later.pending_interrupts == []
    finally:
        await stop_example(script)


async def test_the_lease_mode_example_charges_once_per_turn_key(env: Env) -> None:
    script = await start_example(env, "lease_agent.py", "payments")
    try:
        assert script.lines[-1].endswith("lease 10000")
        conversation_id, user_token = await env.conversation()
        async with Conversation(env.url, user_token, backoff=FAST) as user:
            sent = await user.send_text("pay 42")
            answer = await next_message(user, lambda m: m.from_ == "bot")
            key = f"{conversation_id}:{sent.seq}:0"
            assert answer.text == f"charged 42.00 (charge ch-1, new) for turn {key}, fence 1"
            # a regeneration is a new revision: a new key, so a new charge (on purpose)
            await user.regenerate(seq=sent.seq)
            again = await next_message(user, lambda m: m.from_ == "bot")
            key = f"{conversation_id}:{sent.seq}:1"
            assert again.text == f"charged 42.00 (charge ch-2, new) for turn {key}, fence 1"
    finally:
        await stop_example(script)


def test_every_example_documents_its_environment() -> None:
    for path in Path(EXAMPLES).glob("*.py"):
        text = path.read_text()
        for variable in ("CONVERGER_URL", "CONVERGER_AGENT_TOKEN", "CONVERGER_AGENT_GROUP"):
            assert variable in text.split('"""')[1], f"{path.name} documents {variable}"
