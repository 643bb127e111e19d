"""What a client has already seen, so replays after a reconnect never surface a frame twice."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field


class SeqTracker:
    """The seqs one end user has seen in one conversation.

    The watermark is the highest seq below which nothing is missing; seqs above a gap (live
    frames after a truncated replay) are kept one by one until the gap is filled, and the
    watermark sent on reconnect stays below the gap so the replay fills it.
    """

    def __init__(self, watermark: int = 0) -> None:
        self._contiguous = max(watermark, 0)
        self._above: set[int] = set()

    @property
    def watermark(self) -> int:
        """The highest seq with nothing missing below it."""
        return self._contiguous

    @property
    def has_gap(self) -> bool:
        """Whether a seq between the watermark and the highest seen is missing."""
        return bool(self._above)

    def seen(self, seq: int) -> bool:
        """Whether ``seq`` was already observed."""
        return seq <= self._contiguous or seq in self._above

    def observe(self, seq: int) -> bool:
        """Records ``seq``; true when it had not been seen before."""
        if self.seen(seq):
            return False
        self._above.add(seq)
        while self._contiguous + 1 in self._above:
            self._above.discard(self._contiguous + 1)
            self._contiguous += 1
        return True

    def reset(self, watermark: int) -> None:
        """Forgets everything and starts over at ``watermark``."""
        self._contiguous = max(watermark, 0)
        self._above.clear()


TURNS_PER_CONVERSATION = 64
REMEMBERED_CONVERSATIONS = 10_000


@dataclass
class _Seen:
    highest_seq: int = 0
    # turn seq -> highest (revision, fence) handed out
    turns: OrderedDict[int, tuple[int, int]] = field(default_factory=OrderedDict)


class ChannelTracker:
    """What an agent has seen per conversation.

    That is the highest seq (its ``hello.watermarks``) and the turn deliveries handed out.
    Agents receive only the frames they own, so seqs have gaps and a turn can arrive below the
    watermark (a takeover, a regeneration): turns are de-duplicated by ``(conversation, seq,
    revision)`` and, in lease mode, a redelivery under a newer claim (higher fence) counts as
    new. The least recently active conversations are forgotten first.
    """

    def __init__(
        self,
        watermarks: Mapping[str, int] | None = None,
        capacity: int = REMEMBERED_CONVERSATIONS,
    ) -> None:
        self._conversations: OrderedDict[str, _Seen] = OrderedDict()
        self._capacity = max(capacity, 1)
        for conversation_id, seq in (watermarks or {}).items():
            self.observe_seq(conversation_id, seq)

    def _touch(self, conversation_id: str) -> _Seen:
        seen = self._conversations.get(conversation_id)
        if seen is None:
            seen = _Seen()
            self._conversations[conversation_id] = seen
            while len(self._conversations) > self._capacity:
                self._conversations.popitem(last=False)
        else:
            self._conversations.move_to_end(conversation_id)
        return seen

    def observe_seq(self, conversation_id: str, seq: int) -> None:
        """Records a delivered persistent frame's seq."""
        seen = self._touch(conversation_id)
        seen.highest_seq = max(seen.highest_seq, seq)

    def first_delivery(
        self, conversation_id: str, seq: int, revision: int, fence: int | None
    ) -> bool:
        """Records a delivered turn; true when this delivery was not handed out before."""
        seen = self._touch(conversation_id)
        delivery = (revision, -1 if fence is None else fence)
        known = seen.turns.get(seq)
        if known is not None and known >= delivery:
            return False
        seen.turns[seq] = delivery
        seen.turns.move_to_end(seq)
        while len(seen.turns) > TURNS_PER_CONVERSATION:
            seen.turns.popitem(last=False)
        return True

    def forget_delivery(self, conversation_id: str, seq: int, revision: int) -> None:
        """Forgets a handed-out turn revision (its handler failed), so a replay brings it again."""
        seen = self._conversations.get(conversation_id)
        if seen is None:
            return
        known = seen.turns.get(seq)
        if known is not None and known[0] == revision:
            del seen.turns[seq]

    def watermarks(self, limit: int | None = None) -> dict[str, int]:
        """The highest seq of each conversation, the ``limit`` most recently active."""
        result: dict[str, int] = {}
        for conversation_id in reversed(self._conversations):
            if limit is not None and len(result) >= limit:
                break
            highest = self._conversations[conversation_id].highest_seq
            if highest > 0:
                result[conversation_id] = highest
        return result
