"""The REST API (``docs/protocol.md`` §6), async over httpx.

Each call takes the credential it needs, as the API does:

- the admin token: :meth:`RestClient.create_tenant`, :meth:`RestClient.cluster`;
- a tenant's API key: channels;
- a channel secret: :meth:`RestClient.generate_token`;
- a token (channel or conversation scope): conversations and their activities.

Errors ``{"error": {"code", "message"}}`` raise :class:`~converger.RestError` subclasses by
status (:class:`~converger.NotFoundError`, :class:`~converger.AuthenticationError`, …).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from ._json import JSONObject, as_int, as_object, as_str
from ._shapes import FrameLike, frame_of
from .errors import RestError, rest_error_class
from .frames import Message

__all__ = [
    "ActivityPage",
    "Channel",
    "CreatedConversation",
    "IssuedToken",
    "PostedActivity",
    "RestClient",
    "Tenant",
    "mint_agent_token",
    "mint_conversation",
]


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant; ``api_key`` (``cvg_key_…``) is shown once, at creation."""

    id: str
    name: str
    api_key: str


@dataclass(frozen=True, slots=True)
class Channel:
    """A channel of a tenant; ``secret`` is shown once, at creation (else ``None``)."""

    id: str
    name: str
    status: str
    created_at: str | None
    secret: str | None
    turn_policy: str | None = None
    """What a send means while a turn runs (``None``: the node's default)."""
    turn_policy_overrides: tuple[str, ...] = ()
    """The policies a send may ask for instead."""
    on_disconnect: str = "continue"
    """``"cancel"``: the last end-user connection leaving cancels the running turn."""

    @staticmethod
    def parse(body: JSONObject) -> Channel:
        """From the API's channel object."""
        overrides = body.get("turnPolicyOverrides")
        return Channel(
            id=as_str(body.get("id")) or "",
            name=as_str(body.get("name")) or "",
            status=as_str(body.get("status")) or "",
            created_at=as_str(body.get("createdAt")),
            secret=as_str(body.get("secret")),
            turn_policy=as_str(body.get("turnPolicy")),
            turn_policy_overrides=tuple(
                name
                for name in (overrides if isinstance(overrides, list) else [])
                if isinstance(name, str)
            ),
            on_disconnect=as_str(body.get("onDisconnect")) or "continue",
        )


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A token and its lifetime in seconds."""

    token: str
    expires_in: int | None


@dataclass(frozen=True, slots=True)
class CreatedConversation:
    """A new conversation and a conversation-scope token bound to it."""

    conversation_id: str
    user_id: str
    token: str
    expires_in: int | None


@dataclass(frozen=True, slots=True)
class ActivityPage:
    """One page of a conversation's persistent frames (``seq`` > the asked watermark).

    ``watermark`` is the last returned seq (the asked one for an empty page); ``has_more``
    tells whether another page follows.
    """

    activities: list[Message]
    watermark: int
    has_more: bool


@dataclass(frozen=True, slots=True)
class PostedActivity:
    """A posted frame's ``id`` and ``seq``; ``duplicate`` for a repeated idempotency key."""

    id: str
    seq: int
    duplicate: bool


class RestClient:
    """An async client of one node's REST API (``base_url`` like ``http://127.0.0.1:8080``).

    Use it as ``async with RestClient(url) as rest`` or call :meth:`aclose`. ``http`` lets
    you pass your own :class:`httpx.AsyncClient` (it is then not closed here).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._own = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        """Closes the HTTP client (when this object created it)."""
        if self._own:
            await self._http.aclose()

    async def __aenter__(self) -> RestClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        bearer: str | None = None,
        api_key: str | None = None,
        json: Any = None,
        params: Mapping[str, str | int] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        sent: dict[str, str] = dict(headers or {})
        if bearer is not None:
            sent["Authorization"] = f"Bearer {bearer}"
        if api_key is not None:
            sent["x-api-key"] = api_key
        response = await self._http.request(
            method, f"{self.base_url}{path}", json=json, params=params, headers=sent
        )
        if response.status_code >= 400:
            raise _error_of(response)
        return response

    # --- admin -------------------------------------------------------------------------

    async def create_tenant(self, admin_token: str, name: str) -> Tenant:
        """``POST /api/v1/admin/tenants``: a tenant and its API key."""
        body = (
            await self._call(
                "POST", "/api/v1/admin/tenants", bearer=admin_token, json={"name": name}
            )
        ).json()
        return Tenant(
            id=as_str(body.get("id")) or "",
            name=as_str(body.get("name")) or "",
            api_key=as_str(body.get("apiKey")) or "",
        )

    async def cluster(self, admin_token: str) -> JSONObject:
        """``GET /api/v1/admin/cluster``: this node's view of the cluster (nodes, members)."""
        return as_object(
            (await self._call("GET", "/api/v1/admin/cluster", bearer=admin_token)).json()
        )

    # --- channels (API key) ------------------------------------------------------------

    async def create_channel(self, api_key: str, name: str) -> Channel:
        """``POST /api/v1/channels``: a channel and its secret."""
        response = await self._call(
            "POST", "/api/v1/channels", api_key=api_key, json={"name": name}
        )
        return Channel.parse(as_object(response.json()))

    async def list_channels(self, api_key: str) -> list[Channel]:
        """``GET /api/v1/channels``: the tenant's channels (without secrets)."""
        body = as_object((await self._call("GET", "/api/v1/channels", api_key=api_key)).json())
        channels = body.get("channels")
        if not isinstance(channels, list):
            return []
        return [Channel.parse(as_object(item)) for item in channels]

    async def set_channel_status(self, api_key: str, channel_id: str, status: str) -> Channel:
        """``PATCH /api/v1/channels/{id}`` to ``"active"`` or ``"inactive"``.

        ``"inactive"`` closes the channel's sockets with 4403.
        """
        response = await self._call(
            "PATCH", f"/api/v1/channels/{channel_id}", api_key=api_key, json={"status": status}
        )
        return Channel.parse(as_object(response.json()))

    async def set_turn_settings(
        self,
        api_key: str,
        channel_id: str,
        *,
        turn_policy: str | None = None,
        turn_policy_overrides: list[str] | None = None,
        on_disconnect: str | None = None,
        default_turn_policy: bool = False,
    ) -> Channel:
        """``PATCH /api/v1/channels/{id}``: the channel's turn settings.

        See ``docs/protocol.md`` §3.10; arguments left ``None`` are left as they are, and
        ``default_turn_policy=True`` gives the channel the node's default policy back.
        """
        body: JSONObject = {}
        if default_turn_policy:
            body["turnPolicy"] = None
        elif turn_policy is not None:
            body["turnPolicy"] = turn_policy
        if turn_policy_overrides is not None:
            body["turnPolicyOverrides"] = list(turn_policy_overrides)
        if on_disconnect is not None:
            body["onDisconnect"] = on_disconnect
        response = await self._call(
            "PATCH", f"/api/v1/channels/{channel_id}", api_key=api_key, json=body
        )
        return Channel.parse(as_object(response.json()))

    # --- tokens ------------------------------------------------------------------------

    async def generate_token(
        self,
        secret: str,
        *,
        user_id: str | None = None,
        scope: str | None = None,
        conversation_id: str | None = None,
    ) -> IssuedToken:
        """``POST /api/v1/converger/tokens/generate`` with the channel secret.

        ``scope="channel"`` gives an agent token (``user_id`` then sets the agent's
        ``sender.id``); the default is an end user's conversation-scope token, optionally
        bound to ``conversation_id``.
        """
        body: JSONObject = {}
        if user_id is not None:
            body["user"] = {"id": user_id}
        if scope is not None:
            body["scope"] = scope
        if conversation_id is not None:
            body["conversationId"] = conversation_id
        response = await self._call(
            "POST", "/api/v1/converger/tokens/generate", bearer=secret, json=body
        )
        return _token_of(as_object(response.json()))

    async def refresh_token(self, token: str) -> IssuedToken:
        """``POST /api/v1/converger/tokens/refresh``: the same claims with a new expiry."""
        response = await self._call("POST", "/api/v1/converger/tokens/refresh", bearer=token)
        return _token_of(as_object(response.json()))

    # --- conversations (token) ---------------------------------------------------------

    async def create_conversation(
        self, token: str, *, user_id: str | None = None
    ) -> CreatedConversation:
        """``POST /api/v1/converger/conversations``: a conversation and a token bound to it.

        The user is the token's ``user_id`` (conversation scope), else ``user_id``, else
        ``anon-…``.
        """
        body: JSONObject = {}
        if user_id is not None:
            body["userId"] = user_id
        response = await self._call(
            "POST", "/api/v1/converger/conversations", bearer=token, json=body
        )
        created = as_object(response.json())
        return CreatedConversation(
            conversation_id=as_str(created.get("conversationId")) or "",
            user_id=as_str(created.get("userId")) or "",
            token=as_str(created.get("token")) or "",
            expires_in=as_int(created.get("expires_in")),
        )

    async def list_activities(
        self, token: str, conversation_id: str, *, watermark: int = 0, limit: int = 100
    ) -> ActivityPage:
        """``GET …/conversations/{id}/activities``: one page of frames after ``watermark``.

        A channel-scope token gets the agent view, a conversation-scope one the end user's.
        """
        response = await self._call(
            "GET",
            f"/api/v1/converger/conversations/{conversation_id}/activities",
            bearer=token,
            params={"watermark": watermark, "limit": limit},
        )
        body = as_object(response.json())
        raw = body.get("activities")
        activities = []
        for item in raw if isinstance(raw, list) else []:
            message = Message.parse(as_object(item))
            if message is not None:
                activities.append(message)
        return ActivityPage(
            activities=activities,
            watermark=as_int(body.get("watermark")) or watermark,
            has_more=body.get("hasMore") is True,
        )

    async def all_activities(
        self, token: str, conversation_id: str, *, watermark: int = 0
    ) -> list[Message]:
        """Every frame after ``watermark``, page by page."""
        frames: list[Message] = []
        while True:
            page = await self.list_activities(
                token, conversation_id, watermark=watermark, limit=1000
            )
            frames.extend(page.activities)
            if not page.has_more or page.watermark <= watermark:
                return frames
            watermark = page.watermark

    async def post_activity(
        self,
        token: str,
        conversation_id: str,
        frame: FrameLike,
        *,
        idempotency_key: str | None = None,
    ) -> PostedActivity:
        """``POST …/conversations/{id}/activities``: stores a message frame.

        With an end user's token it is a user turn, delivered to agents; with a channel-scope
        token another party's frame. ``idempotency_key`` (``x-idempotency-key``) makes a repeat
        answer the original ``{id, seq}`` (``duplicate=True``).
        """
        headers = {"x-idempotency-key": idempotency_key} if idempotency_key else None
        response = await self._call(
            "POST",
            f"/api/v1/converger/conversations/{conversation_id}/activities",
            bearer=token,
            json=frame_of(frame),
            headers=headers,
        )
        body = as_object(response.json())
        return PostedActivity(
            id=as_str(body.get("id")) or "",
            seq=as_int(body.get("seq")) or 0,
            duplicate=response.status_code == 200,
        )

    async def stop_turn(
        self, token: str, conversation_id: str, *, seq: int | None = None
    ) -> tuple[bool, int | None]:
        """``POST …/conversations/{id}/stop``: stops a running turn (``docs/protocol.md`` §3.9).

        Stops the turn at ``seq``, or the latest unanswered one. Returns ``(stopped, seq)``:
        whether a turn is stopping now, and which (``None`` when none was running). Idempotent.
        """
        body: JSONObject = {} if seq is None else {"seq": seq}
        response = await self._call(
            "POST",
            f"/api/v1/converger/conversations/{conversation_id}/stop",
            bearer=token,
            json=body,
        )
        answer = as_object(response.json())
        return answer.get("stopped") is True, as_int(answer.get("seq"))

    # --- health and helpers ------------------------------------------------------------

    async def ready(self) -> bool:
        """``GET /health/ready``: whether the node serves (false while draining)."""
        response = await self._http.get(f"{self.base_url}/health/ready")
        return response.status_code == 200

    async def mint_conversation(self, secret: str, user_id: str) -> CreatedConversation:
        """For tests and tools: a new conversation of ``user_id`` and its bound token.

        The user's token is generated with the channel secret first.
        """
        issued = await self.generate_token(secret, user_id=user_id)
        return await self.create_conversation(issued.token)

    async def mint_agent_token(self, secret: str, *, user_id: str | None = None) -> str:
        """For tests and tools: a channel-scope (agent) token from the channel secret."""
        return (await self.generate_token(secret, user_id=user_id, scope="channel")).token


async def mint_conversation(base_url: str, secret: str, user_id: str) -> CreatedConversation:
    """A new conversation of ``user_id`` and its bound token, minted with the channel secret."""
    async with RestClient(base_url) as rest:
        return await rest.mint_conversation(secret, user_id)


async def mint_agent_token(base_url: str, secret: str, *, user_id: str | None = None) -> str:
    """A channel-scope (agent) token minted with the channel secret."""
    async with RestClient(base_url) as rest:
        return await rest.mint_agent_token(secret, user_id=user_id)


def _token_of(body: JSONObject) -> IssuedToken:
    return IssuedToken(
        token=as_str(body.get("token")) or "", expires_in=as_int(body.get("expires_in"))
    )


def _error_of(response: httpx.Response) -> RestError:
    status = response.status_code
    code, message = f"http_{status}", response.reason_phrase
    body: Any = None
    try:
        body = response.json()
    except ValueError:
        body = response.text
    error = as_object(as_object(body).get("error")) if isinstance(body, dict) else {}
    code = as_str(error.get("code")) or code
    message = as_str(error.get("message")) or message
    retry_after: float | None = None
    header = response.headers.get("Retry-After")
    if header is not None:
        try:
            retry_after = float(header)
        except ValueError:
            retry_after = None
    return rest_error_class(status)(status, code, message, retry_after, body)
