"""Where a block's host bytes live: in RAM (the host store's buffer) or on disk (the tier's cache file).

The manager asks one question before each host-to-device copy, :meth:`DiskTier.source`: which host tensor to
copy block ``i`` from. A RAM block answers with its host-store buffer. A disk block answers with a staging
buffer its bytes were read into: reads are issued ahead of use (:meth:`read_ahead`, the blocks the model runs
next) by a few reader threads into a small ring of page-aligned staging buffers (page-locked on a GPU), and
``source`` waits for the read (the time waited is the disk's stall). After the copy is queued the manager hands
back its completion handle (:meth:`copied`): that staging buffer is refilled only once the copy has finished, so a
read never overwrites bytes a copy still reads.

Ordering, all on the host: read into staging k -> the host waits for the read -> the copy from k is queued on the
copy stream -> the host sees the copy's event complete -> the next read into k.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

import torch

from .disk_file import CacheFile, aligned_buffer, padded
from .pinning import PinLedger

__all__ = ["DiskTier"]

CHUNK_BYTES = 16 * 2**20  # one reader's request: large enough for full-speed O_DIRECT, small enough to spread


class _Staging:
    __slots__ = ("buffer", "block", "future", "copy")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.block: Optional[int] = None  # whose bytes are (being) read in
        self.future: Optional[List[Future]] = None
        self.copy = None  # the last copy's handle reading this buffer (None: no copy in flight)


def _copy_done(handle, wait: bool) -> bool:
    """Whether the copy behind ``handle`` has finished reading its source (``wait``: block until it has)."""
    event = getattr(handle, "done", None)
    if event is None:
        return True
    if wait:
        event.synchronize()
        return True
    return bool(event.query())


class DiskTier:
    """The disk blocks' cache file, staging ring and readers. ``ring_size`` staging buffers of the largest disk
    block; ``readers`` threads; ``pinner`` page-locks the ring (None: pageable)."""

    def __init__(self, folder: str, ring_size: int = 2, readers: int = 4, pinner=None,
                 expected_bytes: int = 0):
        self.folder = folder
        self.file = CacheFile(folder, expected_bytes)
        self.regions: Dict[int, tuple] = {}  # block -> (offset, nbytes)
        self.ring_size = max(2, int(ring_size))
        self.ring: List[_Staging] = []
        self.ring_bytes_each = 0
        self.ledger = PinLedger(pinner)
        self.pin = pinner is not None
        self._pool = ThreadPoolExecutor(max_workers=max(1, readers), thread_name_prefix="layerwise-offload-disk")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self.bytes_read = 0
        self.reads = 0
        self.read_seconds = 0.0  # wall time with at least one read in flight
        self.stall_seconds = 0.0  # time the host waited for a read it needed now
        self.demand_reads = 0  # reads not issued ahead (started when the copy needed them)

    # ----------------------------------------------------------------- blocks
    def holds(self, index: int) -> bool:
        return index in self.regions

    @property
    def blocks(self) -> List[int]:
        return sorted(self.regions)

    def nbytes(self) -> int:
        return sum(nbytes for _, nbytes in self.regions.values())

    def write(self, index: int, nbytes: int, fill) -> torch.Tensor:
        """Store block ``index``: ``fill(buffer)`` packs its bytes into a staging buffer, which is appended to the
        file; returns the region as a file-backed tensor (what released parameters may view)."""
        self.forget(index)
        self._ensure_ring(nbytes)
        staging = self._take(wait=True, protect=())
        staging.block = None
        fill(staging.buffer.narrow(0, 0, nbytes))
        offset = self.file.append(staging.buffer.narrow(0, 0, padded(nbytes)))
        self.regions[index] = (offset, nbytes)
        return self.file.view(offset, nbytes)

    def finish(self) -> None:
        self.file.finish()

    def forget(self, index: int) -> None:
        """Block ``index`` is not on disk any more (repacked, or moved to RAM): drop its region and staged bytes."""
        for staging in self.ring:
            if staging.block == index:
                self._settle(staging)
                staging.block = None
        self.regions.pop(index, None)

    # ----------------------------------------------------------------- the ring
    def _ensure_ring(self, nbytes: int) -> None:
        need = padded(nbytes)
        if self.ring and self.ring_bytes_each >= need:
            return
        self.quiesce()
        self.ledger.unpin_all()
        self.ring = [_Staging(aligned_buffer(need)) for _ in range(self.ring_size)]
        self.ring_bytes_each = need
        if self.pin:
            for staging in self.ring:
                self.ledger.pin(staging.buffer)

    @property
    def ring_bytes(self) -> int:
        return self.ring_bytes_each * len(self.ring)

    @property
    def pinned(self) -> bool:
        return bool(self.ring) and all(self.ledger.is_pinned(s.buffer) for s in self.ring)

    def _take(self, wait: bool, protect: Sequence[int]) -> Optional[_Staging]:
        """A staging buffer free for a new read: no block in it, its last copy done. With ``wait``, wait for the
        oldest copy, or drop a read-ahead the manager does not need next (never one in ``protect``)."""
        for staging in self.ring:
            if staging.block is None and _copy_done(staging.copy, wait=False):
                staging.copy = None
                return staging
        if not wait:
            return None
        for staging in self.ring:
            if staging.block is None:
                _copy_done(staging.copy, wait=True)
                staging.copy = None
                return staging
        for staging in self.ring:
            if staging.block not in protect:
                self._settle(staging)
                staging.block = None
                _copy_done(staging.copy, wait=True)
                staging.copy = None
                return staging
        raise RuntimeError("[layerwise-offload] every disk staging buffer holds a block about to be copied; "
                           "raise prefetch_size")

    def _settle(self, staging: _Staging) -> None:
        if staging.future is not None:
            for part in staging.future:
                part.result()
            staging.future = None

    # ----------------------------------------------------------------- reads
    def _start(self, index: int, staging: _Staging) -> None:
        offset, nbytes = self.regions[index]
        length = padded(nbytes)
        view = memoryview(staging.buffer.numpy()).cast("B")[:length]
        staging.block = index
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        parts = []
        remaining = [0]
        chunks = [(start, min(CHUNK_BYTES, length - start)) for start in range(0, length, CHUNK_BYTES)]
        remaining[0] = len(chunks)
        for start, size in chunks:
            parts.append(self._pool.submit(self._read, view[start:start + size], offset + start, remaining))
        staging.future = parts
        self.reads += 1
        self.bytes_read += nbytes

    def _read(self, view: memoryview, offset: int, remaining: list) -> None:
        try:
            self.file.read_into(view, offset)
        finally:
            with self._lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    self._in_flight -= 1
                    if self._in_flight == 0:
                        self.read_seconds += time.perf_counter() - self._busy_since

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Start reads for the disk blocks in ``indices`` (in the order they will be copied) while buffers are free."""
        if not self.regions:
            return
        self.file.finish()
        for index in indices:
            if index not in self.regions or any(s.block == index for s in self.ring):
                continue
            staging = self._take(wait=False, protect=indices)
            if staging is None:
                return
            self._start(index, staging)

    def source(self, index: int, protect: Sequence[int] = ()) -> torch.Tensor:
        """Block ``index``'s bytes in a staging buffer, read in full: the host tensor to copy it from."""
        self.file.finish()
        staging = next((s for s in self.ring if s.block == index), None)
        if staging is None:
            self.demand_reads += 1
            staging = self._take(wait=True, protect=protect)
            self._start(index, staging)
        started = time.perf_counter()
        self._settle(staging)
        self.stall_seconds += time.perf_counter() - started
        return staging.buffer.narrow(0, 0, self.regions[index][1])

    def copied(self, index: int, handle) -> None:
        """The copy of block ``index`` from its staging buffer is queued: refill the buffer after ``handle``."""
        for staging in self.ring:
            if staging.block == index:
                staging.block = None
                staging.copy = handle

    def quiesce(self) -> None:
        """Wait for every read and every copy from the ring (before the ring is replaced or freed)."""
        for staging in self.ring:
            self._settle(staging)
            _copy_done(staging.copy, wait=True)
            staging.copy = None

    def close(self) -> None:
        """Finish the reads, free the ring, delete the file."""
        self.quiesce()
        self._pool.shutdown(wait=True)
        self.ledger.unpin_all()
        self.ring = []
        self.regions = {}
        self.file.close()
