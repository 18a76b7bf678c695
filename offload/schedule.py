"""Which blocks stay resident, and which streamed blocks to copy next."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, List, Optional, Sequence, Tuple

from .config import OffloadConfig


def choose_resident_blocks(num_blocks: int, resident_count: int, policy: str) -> Tuple[bool, ...]:
    """Mark the resident blocks for a policy.

    ``leading`` keeps blocks ``0..r-1``. ``strided`` picks the streamed blocks at even intervals
    over the step, so each streamed copy has resident compute in front of it to hide behind.
    """
    if not 0 <= resident_count <= num_blocks:
        raise ValueError(f"resident_count must be within 0..{num_blocks}, got {resident_count}")
    if policy == "leading":
        return tuple(i < resident_count for i in range(num_blocks))
    if policy == "strided":
        streamed_count = num_blocks - resident_count
        # Points (k + 1/2) * n/s are at least one block apart, so their floors are distinct.
        streamed = {int((k + 0.5) * num_blocks / streamed_count) for k in range(streamed_count)}
        return tuple(i not in streamed for i in range(num_blocks))
    raise ValueError(f"unknown residency policy {policy!r}")


@dataclass(frozen=True)
class Footprint:
    """What a residency plan holds on the device once armed: each resident block's own buffer, each streamed
    block's resident head (the part of it that does not stream, with streamed tails), and a ring of ``slot_count``
    slots of ``slot_size`` (the largest streamed tail, or block) for the streamed ones. This is the figure ComfyUI
    plans VRAM from (with the non-block weights), so it is computed here and nowhere else."""

    resident_bytes: int
    streamed_bytes: int
    slot_count: int
    slot_size: int
    head_bytes: int = 0

    @property
    def slot_bytes(self) -> int:
        return self.slot_count * self.slot_size

    @property
    def total(self) -> int:
        return self.resident_bytes + self.head_bytes + self.slot_bytes


def footprint(sizes: Sequence[int], resident: Sequence[bool], prefetch_size: int,
              tails: Optional[Sequence[int]] = None) -> Footprint:
    """The device footprint of keeping ``resident`` blocks (of ``sizes`` bytes) with a prefetch window of
    ``prefetch_size``: ``prefetch_size + 1`` slots (fewer when fewer blocks stream) of the largest streamed block.
    ``tails``: per block, the bytes it streams when it streams (its tail; the rest of it stays on the device as its
    head); None: whole blocks."""
    tails = sizes if tails is None else tails
    streamed = [tail for tail, keep in zip(tails, resident) if not keep]
    return Footprint(resident_bytes=sum(size for size, keep in zip(sizes, resident) if keep),
                     streamed_bytes=sum(streamed), slot_count=min(prefetch_size + 1, len(streamed)),
                     slot_size=max(streamed, default=0),
                     head_bytes=sum(size - tail for size, tail, keep in zip(sizes, tails, resident) if not keep))


def tail_within(options: Sequence[int], cap: int) -> int:
    """The tail a block streams under a cap of ``cap`` bytes, from its possible tail sizes ``options`` (ascending,
    the whole block last): the largest within the cap, at least the smallest; the whole block for ``cap <= 0``."""
    if cap <= 0:
        return options[-1]
    return options[max(0, bisect.bisect_right(options, cap) - 1)]


def largest_fitting(fits: Callable[[int], bool], start: int) -> int:
    """The largest resident count from ``start`` down for which ``fits(count)`` holds; 0 when none does."""
    count = start
    while count > 0 and not fits(count):
        count -= 1
    return count


@dataclass(frozen=True)
class Schedule:
    """The residency plan of one step, in the order the model runs its blocks."""

    resident: Tuple[bool, ...]

    @classmethod
    def for_config(cls, config: OffloadConfig, num_blocks: int) -> "Schedule":
        """The plan ``config`` asks for over ``num_blocks`` blocks: its resident count, placed by its policy."""
        return cls(choose_resident_blocks(num_blocks, config.resident_count(num_blocks), config.policy))

    @property
    def num_blocks(self) -> int:
        return len(self.resident)

    # Cached: the block hooks ask for these on every block of every step.
    @cached_property
    def streamed_blocks(self) -> Tuple[int, ...]:
        return tuple(i for i, keep in enumerate(self.resident) if not keep)

    @cached_property
    def resident_blocks(self) -> Tuple[int, ...]:
        return tuple(i for i, keep in enumerate(self.resident) if keep)

    @cached_property
    def _first_streamed_after(self) -> Tuple[int, ...]:
        """For each block, the position in ``streamed_blocks`` of the first streamed block after it."""
        positions = []
        k = 0
        streamed = self.streamed_blocks
        for block in range(self.num_blocks):
            while k < len(streamed) and streamed[k] <= block:
                k += 1
            positions.append(k % len(streamed) if streamed else 0)
        return tuple(positions)

    def device_bytes(self, sizes: Sequence[int], prefetch_size: int, tails: Optional[Sequence[int]] = None) -> int:
        """What the plan holds on the device once armed (:func:`footprint`)."""
        return footprint(sizes, self.resident, prefetch_size, tails).total

    def upcoming_streamed(self, after_block: int, count: int) -> List[int]:
        """The next ``count`` streamed blocks after ``after_block``, wrapping into the next step."""
        streamed = self.streamed_blocks
        if not streamed or count <= 0:
            return []
        start = self._first_streamed_after[after_block] if 0 <= after_block < self.num_blocks else 0
        picked = []
        for k in range(min(count, len(streamed))):
            block = streamed[(start + k) % len(streamed)]
            if block == after_block:
                break
            picked.append(block)
        return picked
