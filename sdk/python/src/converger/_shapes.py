"""Shapes both clients share: frames to store, the clientId shape (private)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ._json import JSONObject

FrameLike = str | Mapping[str, Any]
"""A frame to store: a whole message frame object, or a string for ``{"type": "text", …}``."""

CLIENT_ID = re.compile(r"[A-Za-z0-9._:~-]{1,128}")


def is_valid_client_id(client_id: str) -> bool:
    """Whether ``client_id`` has the protocol's clientId shape (1 to 128 of ``A-Za-z0-9._:~-``)."""
    return CLIENT_ID.fullmatch(client_id) is not None


def frame_of(frame: FrameLike) -> JSONObject:
    """A frame object from a :data:`FrameLike` (a copy; strings become ``text`` frames)."""
    if isinstance(frame, str):
        return {"type": "text", "data": {"text": frame}}
    if isinstance(frame, Mapping):
        return dict(frame)
    raise TypeError(f"a frame is a str or a mapping, not {type(frame).__name__}")


def frames_of(frames: FrameLike | Iterable[FrameLike]) -> list[JSONObject]:
    """A list of frame objects from one frame or many."""
    if isinstance(frames, (str, Mapping)):
        return [frame_of(frames)]
    return [frame_of(item) for item in frames]
