"""Reconnect delays: exponential backoff with full jitter, floored by the server's hint."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff"]

LONGEST_SERVER_HINT = 300.0
"""Server hints above this many seconds count as this, so a bad hint cannot park a client."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long to wait before each reconnect attempt.

    Attempt ``n`` (0-based, counting consecutive failures) waits a random delay in
    ``[0, min(initial * 2**n, maximum)]`` ("full jitter"), so the clients of a draining node do
    not all come back at the same moment. A ``retryAfterMs`` from the server (the JSON reason of
    a 1012 or 4503 close, ``error.data.retryAfterMs``, an HTTP 503 ``Retry-After``) is a floor.

    ``max_attempts`` bounds consecutive failed attempts (``None``: reconnect forever); when it
    runs out the client stops with :class:`~converger.GaveUp`.
    """

    initial: float = 0.5
    """Ceiling of the first attempt's delay, in seconds."""
    maximum: float = 30.0
    """Largest ceiling any attempt reaches, in seconds."""
    max_attempts: int | None = None
    """Consecutive failures after which reconnecting stops (``None``: never)."""

    def ceiling(self, attempt: int) -> float:
        """The largest delay of attempt ``attempt``: ``initial * 2**attempt``, capped."""
        if attempt >= 64:
            return self.maximum
        return min(self.initial * float(2**attempt), self.maximum)

    def delay(
        self,
        attempt: int,
        retry_after: float | None = None,
        rand: Callable[[], float] = random.random,
    ) -> float:
        """The delay before attempt ``attempt``, never shorter than ``retry_after`` seconds."""
        unit = min(max(rand(), 0.0), 1.0)
        delay = self.ceiling(max(attempt, 0)) * unit
        if retry_after is not None and retry_after > 0:
            delay = max(delay, min(retry_after, LONGEST_SERVER_HINT))
        return delay

    def exhausted(self, failures: int) -> bool:
        """Whether ``failures`` consecutive failures use up the attempts."""
        return self.max_attempts is not None and failures >= self.max_attempts
