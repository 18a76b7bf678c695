"""The disk tier: host copies of the blocks that live on disk instead of RAM (host/side.py holds both tiers).

A disk block never exists whole in RAM. Its copy to the device reads it chunk by chunk (:data:`CHUNK_BYTES`) into
a small ring of page-aligned staging chunks (page-locked on a GPU; :data:`STAGING_CHUNKS` of them, whatever the
block size) and queues each chunk's host-to-device copy into its place in the device buffer as soon as that chunk
is read; a staging chunk is read into again only once the host has seen the copy that read it finish. So the
disk tier's RAM is that ring (:func:`staging_ring_bytes`: 32 MiB), not prefetch + 2 whole blocks as before.

:meth:`DiskTier.source` answers a copy with a :class:`DiskSource` (where the RAM tier answers with its host
tensor): the copier hands it the device buffer (:meth:`DiskSource.copy_to`), the host waits for each chunk's read
(the disk's stall) and queues its copy, the first after the compute mark the slot needs, the transform (a LoRA on
the device) after the last. Reads are issued ahead by a few reader threads as the ring has room: the block's next
chunks first, then the blocks the model runs next (:meth:`read_ahead`). Since the host stages such a copy (it
waits for reads, and for chunks whose copy still runs), the manager issues it after the running block is launched,
as it does a copy from pageable memory (:meth:`DiskTier.pageable`).

A disk block's bytes come from one of two sources: a region of the tier's cache file (written once at packing,
read back with O_DIRECT: regions and chunks are 4 KiB multiples), or, where every weight of the block is byte for
byte a tensor of the safetensors checkpoint (:mod:`.checkpoint`) or of another loader's read-only mapping
(:mod:`.mappings`), the checkpoint itself: a list of extents (file offset, bytes, offset in the block's store
layout), each chunk reading the parts of them that fall in it, with buffered reads whose pages are then dropped
from the page cache (checkpoint offsets are not page-aligned, so O_DIRECT cannot read them into place). Nothing is
written for those; the few entries that are not the file's bytes are copied from RAM into the chunks they fall in.

Ordering, all on the host, per chunk: read into staging k -> the host waits for the read -> the copy from k is
queued on the copy stream -> the host sees the copy's event complete -> the next read into k.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..memory.pinning import PinLedger, copy_finished
from .cache_file import ALIGN, CacheFile, aligned_buffer, padded

__all__ = ["CHUNK_BYTES", "DiskSource", "DiskTier", "READ_BYTES", "STAGING_CHUNKS", "staging_ring_bytes"]

CHUNK_BYTES = 16 * 2**20  # one staging chunk (a 4 KiB multiple), and the buffer blocks are written through
STAGING_CHUNKS = 2  # the staging ring: this many chunks of host RAM, whatever the block size
READ_BYTES = 4 * 2**20  # one reader's request: a chunk is read by several readers at once


def staging_ring_bytes(largest_block_bytes: int, chunks: Optional[int] = None) -> int:
    """The disk tier's staging RAM for disk blocks of at most ``largest_block_bytes``: ``chunks``
    (:data:`STAGING_CHUNKS`) buffers of one :data:`CHUNK_BYTES` chunk each, or of the largest block, page-padded,
    where that is smaller. It does not grow with the block: the accounting (host/side.py) and the tier use this."""
    if largest_block_bytes <= 0:
        return 0
    return (STAGING_CHUNKS if chunks is None else max(1, int(chunks))) * _chunk_bytes(largest_block_bytes)


def _chunk_bytes(largest_block_bytes: int) -> int:
    return max(ALIGN, min(CHUNK_BYTES, padded(largest_block_bytes)))


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


class DiskSource:
    """Block ``index``'s bytes on disk as a copy reads them: chunk by chunk through the tier's staging ring (what
    :meth:`DiskTier.source` answers where the RAM tier answers with a host tensor). ``protect``: the disk blocks
    copied next, read ahead as the ring has room and never dropped for another read ahead."""

    __slots__ = ("tier", "index", "protect")

    def __init__(self, tier: "DiskTier", index: int, protect: Sequence[int] = ()):
        self.tier, self.index, self.protect = tier, index, tuple(protect)

    @property
    def nbytes(self) -> int:
        return self.tier.regions[self.index][1]

    def copy_to(self, backend, dst: torch.Tensor, after=None, then=None):
        """Queue the block's copy into ``dst`` (uint8, its ``nbytes``) on ``backend``, each chunk as soon as it is
        read: ``after`` (the compute mark the device buffer waits for) before the first, ``then`` (the transform)
        after the last, whose handle is returned (one copy stream: it follows every chunk)."""
        def put(start: int, length: int, staged: torch.Tensor, first: bool, last: bool):
            return backend.copy(dst.narrow(0, start, length), staged, after=after if first else None,
                                then=then if last else None)
        return self.tier._copy(self.index, self.protect, put)

    def read(self) -> torch.Tensor:
        """The block's bytes in a new host tensor: a whole block of RAM, for checks (the copy path never does)."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)

        def put(start: int, length: int, staged: torch.Tensor, first: bool, last: bool):
            out.narrow(0, start, length).copy_(staged)
            return None
        self.tier._copy(self.index, self.protect, put)
        return out


class DiskTier:
    """The disk blocks' cache file, staging ring and readers. ``ring_size`` staging chunks (of
    :data:`CHUNK_BYTES`, or of the largest disk block where smaller); ``readers`` threads; ``pinner`` page-locks the
    ring (None: pageable)."""

    def __init__(self, folder: str, ring_size: int = STAGING_CHUNKS, readers: int = 4, pinner=None,
                 expected_bytes: int = 0):
        self.folder = folder
        self.expected_bytes = expected_bytes
        self._file: Optional[CacheFile] = None  # made at the first block written (none: all from the checkpoint)
        self.regions: Dict[int, tuple] = {}  # block -> (cache-file offset, or None for the checkpoint; nbytes)
        self.extents: Dict[int, List[tuple]] = {}  # checkpoint blocks -> [(path, file offset, nbytes, offset)]
        self._fds: Dict[str, int] = {}  # checkpoint path -> O_RDONLY descriptor
        self.kept: Dict[int, tuple] = {}  # checkpoint blocks -> (layout, [(entry index, RAM tensor)])
        self.ring_size = max(1, int(ring_size))
        self.ring: List[_Staging] = []  # allocated at the first read (packing, before it, frees RAM first)
        self.ring_bytes_each = 0  # one staging chunk: the size of every block's chunks while the ring lives
        self._largest = 0  # the largest disk block, padded
        self._order = 0
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
    def _ensure_ring(self) -> None:
        """The staging ring, allocated at the first read (packing, before it, frees RAM first); again, after every
        read and copy from it is done, where a larger disk block than its chunk (a small one's) was written."""
        need = _chunk_bytes(self._largest)
        self._chunk = None  # packing is over: the write buffer goes before the ring is used
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

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def _pieces(self, index: int) -> List[Tuple[int, int]]:
        """Block ``index``'s chunks: (first byte, bytes), one staging chunk each."""
        nbytes, size = self.regions[index][1], self.ring_bytes_each
        return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)] or [(0, 0)]

    def _staged(self, index: int, piece: int) -> Optional[_Staging]:
        return next((s for s in self.ring if s.block == index and s.piece == piece), None)

    def _take(self, wait: bool, index: Optional[int] = None, piece: int = 0,
              protect: Sequence[int] = ()) -> Optional[_Staging]:
        """A staging chunk free for a new read: no read in it, its last copy done. With ``wait`` (chunk ``piece`` of
        block ``index`` is needed now) wait for the oldest copy, or else drop a read ahead: of a block not in
        ``protect`` before one in it, the latest started first, a later chunk of ``index`` last."""
        self._ensure_ring()
        free = sorted((s for s in self.ring if s.block is None), key=lambda s: s.order)
        for staging in free:
            if copy_finished(staging.copy, wait=False):
                staging.copy = None
                return staging
        if not wait:
            return None
        if free:
            staging = free[0]
        else:
            dropped = [s for s in self.ring if s.block != index or s.piece > piece]
            if not dropped:
                raise RuntimeError(f"[layerwise-offload] no disk staging chunk for block {index}")  # unreachable
            staging = min(dropped, key=lambda s: (s.block == index, s.block in protect, -s.order))
            self._settle(staging)
            staging.block = None
        copy_finished(staging.copy, wait=True)
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

    # ----------------------------------------------------------------- reads
    def _start(self, index: int, piece: int, staging: _Staging) -> None:
        """Start reading chunk ``piece`` of block ``index`` into ``staging`` (free), in requests of
        :data:`READ_BYTES` spread over the readers."""
        offset, nbytes = self.regions[index]
        size = self.ring_bytes_each
        first = piece * size
        length = max(0, min(size, nbytes - first))
        step = max(ALIGN, min(READ_BYTES, size) // ALIGN * ALIGN)
        view = memoryview(staging.buffer.numpy()).cast("B")
        if offset is None:
            jobs = []
            for path, where, count, at in self.extents[index]:
                low, high = max(at, first), min(at + count, first + length)
                jobs += [(self._read_checkpoint, view[begin - first:min(begin + step, high) - first], self._fds[path],
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
                    self.read_seconds += time.perf_counter() - self._busy_since

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
        if not self.regions:
            return
        self.finish()
        self._ensure_ring()
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

    def source(self, index: int, protect: Sequence[int] = ()) -> DiskSource:
        """Block ``index``'s bytes as its copy reads them (:class:`DiskSource`), its first chunks' reads started
        where the ring has room (before any read ahead of ``protect``, the blocks copied after it)."""
        self.finish()
        self._ensure_ring()
        if self._staged(index, 0) is None:
            self.demand_reads += 1
        self._fill(index, 0, ())
        return DiskSource(self, index, protect)

    def _copy(self, index: int, protect: Sequence[int], put) -> object:
        """Block ``index`` through the ring, chunk by chunk in order: each read (started here if not yet) waited for,
        then ``put(first byte, bytes, staged bytes, is first, is last)`` queues its copy and returns its handle,
        which the chunk keeps: it is read into again only after that copy. Returns the last chunk's handle."""
        self.finish()
        self._ensure_ring()
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

    def pageable(self, index: int) -> bool:
        """Always: the host stages a disk block's copy (it waits for each chunk's read, and for chunks a copy still
        reads), as a copy from pageable memory, so the manager issues it after the running block is launched."""
        return True

    def copied(self, index: int, handle) -> None:
        """The copy of block ``index`` is queued: each of its chunks kept its own copy's handle as it was queued
        (:meth:`DiskSource.copy_to`), so nothing is left to do."""

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
