"""The REST helpers against a real node, and REST errors as typed exceptions."""

from __future__ import annotations

import uuid

import pytest
from support import Env, Node

from converger import (
    AuthenticationError,
    Conversation,
    FatalClose,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RestClient,
    mint_conversation,
)


async def test_tenants_channels_tokens_and_conversations(node: Node) -> None:
    async with RestClient(node.base_url) as rest:
        assert await rest.ready()
        tenant = await rest.create_tenant(node.admin_token, "  acme  ")
        assert tenant.name == "acme" and tenant.api_key.startswith("cvg_key_")
        channel = await rest.create_channel(tenant.api_key, "web")
        assert channel.status == "active" and channel.secret is not None
        listed = await rest.list_channels(tenant.api_key)
        assert [(c.id, c.secret) for c in listed] == [(channel.id, None)]
        cluster = await rest.cluster(node.admin_token)
        assert cluster["node"]["id"]

        issued = await rest.generate_token(channel.secret, user_id="alice")
        assert issued.token and issued.expires_in == 3600
        refreshed = await rest.refresh_token(issued.token)
        assert refreshed.token
        created = await rest.create_conversation(refreshed.token)
        assert created.user_id == "alice"
        agent_token = await rest.mint_agent_token(channel.secret)

        first = await rest.post_activity(
            created.token, created.conversation_id, "hello", idempotency_key="k-1"
        )
        repeat = await rest.post_activity(
            created.token,
            created.conversation_id,
            {"type": "text", "data": {"text": "x"}},
            idempotency_key="k-1",
        )
        assert (first.seq, first.duplicate) == (1, False)
        assert (repeat.id, repeat.seq, repeat.duplicate) == (first.id, 1, True)
        await rest.post_activity(agent_token, created.conversation_id, "a note")
        page = await rest.list_activities(created.token, created.conversation_id, limit=1)
        assert [m.text for m in page.activities] == ["hello"] and page.has_more
        assert page.activities[0].from_ == "user" and page.activities[0].client_id == "k-1"
        rest_of = await rest.list_activities(
            agent_token, created.conversation_id, watermark=page.watermark
        )
        assert [m.text for m in rest_of.activities] == ["a note"] and not rest_of.has_more
        everything = await rest.all_activities(agent_token, created.conversation_id)
        assert [m.seq for m in everything] == [1, 2]

        minted = await mint_conversation(node.base_url, channel.secret, "bob")
        assert minted.user_id == "bob"


async def test_rest_errors_are_typed(env: Env) -> None:
    rest = env.rest
    with pytest.raises(AuthenticationError) as unauthorized:
        await rest.create_tenant("wrong-admin-token-123456", "x")
    assert unauthorized.value.status == 401 and unauthorized.value.code == "unauthorized"
    _, user_token = await env.conversation()
    with pytest.raises(NotFoundError) as missing:
        await rest.list_activities(user_token, str(uuid.uuid4()))
    assert missing.value.code == "conversation_not_found"
    with pytest.raises(InvalidRequestError) as bad:
        await rest.generate_token(env.secret, scope="planet")
    assert bad.value.status == 400
    with pytest.raises(NotFoundError):
        await rest.set_channel_status(env.api_key, str(uuid.uuid4()), "inactive")

    await rest.set_channel_status(env.api_key, env.channel_id, "inactive")
    with pytest.raises(PermissionDeniedError) as inactive:
        await rest.generate_token(env.secret, user_id="alice")
    assert inactive.value.code == "channel_inactive"
    with pytest.raises(FatalClose) as closed:
        await Conversation(env.url, user_token).connect()
    assert closed.value.close_code == 4403
    assert closed.value.error is not None and closed.value.error.code == "channel_inactive"
    await rest.set_channel_status(env.api_key, env.channel_id, "active")
    async with Conversation(env.url, user_token) as conversation:
        assert conversation.welcome.scope == "conversation"
