"""The order a model really runs its blocks in, learned from its own forwards.

Block lists are joined in the order a model family documents, but a model need not run them in
list order: Wan VACE runs ``vace_blocks[k]`` between ``blocks[i]``, once per VACE context, and
cache-style packs skip blocks. Prefetching "the next blocks in the list" then copies blocks that
are not about to run and leaves the ones that are to a copy on demand. So the manager records which
blocks each forward (a forward scope) ran, predicts the next forwards from that record, and
replaces the record when a forward ran differently. Before the first complete forward, and where a
forward strays from the record, it falls back to list order.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Dict, List, Optional, Sequence, Tuple


class CallOrder:
    """One forward's block calls, with the streamed calls indexed for look-ahead."""

    def __init__(self, calls: Sequence[int], resident: Sequence[bool]):
        self.calls: Tuple[int, ...] = tuple(calls)
        self._occurrences: Dict[int, List[int]] = {}
        for position, block in enumerate(self.calls):
            self._occurrences.setdefault(block, []).append(position)
        self._streamed = tuple(p for p, block in enumerate(self.calls) if not resident[block])
        # For each position, the index in _streamed of the first streamed call after it.
        following, k = [], 0
        for position in range(len(self.calls)):
            while k < len(self._streamed) and self._streamed[k] <= position:
                k += 1
            following.append(k)
        self._next_streamed = tuple(following)

    def locate(self, block: int, expected: int) -> Optional[int]:
        """Where a call to ``block`` is in the record: ``expected`` when it matches, else the block's
        next occurrence from there (the model skipped some calls); None when the record has no such call."""
        if expected < len(self.calls) and self.calls[expected] == block:
            return expected
        occurrences = self._occurrences.get(block, ())
        k = bisect_left(occurrences, expected)
        return occurrences[k] if k < len(occurrences) else None

    def window(self, position: int, count: int) -> List[int]:
        """The blocks of the next ``count`` streamed calls after ``position``; the record repeats, so
        the end of one forward looks ahead into the next."""
        streamed = self._streamed
        start = self._next_streamed[position]
        count = min(count, len(streamed))
        return [self.calls[streamed[(start + k) % len(streamed)]] for k in range(count)]


class CallTracker:
    """What a manager learns of the order its blocks run in, and the look-ahead it predicts from that.

    Owns the record of the last complete forward that ran differently, and where the running forward stands
    in it. ``resident`` (per block) comes from the manager's plan; without a plan nothing is predicted.
    """

    def __init__(self):
        self.learned_calls: Optional[Tuple[int, ...]] = None
        self.order: Optional[CallOrder] = None
        self.in_forward = False
        self._resident: Optional[Sequence[bool]] = None
        self._calls: List[int] = []
        self._position: Optional[int] = None  # of the block running now in the record
        self._expected = 0  # the record position the next call should have

    def set_plan(self, resident: Optional[Sequence[bool]]) -> None:
        """The plan changed (``resident``: which blocks stay on the device; None: unarmed)."""
        self._resident = resident
        self._rebuild()

    def _rebuild(self) -> None:
        calls = self.learned_calls
        self.order = CallOrder(calls, self._resident) if calls and self._resident is not None else None

    def begin(self) -> None:
        self.in_forward = True
        self._calls = []
        self._expected = 0
        self._position = None

    def end(self, completed: bool) -> int:
        """Close the forward; returns how many block calls it made."""
        self.in_forward = False
        self._position = None
        calls, self._calls = tuple(self._calls), []
        # An interrupted forward ran only part of its blocks; its record would mislead the next one.
        if completed and calls and calls != self.learned_calls:
            self.learned_calls = calls
            self._rebuild()
        return len(calls)

    def track(self, index: int) -> None:
        if not self.in_forward:  # no forward scope: nothing to learn from, predict in list order
            self._position = None
            return
        self._calls.append(index)
        if self.order is None:
            return
        self._position = self.order.locate(index, self._expected)
        if self._position is not None:
            self._expected = self._position + 1

    def window(self, index: int, count: int) -> Optional[List[int]]:
        """The blocks of the next ``count`` streamed calls after the call of ``index`` running now; None when
        the record does not know where the forward stands (then the caller falls back to list order)."""
        order, position = self.order, self._position
        if order is None or position is None or order.calls[position] != index:
            return None
        return order.window(position, count)

    def upcoming(self, index: int, count: int, schedule, materialized: bool) -> List[int]:
        """The streamed blocks to have on the device next, after block ``index`` (``materialized``: on the device
        now) runs: up to ``count``, in the learned order, else in ``schedule``'s list order."""
        window = self.window(index, count)
        if window is None:
            return schedule.upcoming_streamed(index, count)
        picked: List[int] = []
        for block in window:
            if block in picked or (block == index and materialized):
                continue
            picked.append(block)
        return picked

    def lookahead(self, index: int, count: int, schedule) -> List[int]:
        """The ``count`` streamed calls after the next call of ``index``, a block about to be copied rather than
        running (the learned order from where the next call should be, else ``schedule``'s list order)."""
        order = self.order
        position = order.locate(index, self._expected) if order is not None else None
        if position is None:
            return schedule.upcoming_streamed(index, count) if schedule is not None else []
        return order.window(position, count)
