"""The disk tier: host copies of the blocks that live on disk instead of RAM (host/side.py holds both tiers).

Before each host-to-device copy of one of its blocks the host side asks :meth:`DiskTier.source`: the staging
buffer the block's bytes were read into. Reads are issued ahead of use (:meth:`read_ahead`, the blocks the model
runs next) by a few reader threads into a small ring of page-aligned staging buffers (page-locked on a GPU), and
``source`` waits for the read (the time waited is the disk's stall). A disk block's bytes come from one of two
sources: a region of the tier's cache file (written once at packing, read back with O_DIRECT), or, where every
weight of the block is byte for byte a tensor of the safetensors checkpoint (:mod:`.checkpoint_file`), the
checkpoint itself: a list of extents (file offset, bytes, offset in the block's store layout) read into place with
buffered reads whose pages are then dropped from the page cache (checkpoint offsets are not page-aligned, so
O_DIRECT cannot read them into place). Nothing is written for those. After the copy is queued the manager hands
back its completion handle (:meth:`copied`): that staging buffer is refilled only once the copy has finished, so a
read never overwrites bytes a copy still reads.

Ordering, all on the host: read into staging k -> the host waits for the read -> the copy from k is queued on the
copy stream -> the host sees the copy's event complete -> the next read into k.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..device.backend import copy_finished
from .cache_file import ALIGN, CacheFile, aligned_buffer, padded
from ..host.pinning import PinLedger

__all__ = ["DiskTier"]

CHUNK_BYTES = 16 * 2**20  # one reader's request: large enough for full-speed O_DIRECT, small enough to spread


class _Staging:
    __slots__ = ("buffer", "block", "future", "copy")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.block: Optional[int] = None  # whose bytes are (being) read in
        self.future: Optional[List[Future]] = None
        self.copy = None  # the last copy's handle reading this buffer (None: no copy in flight)


class DiskTier:
    """The disk blocks' cache file, staging ring and readers. ``ring_size`` staging buffers of the largest disk
    block; ``readers`` threads; ``pinner`` page-locks the ring (None: pageable)."""

    def __init__(self, folder: str, ring_size: int = 2, readers: int = 4, pinner=None,
                 expected_bytes: int = 0):
        self.folder = folder
        self.expected_bytes = expected_bytes
        self._file: Optional[CacheFile] = None  # made at the first block written (none: all from the checkpoint)
        self.regions: Dict[int, tuple] = {}  # block -> (cache-file offset, or None for the checkpoint; nbytes)
        self.extents: Dict[int, List[tuple]] = {}  # checkpoint blocks -> [(path, file offset, nbytes, offset)]
        self._fds: Dict[str, int] = {}  # checkpoint path -> O_RDONLY descriptor
        self.kept: Dict[int, tuple] = {}  # checkpoint blocks -> (layout, [(entry index, RAM tensor)])
        self.ring_size = max(2, int(ring_size))
        self.ring: List[_Staging] = []  # allocated at the first read (packing, before it, frees RAM first)
        self.ring_bytes_each = 0
        self._largest = 0  # the largest disk block, padded: what each staging buffer holds
        self._chunk: Optional[torch.Tensor] = None  # the buffer blocks are written through
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

    @property
    def file(self) -> CacheFile:
        if self._file is None:
            self._file = CacheFile(self.folder, self.expected_bytes)
        return self._file

    def checkpoint_bytes(self) -> int:
        return sum(self.regions[i][1] for i in self.extents)

    def place(self, index: int, nbytes: int, extents: Sequence[tuple], kept: Sequence[tuple] = (),
              layout=None) -> None:
        """Block ``index`` is read from the checkpoint: ``extents`` = [(path, file offset, nbytes, offset in the
        block's layout)]; nothing is written. ``kept`` = [(entry index in ``layout``, tensor)]: the few entries
        that are not the file's bytes, copied from RAM into the staging buffer with each read."""
        self.forget(index)
        self._largest = max(self._largest, padded(nbytes))
        self.regions[index] = (None, nbytes)
        self.extents[index] = list(extents)
        if kept:
            self.kept[index] = (layout, list(kept))
        for path, *_ in extents:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)

    def write(self, index: int, nbytes: int, pieces: Iterable[Tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Store block ``index`` (``nbytes``) in the cache file from ``pieces``: (offset in the block, flat uint8
        tensor) in rising order, the gaps left zero. They are written through one :data:`CHUNK_BYTES` buffer, never
        a block-sized one, so writing a block takes no more RAM than a chunk. Returns the region as a file-backed
        tensor (what released parameters may view)."""
        self.forget(index)
        self._largest = max(self._largest, padded(nbytes))
        if self._chunk is None:
            self._chunk = aligned_buffer(CHUNK_BYTES)
        chunk, filled, first, position = self._chunk, 0, None, 0

        def put(data: Optional[torch.Tensor], length: int) -> None:
            nonlocal filled, first
            done = 0
            while done < length:
                take = min(length - done, CHUNK_BYTES - filled)
                target = chunk.narrow(0, filled, take)
                if data is None:
                    target.zero_()
                else:
                    target.copy_(data.narrow(0, done, take))
                filled += take
                done += take
                if filled == CHUNK_BYTES:
                    at = self.file.append(chunk)
                    first = at if first is None else first
                    filled = 0

        for offset, data in pieces:
            if offset > position:
                put(None, offset - position)
            put(data, data.numel())
            position = offset + data.numel()
        put(None, padded(nbytes) - position)
        if filled:
            at = self.file.append(chunk.narrow(0, 0, filled))
            first = at if first is None else first
        self.regions[index] = (first, nbytes)
        return self.file.view(first, nbytes)

    def finish(self) -> None:
        if self._file is not None:
            self._file.finish()

    def forget(self, index: int) -> None:
        """Block ``index`` is not on disk any more (repacked, or moved to RAM): drop its region and staged bytes."""
        for staging in self.ring:
            if staging.block == index:
                self._settle(staging)
                staging.block = None
        self.regions.pop(index, None)
        self.extents.pop(index, None)
        self.kept.pop(index, None)

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
        self._ensure_ring(self._largest)
        self._chunk = None  # packing is over: the write buffer goes before the ring is used
        for staging in self.ring:
            if staging.block is None and copy_finished(staging.copy, wait=False):
                staging.copy = None
                return staging
        if not wait:
            return None
        for staging in self.ring:
            if staging.block is None:
                copy_finished(staging.copy, wait=True)
                staging.copy = None
                return staging
        for staging in self.ring:
            if staging.block not in protect:
                self._settle(staging)
                staging.block = None
                copy_finished(staging.copy, wait=True)
                staging.copy = None
                return staging
        raise RuntimeError("[layerwise-offload] every disk staging buffer holds a block about to be copied; "
                           "raise prefetch_size")

    def _settle(self, staging: _Staging) -> None:
        """Wait for the read into ``staging``. A failed read (an I/O error, a file changed outside) is raised once:
        every part is waited for first (none still writes into the buffer), and the buffer is emptied, so the next
        wait (an unload's, say) does not raise it again and the ring stays usable."""
        if staging.future is None:
            return
        parts, staging.future = staging.future, None
        error = None
        for part in parts:
            try:
                part.result()
            except BaseException as failure:  # noqa: BLE001 - re-raised below, after the other parts
                error = error or failure
        if error is not None:
            staging.block = None  # its bytes are not the block's
            raise error

    # ----------------------------------------------------------------- reads
    def _start(self, index: int, staging: _Staging) -> None:
        offset, nbytes = self.regions[index]
        length = padded(nbytes)
        view = memoryview(staging.buffer.numpy()).cast("B")[:length]
        if offset is None:
            jobs = [(self._read_checkpoint, view[at + start:at + start + min(CHUNK_BYTES, size - start)],
                     self._fds[path], where + start)
                    for path, where, size, at in self.extents[index] for start in range(0, size, CHUNK_BYTES)]
            if index in self.kept:
                jobs.append((self._fill_kept, staging.buffer.narrow(0, 0, nbytes), self.kept[index], None))
        else:
            jobs = [(self.file.read_into, view[start:start + min(CHUNK_BYTES, length - start)], None, offset + start)
                    for start in range(0, length, CHUNK_BYTES)]
        staging.block = index
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        remaining = [len(jobs)]
        staging.future = [self._pool.submit(self._read, job, remaining) for job in jobs]
        if not jobs:
            self._read_done(remaining)
        self.reads += 1
        self.bytes_read += nbytes

    def _read(self, job: tuple, remaining: list) -> None:
        read, view, fd, offset = job
        try:
            if offset is None:
                read(view, fd)
            elif fd is None:
                read(view, offset)
            else:
                read(view, fd, offset)
        finally:
            self._read_done(remaining)

    def _read_done(self, remaining: list) -> None:
        with self._lock:
            remaining[0] -= 1
            if remaining[0] <= 0:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.read_seconds += time.perf_counter() - self._busy_since

    @staticmethod
    def _fill_kept(buffer: torch.Tensor, kept: tuple) -> None:
        layout, entries = kept
        views = layout.views(buffer)
        with torch.no_grad():
            for position, tensor in entries:
                views[position].copy_(tensor)

    @staticmethod
    def _read_checkpoint(view: memoryview, fd: int, offset: int) -> None:
        """Read one extent of the checkpoint into place, then drop its pages from the page cache (whole pages
        around it: a neighbour's page is read again at worst, never kept)."""
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"[layerwise-offload] the checkpoint ended at byte {offset + done} while reading a "
                              f"block from it (was it replaced while ComfyUI runs?)")
            done += got
        first = offset // ALIGN * ALIGN
        os.posix_fadvise(fd, first, padded(offset + len(view)) - first, os.POSIX_FADV_DONTNEED)

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Start reads for the disk blocks in ``indices`` (in the order they will be copied) while buffers are free."""
        if not self.regions:
            return
        self.finish()
        for index in indices:
            if index not in self.regions or any(s.block == index for s in self.ring):
                continue
            staging = self._take(wait=False, protect=indices)
            if staging is None:
                return
            self._start(index, staging)

    def source(self, index: int, protect: Sequence[int] = ()) -> torch.Tensor:
        """Block ``index``'s bytes in a staging buffer, read in full: the host tensor to copy it from."""
        self.finish()
        staging = next((s for s in self.ring if s.block == index), None)
        if staging is None:
            self.demand_reads += 1
            staging = self._take(wait=True, protect=protect)
            self._start(index, staging)
        started = time.perf_counter()
        self._settle(staging)
        self.stall_seconds += time.perf_counter() - started
        return staging.buffer.narrow(0, 0, self.regions[index][1])

    def pageable(self, index: int) -> bool:
        """Whether copies from the staging ring read pageable memory (the ring could not be page-locked)."""
        return not self.pinned

    def copied(self, index: int, handle) -> None:
        """The copy of block ``index`` from its staging buffer is queued: refill the buffer after ``handle``."""
        for staging in self.ring:
            if staging.block == index:
                staging.block = None
                staging.copy = handle

    def settle_reads(self) -> None:
        """Wait for the reads in flight; what they staged stays usable."""
        for staging in self.ring:
            self._settle(staging)

    def quiesce(self) -> None:
        """Wait for every read and every copy from the ring (before the ring is replaced or freed)."""
        for staging in self.ring:
            self._settle(staging)
            copy_finished(staging.copy, wait=True)
            staging.copy = None

    def close(self) -> None:
        """Finish the reads, free the ring, delete the file."""
        self.quiesce()
        self._pool.shutdown(wait=True)
        self.ledger.unpin_all()
        self.ring = []
        self.regions = {}
        self.extents = {}
        self.kept = {}
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._file is not None:
            self._file.close()
