"""Which blocks stay resident, and which streamed blocks to copy next."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Sequence, Tuple


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
class Schedule:
    """The residency plan of one step, in the order the model runs its blocks."""

    resident: Tuple[bool, ...]

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

    def device_bytes(self, sizes: Sequence[int], prefetch_size: int) -> int:
        """What the plan holds on the device once armed: each resident's buffer, and ``prefetch_size + 1``
        slots (fewer when fewer blocks stream) of the largest streamed block."""
        streamed = [sizes[i] for i in self.streamed_blocks]
        slots = min(prefetch_size + 1, len(streamed))
        return sum(sizes[i] for i in self.resident_blocks) + slots * max(streamed, default=0)

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
