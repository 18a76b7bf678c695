"""The disk tier's staging ring and readers: how a disk block's bytes come into RAM a chunk at a time.

:class:`StagingRing` holds a few page-aligned staging chunks (page-locked on a GPU) and the reader threads that
fill them. A copy takes a block chunk by chunk: each chunk's read is waited for, then its host-to-device copy is
queued from the staging chunk, which keeps that copy's handle; a staging chunk is read into again only once the host
has seen the copy that read it finish. Reads are issued ahead as the ring has room: the block's next chunks first,
then the blocks the model runs next (:meth:`StagingRing.read_ahead`).

A chunk is read from where the tier placed the block: its region of the cache file (O_DIRECT, whole pages into
place), or the parts of the checkpoint extents that fall in it (buffered reads whose pages are then dropped from the
page cache: checkpoint offsets are not page-aligned), plus the few kept entries copied from RAM.

Ordering, all on the host, per chunk: read into staging k -> the host waits for the read -> the copy from k is
queued on the copy stream -> the host sees the copy's event complete -> the next read into k.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..memory.pinning import PinLedger, copy_finished
from .cache_file import ALIGN, CacheFile, aligned_buffer, padded

__all__ = ["READ_BYTES", "StagingRing"]

READ_BYTES = 4 * 2**20  # one reader's request: a chunk is read by several readers at once


def _kept_in(kept: tuple, first: int, length: int) -> bool:
    """Whether any kept entry (``(layout, [(entry index, tensor)])``) has bytes in ``[first, first + length)``."""
    layout, entries = kept
    for position, _ in entries:
        entry = layout.entries[position]
        if entry.offset < first + length and first < entry.offset + entry.span_elements * entry.dtype.itemsize:
            return True
    return False


class _Staging:
    __slots__ = ("buffer", "block", "piece", "future", "copy", "order")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.block: Optional[int] = None  # whose bytes are (being) read in: the block...
        self.piece = 0  # ... and which of its chunks
        self.future: Optional[List[Future]] = None
        self.copy = None  # the last copy's handle reading this buffer (None: no copy in flight)
        self.order = 0  # when its read started or its copy was queued: the oldest copy is waited for first


class StagingRing:
    """``size`` staging chunks of :attr:`chunk_bytes` each and ``readers`` threads; ``pinner`` page-locks the chunks
    (None: pageable). The blocks are the tier's, read where it placed them: ``regions`` (block -> (cache-file
    offset, or None for the checkpoint; nbytes)), ``extents`` (checkpoint blocks -> [(path, file offset, nbytes,
    offset)]), ``kept`` (checkpoint blocks -> (layout, [(entry index, RAM tensor)])), ``fds`` (checkpoint path ->
    descriptor) and :attr:`file` (the cache file). ``allocate`` and ``finished`` are the page-aligned allocator and
    the copy-finished test."""

    def __init__(self, regions: Dict[int, tuple], extents: Dict[int, List[tuple]], kept: Dict[int, tuple],
                 fds: Dict[str, int], size: int, readers: int = 4, pinner=None,
                 allocate: Callable[[int], torch.Tensor] = aligned_buffer,
                 finished: Callable[..., bool] = copy_finished):
        # The tier's own maps, not copies: a block it places or forgets is seen here at the next read.
        self.regions, self.extents, self.kept, self.fds = regions, extents, kept, fds
        self.file: Optional[CacheFile] = None  # the tier's, once it made one
        self.chunk_bytes = 0  # the chunk the largest disk block needs: the tier sets it before each read
        self.allocate, self.finished = allocate, finished
        self.size = max(1, int(size))
        self.chunks: List[_Staging] = []  # allocated at the first read (packing, before it, frees RAM first)
        self.bytes_each = 0  # one staging chunk: the size of every block's chunks while the ring lives
        self._order = 0
        self.ledger = PinLedger(pinner)
        self.pin = pinner is not None
        self.readers = max(1, readers)
        self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="layerwise-offload-disk")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self.bytes_read = 0
        self.reads = 0
        self._read_seconds_done = 0.0  # the busy periods that ended (read_seconds adds the running one)
        self.stall_seconds = 0.0  # time the host waited for a read it needed now
        self.demand_reads = 0  # reads not issued ahead (started when the copy needed them)

    # ----------------------------------------------------------------- the chunks
    def _ensure(self) -> None:
        """The chunks, allocated at the first read; again, after every read and copy from them is done, where the
        chunk the disk blocks need changed (a larger block written after a small one's, or a tighter host plan)."""
        need = self.chunk_bytes
        if self.chunks and self.bytes_each == need:
            return
        self.quiesce()
        self.ledger.unpin_all()
        self.chunks = [_Staging(self.allocate(need)) for _ in range(self.size)]
        self.bytes_each = need
        if self.pin:
            for staging in self.chunks:
                self.ledger.pin(staging.buffer)

    @property
    def nbytes(self) -> int:
        return self.bytes_each * len(self.chunks)

    @property
    def read_seconds(self) -> float:
        """Wall time with at least one read in flight, the running period included: while the ring keeps reading
        ahead a busy period need not end for many steps, and a rate or a run's share read before it ended would
        count none of it."""
        with self._lock:
            running = time.perf_counter() - self._busy_since if self._in_flight else 0.0
            return self._read_seconds_done + running

    @property
    def pinned(self) -> bool:
        return bool(self.chunks) and all(self.ledger.is_pinned(s.buffer) for s in self.chunks)

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def _pieces(self, index: int) -> List[Tuple[int, int]]:
        """Block ``index``'s chunks: (first byte, bytes), one staging chunk each."""
        nbytes, size = self.regions[index][1], self.bytes_each
        return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)] or [(0, 0)]

    def _staged(self, index: int, piece: int) -> Optional[_Staging]:
        return next((s for s in self.chunks if s.block == index and s.piece == piece), None)

    def _take(self, wait: bool, index: Optional[int] = None, piece: int = 0,
              protect: Sequence[int] = ()) -> Optional[_Staging]:
        """A staging chunk free for a new read: no read in it, its last copy done. With ``wait`` (chunk ``piece`` of
        block ``index`` is needed now) wait for the oldest copy, or else drop a read ahead: of a block not in
        ``protect`` before one in it, the latest started first, a later chunk of ``index`` last."""
        self._ensure()
        free = sorted((s for s in self.chunks if s.block is None), key=lambda s: s.order)
        for staging in free:
            if self.finished(staging.copy, wait=False):
                staging.copy = None
                return staging
        if not wait:
            return None
        if free:
            staging = free[0]
        else:
            dropped = [s for s in self.chunks if s.block != index or s.piece > piece]
            if not dropped:
                raise RuntimeError(f"[layerwise-offload] no disk staging chunk for block {index}")  # unreachable
            staging = min(dropped, key=lambda s: (s.block == index, s.block in protect, -s.order))
            self._settle(staging)
            staging.block = None
        self.finished(staging.copy, wait=True)
        staging.copy = None
        return staging

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

    def drop(self, index: int) -> None:
        """Block ``index`` is not on disk any more: its staged bytes are not read or kept."""
        for staging in self.chunks:
            if staging.block == index:
                self._settle(staging)
                staging.block = None

    # ----------------------------------------------------------------- reads
    def _start(self, index: int, piece: int, staging: _Staging) -> None:
        """Start reading chunk ``piece`` of block ``index`` into ``staging`` (free), in requests of
        :data:`READ_BYTES` spread over the readers (smaller ones for a smaller chunk: one per reader)."""
        offset, nbytes = self.regions[index]
        size = self.bytes_each
        first = piece * size
        length = max(0, min(size, nbytes - first))
        request = min(READ_BYTES, size // self.readers) if size >= READ_BYTES else size
        step = max(ALIGN, request // ALIGN * ALIGN)
        view = memoryview(staging.buffer.numpy()).cast("B")
        if offset is None:
            jobs = []
            for path, where, count, at in self.extents[index]:
                low, high = max(at, first), min(at + count, first + length)
                jobs += [(self._read_checkpoint, view[begin - first:min(begin + step, high) - first], self.fds[path],
                          where + begin - at) for begin in range(low, high, step)]
            kept = self.kept.get(index)
            if kept is not None and _kept_in(kept, first, length):
                jobs.append((self._fill_kept, staging.buffer, (first, length, kept), None))
        else:
            span = padded(length)  # the region is page-padded in the file: O_DIRECT reads whole pages into place
            jobs = [(self.file.read_into, view[start:min(start + step, span)], None, offset + first + start)
                    for start in range(0, span, step)]
        staging.block, staging.piece, staging.order = index, piece, self._next_order()
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        remaining = [len(jobs)]
        staging.future = [self._pool.submit(self._read, job, remaining) for job in jobs]
        if not jobs:
            self._read_done(remaining)
        self.reads += 1
        self.bytes_read += length

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
                    self._read_seconds_done += time.perf_counter() - self._busy_since

    @staticmethod
    def _fill_kept(buffer: torch.Tensor, chunk: tuple) -> None:
        """Copy the kept entries' bytes (RAM tensors, not the file's) that fall in the chunk ``(first byte, bytes,
        kept)`` of their block into ``buffer``, where that chunk is staged."""
        first, length, (layout, entries) = chunk
        with torch.no_grad():
            for position, tensor in entries:
                entry = layout.entries[position]
                nbytes = entry.span_elements * entry.dtype.itemsize
                low, high = max(entry.offset, first), min(entry.offset + nbytes, first + length)
                if low >= high:
                    continue
                if low == entry.offset and high == entry.offset + nbytes:  # the whole entry: in place, as stored
                    typed = buffer.narrow(0, low - first, nbytes).view(entry.dtype)
                    typed.as_strided(entry.shape, entry.stride).copy_(tensor)
                    continue
                spread = torch.zeros(nbytes, dtype=torch.uint8)  # across chunks: its span laid out, then a part
                spread.view(entry.dtype).as_strided(entry.shape, entry.stride).copy_(tensor)
                buffer.narrow(0, low - first, high - low).copy_(spread.narrow(0, low - entry.offset, high - low))

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

    def _fill(self, index: int, piece: int, protect: Sequence[int]) -> None:
        """Start reads while the ring has free chunks: block ``index``'s chunks from ``piece`` on first, then (all
        of them started) the blocks of ``protect``, in order."""
        for later in range(piece, len(self._pieces(index))):
            if self._staged(index, later) is None:
                staging = self._take(wait=False)
                if staging is None:
                    return
                self._start(index, later, staging)
        self.read_ahead(protect)

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Start reads for the disk blocks in ``indices`` (in the order they will be copied), chunk by chunk, while
        the ring has free chunks."""
        self._ensure()
        for index in indices:
            if index not in self.regions:
                continue
            for piece in range(len(self._pieces(index))):
                if self._staged(index, piece) is not None:
                    continue
                staging = self._take(wait=False)
                if staging is None:
                    return
                self._start(index, piece, staging)

    def begin(self, index: int) -> None:
        """Block ``index`` is copied next: its first chunks' reads start where the ring has room, before any read
        ahead (a read not already staged counts as a demand read)."""
        self._ensure()
        if self._staged(index, 0) is None:
            self.demand_reads += 1
        self._fill(index, 0, ())

    def copy(self, index: int, protect: Sequence[int], put) -> object:
        """Block ``index`` through the ring, chunk by chunk in order: each read (started here if not yet) waited for,
        then ``put(first byte, bytes, staged bytes, is first, is last)`` queues its copy and returns its handle,
        which the chunk keeps: it is read into again only after that copy. Returns the last chunk's handle."""
        self._ensure()
        pieces = self._pieces(index)
        handle = None
        for piece, (start, length) in enumerate(pieces):
            staging = self._staged(index, piece)
            if staging is None:
                staging = self._take(wait=True, index=index, piece=piece, protect=protect)
                self._start(index, piece, staging)
            self._fill(index, piece + 1, protect)  # the readers stay busy while the host waits for this one
            started = time.perf_counter()
            self._settle(staging)
            self.stall_seconds += time.perf_counter() - started
            handle = put(start, length, staging.buffer.narrow(0, 0, length), piece == 0, piece == len(pieces) - 1)
            staging.block, staging.copy, staging.order = None, handle, self._next_order()
        self.read_ahead(protect)
        return handle

    def settle_reads(self) -> None:
        """Wait for the reads in flight; what they staged stays usable."""
        for staging in self.chunks:
            self._settle(staging)

    def quiesce(self) -> None:
        """Wait for every read and every copy from the ring (before the ring is replaced or freed)."""
        for staging in self.chunks:
            self._settle(staging)
            self.finished(staging.copy, wait=True)
            staging.copy = None

    def close(self) -> None:
        """Finish the reads and copies, stop the readers, free the chunks."""
        self.quiesce()
        self._pool.shutdown(wait=True)
        self.ledger.unpin_all()
        self.chunks = []
