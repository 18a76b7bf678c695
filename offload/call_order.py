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


class CallOrderMixin:
    """Look-ahead for :class:`LayerwiseOffloadManager`: learned call order, list order as fallback."""

    def _reset_call_tracking(self) -> None:
        self._learned_calls: Optional[Tuple[int, ...]] = None
        self._order: Optional[CallOrder] = None
        self._calls: List[int] = []
        self._position: Optional[int] = None  # of the block running now in the record
        self._expected = 0  # the record position the next call should have
        self._in_forward = False

    @property
    def learned_call_order(self) -> Optional[Tuple[int, ...]]:
        """The block calls of the last complete forward that ran differently from the one before."""
        return self._learned_calls

    def _rebuild_order(self) -> None:
        calls = self._learned_calls
        self._order = CallOrder(calls, self.schedule.resident) if calls and self.schedule is not None else None

    def _begin_tracking(self) -> None:
        self._in_forward = True
        self._calls = []
        self._expected = 0
        self._position = None

    def _end_tracking(self, completed: bool) -> None:
        self._in_forward = False
        self._position = None
        calls, self._calls = tuple(self._calls), []
        # An interrupted forward ran only part of its blocks; its record would mislead the next one.
        if completed and calls and calls != self._learned_calls:
            self._learned_calls = calls
            self._rebuild_order()

    def _track_call(self, index: int) -> None:
        if not self._in_forward:  # no forward scope: nothing to learn from, predict in list order
            self._position = None
            return
        self._calls.append(index)
        if self._order is None:
            return
        self._position = self._order.locate(index, self._expected)
        if self._position is not None:
            self._expected = self._position + 1

    def _window(self, index: int) -> Optional[List[int]]:
        order, position = self._order, self._position
        if order is None or position is None or order.calls[position] != index:
            return None
        return order.window(position, self.config.prefetch_size)

    def _upcoming(self, index: int) -> List[int]:
        """The streamed blocks to have on the device next, after the block ``index`` runs."""
        window = self._window(index)
        if window is None:
            return self.schedule.upcoming_streamed(index, self.config.prefetch_size)
        picked: List[int] = []
        for block in window:
            if block in picked or (block == index and self._materialized[index]):
                continue
            picked.append(block)
        return picked

    def _runs_again_soon(self, index: int) -> bool:
        """Whether ``index`` is called again within the look-ahead (VACE: once per context; or every
        streamed call fits in the slots), so its slot keeps it rather than copy it in again."""
        window = self._window(index)
        return window is not None and index in window

    def _prefetch_after(self, index: int, pageable: Optional[bool] = None) -> None:
        """Start the copies of the blocks to run next; ``pageable`` picks only the copies from pageable
        (True) or page-locked (False) host memory. A pageable copy is staged by the host and waits for the
        copy stream: issued before block ``index`` is launched it would leave the GPU idle, issued after it
        overlaps its compute."""
        targets = self._upcoming(index)
        for target in targets:
            if self._materialized[target] or (pageable is not None and self._copy_is_pageable(target) != pageable):
                continue
            if not self._materialize(target, protect=targets, may_fail=True):
                break
