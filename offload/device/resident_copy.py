"""Copying resident blocks to the device through a small page-locked bounce ring.

Residents are copied once per arming, so their host copies stay pageable (pinning gigabytes for one copy would
cost more than it saves, and ComfyUI's pinned budget is better spent on the streamed blocks). A copy from
pageable memory is slow, and on CUDA it is synchronous with the host: the driver stages it through its own
pinned buffer while the host waits. Here the host packs each chunk of a resident into one of a few page-locked
buffers and queues an asynchronous copy from it on the copy stream; while that copy runs, the host fills the
next buffer. A buffer is refilled only after the host has seen the copy that read it finish (its event), so a
chunk is never overwritten while it is read. The ring is freed once its copies are done: it holds
``count * chunk_bytes`` page-locked bytes only while the residents are being copied.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..memory.pinning import PinLedger, copy_finished
from ..host.packing import allocate_host_buffer

__all__ = ["PinnedBounce"]

CHUNK_BYTES = 32 * 2**20  # per copy: long enough that the copy's set-up is noise, short enough to pipeline
RING_COUNT = 2


class PinnedBounce:
    """``count`` page-locked host buffers of ``chunk_bytes`` each, and the copies last queued from them."""

    def __init__(self, pinner, chunk_bytes: int = CHUNK_BYTES, count: int = RING_COUNT):
        self.ledger = PinLedger(pinner)
        self.ledger.watch(self)
        self.chunk_bytes = int(chunk_bytes)
        self.buffers: List[torch.Tensor] = []
        self.copies: List[object] = []
        self._next = 0
        for _ in range(max(1, count)):
            buffer = allocate_host_buffer(self.chunk_bytes)
            if not self.ledger.pin(buffer):
                break
            self.buffers.append(buffer)
            self.copies.append(None)

    @property
    def usable(self) -> bool:
        return bool(self.buffers)

    def copy(self, backend, dst: torch.Tensor, src: torch.Tensor, after=None, then=None):
        """Queue ``dst.copy_(src)`` (uint8, host ``src``) in chunks through the ring, ``then()`` after the last;
        returns the last chunk's handle (its event follows every chunk and ``then``: one copy stream)."""
        total = src.numel()
        handle = None
        for start in range(0, max(total, 1), self.chunk_bytes):
            size = min(self.chunk_bytes, total - start)
            k = self._next
            self._next = (k + 1) % len(self.buffers)
            copy_finished(self.copies[k], wait=True)  # the copy that read this buffer last has finished
            staging = self.buffers[k].narrow(0, 0, size)
            staging.copy_(src.narrow(0, start, size))
            last = start + self.chunk_bytes >= total
            handle = backend.copy(dst.narrow(0, start, size), staging, after=after if start == 0 else None,
                                  then=then if last else None)
            self.copies[k] = handle
        return handle

    def idle(self) -> bool:
        """Whether every copy from the ring has finished (asks the events, never waits)."""
        return all(copy_finished(handle, wait=False) for handle in self.copies)

    def close(self) -> None:
        """Wait for the ring's copies, unlock and drop its buffers."""
        for handle in self.copies:
            copy_finished(handle, wait=True)
        self.copies = []
        self.ledger.unpin_all()
        self.buffers = []


def bounce_for(pinner, chunk_bytes: Optional[int] = None) -> Optional[PinnedBounce]:
    """A bounce ring, or None when the pinner refuses even one buffer (the residents then copy from pageable)."""
    bounce = PinnedBounce(pinner, chunk_bytes or CHUNK_BYTES)
    if not bounce.usable:
        bounce.close()
        return None
    return bounce
