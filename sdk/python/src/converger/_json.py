"""JSON helpers shared by the modules (private)."""

from __future__ import annotations

import json
from typing import Any

JSONObject = dict[str, Any]
"""A decoded JSON object, as the wire carries it."""


def dumps(value: object) -> str:
    """Serialize compactly, as one WebSocket text message."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def loads_object(text: str | bytes) -> JSONObject | None:
    """Decode one message; `None` when it is not a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def as_object(value: object) -> JSONObject:
    """`value` when it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def as_int(value: object) -> int | None:
    """`value` when it is an integer (not a bool), else `None`."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def as_str(value: object) -> str | None:
    """`value` when it is a string, else `None`."""
    return value if isinstance(value, str) else None
