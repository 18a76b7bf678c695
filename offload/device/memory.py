"""The plan's device memory: one buffer per resident block, one per streamed block's head (with streamed tails),
and a ring of slots the streamed blocks (or their tails) share.

Each slot remembers which block it holds and the compute-stream mark after which it may be written again
(the last compute that read its previous block). Everything is uint8; blocks view typed tensors into it.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch


class DeviceMemory:
    """Device buffers of one manager; ``inference`` makes them inference tensors (to match the parameters)."""

    def __init__(self, device: torch.device, num_blocks: int):
        self.device = device
        self.num_blocks = num_blocks
        self.inference = False
        self.clear()

    def clear(self) -> None:
        """Forget every buffer (the memory returns once no view of it is left)."""
        self.residents: Dict[int, torch.Tensor] = {}
        self._resident_bytes = 0  # kept as buffers come and go: the step reads it at every copy
        self.heads: Dict[int, torch.Tensor] = {}  # streamed block -> its head's buffer (the bytes before its tail)
        self._head_bytes = 0
        self.drop_ring()

    def drop_ring(self) -> None:
        """Forget the slot ring (no block may hold a slot)."""
        self.slots: List[torch.Tensor] = []
        self._slot_bytes = 0
        self.slot_owner: List[Optional[int]] = []
        self.slot_free: List[object] = []  # per slot: the compute mark its next copy waits for
        self.block_slot: List[Optional[int]] = [None] * self.num_blocks

    def ring_is(self, slot_count: int, slot_bytes: int) -> bool:
        """Whether the ring held now has ``slot_count`` slots of ``slot_bytes`` (none held: only for no slots)."""
        return len(self.slots) == slot_count and all(slot.numel() == slot_bytes for slot in self.slots)

    def allocate(self, nbytes: int) -> torch.Tensor:
        with torch.inference_mode(self.inference):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def hold(self, residents: Iterable[Tuple[int, int]], slot_count: int, slot_bytes: int, mark,
             heads: Iterable[Tuple[int, int]] = ()) -> object:
        """Allocate what the plan lacks: the buffers of the residents and of the streamed blocks' heads ((block,
        bytes) pairs) not held yet, and the
        ring unless the one held has this geometry (a ring of another geometry must hold no block: it is dropped
        first). All of it is allocated before any is kept, so out of memory adds nothing. Fresh memory may have
        been freed by tensors that queued compute work still reads: returns ``mark()`` taken once all is
        allocated, which the copies into fresh memory wait for (a kept slot keeps the mark it had)."""
        keep_ring = self.ring_is(slot_count, slot_bytes)
        if not keep_ring:
            if any(owner is not None for owner in self.slot_owner):
                raise RuntimeError("[layerwise-offload] the slot ring is resized while a block holds a slot")
            self.drop_ring()
        fresh = {index: self.allocate(nbytes) for index, nbytes in residents if index not in self.residents}
        fresh_heads = {index: self.allocate(nbytes) for index, nbytes in heads if index not in self.heads}
        slots = self.slots if keep_ring else [self.allocate(slot_bytes) for _ in range(slot_count)]
        self.residents.update(fresh)
        self._resident_bytes += sum(buffer.numel() for buffer in fresh.values())
        self.heads.update(fresh_heads)
        self._head_bytes += sum(buffer.numel() for buffer in fresh_heads.values())
        allocated = mark()
        if not keep_ring:
            self.slots = slots
            self._slot_bytes = slot_count * slot_bytes
            self.slot_owner = [None] * slot_count
            self.slot_free = [allocated] * slot_count
        return allocated

    def resident(self, index: int, nbytes: int) -> Tuple[torch.Tensor, bool]:
        """Block ``index``'s resident buffer, and whether it is new (a forced release gave the old one back)."""
        buffer = self.residents.get(index)
        if buffer is not None:
            return buffer, False
        buffer = self.residents[index] = self.allocate(nbytes)
        self._resident_bytes += buffer.numel()
        return buffer, True

    def drop_resident(self, index: int) -> None:
        """Free block ``index``'s resident buffer (it left the resident set; nothing may view it any more)."""
        buffer = self.residents.pop(index, None)
        if buffer is not None:
            self._resident_bytes -= buffer.numel()

    def head(self, index: int) -> Optional[torch.Tensor]:
        return self.heads.get(index)

    def drop_head(self, index: int) -> None:
        """Free streamed block ``index``'s head (its split changed, or it left the streamed blocks)."""
        buffer = self.heads.pop(index, None)
        if buffer is not None:
            self._head_bytes -= buffer.numel()

    def acquire(self, protect: Set[int], evict_protected: bool, running: Sequence[int],
                release: Callable[[int], None]) -> Optional[int]:
        """A slot for a block about to be copied in: a free one, else one whose block nobody is running
        (``running[block]`` is 0), given back with ``release(block)``. A block in ``protect`` (the plan expects it
        next) is evicted only with ``evict_protected``, when a block needs a slot right now; None: no slot."""
        free = next((slot for slot, owner in enumerate(self.slot_owner) if owner is None), None)
        if free is not None:
            return free
        # First a block the plan no longer expects (a skipped or out-of-order block), then an expected one.
        for allow_protected in ((False, True) if evict_protected else (False,)):
            for slot, owner in enumerate(self.slot_owner):
                if running[owner] or (owner in protect and not allow_protected):
                    continue
                release(owner)
                return slot
        return None

    def take(self, slot: int, index: int) -> Tuple[torch.Tensor, object]:
        """Give ``slot`` to block ``index``: (the slot's buffer, the compute mark its copy waits for)."""
        self.slot_owner[slot] = index
        self.block_slot[index] = slot
        return self.slots[slot], self.slot_free[slot]

    def give_back(self, index: int, mark) -> None:
        """Block ``index`` leaves its slot (if it has one); the slot's next copy waits for compute as of now."""
        slot = self.block_slot[index]
        if slot is not None:
            self.slot_owner[slot] = None
            self.slot_free[slot] = mark()
            self.block_slot[index] = None

    def resident_bytes(self) -> int:
        return self._resident_bytes

    def head_bytes(self) -> int:
        return self._head_bytes

    def nbytes(self) -> int:
        return self._resident_bytes + self._head_bytes + self._slot_bytes
