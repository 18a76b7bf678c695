"""The disk tier: host copies of the blocks that live on disk instead of RAM (host/tiers.py holds the RAM tier,
host/side.py routes each copy to its tier).

A disk block never exists whole in RAM. Its copy to the device reads it chunk by chunk (:data:`CHUNK_BYTES`) into
a small ring of page-aligned staging chunks (page-locked on a GPU; :data:`STAGING_CHUNKS` of them, whatever the
block size) and queues each chunk's host-to-device copy into its place in the device buffer as soon as that chunk
is read (the ring, its readers and their ordering: :mod:`.staging`). So the disk tier's RAM is that ring
(:func:`staging_ring_bytes`: 32 MiB, 8 MiB where RAM leaves no choice but the disk), not prefetch + 2
whole blocks as before.

This room holds where the blocks are and how they get there: :class:`DiskTier` places them, writes them, owns the
cache file and the ring, and answers a copy with a :class:`DiskSource` (where the RAM tier answers with its host
tensor): the copier hands it the device buffer (:meth:`DiskSource.copy_to`), the host waits for each chunk's read
(the disk's stall) and queues its copy, the first after the compute mark the slot needs, the transform (a LoRA on
the device) after the last. Since the host stages such a copy (it waits for reads, and for chunks whose copy still
runs), the manager issues it after the running block is launched, as it does a copy from pageable memory
(:meth:`DiskTier.pageable`).

A disk block's bytes come from one of two sources: a region of the tier's cache file (written once at packing,
read back with O_DIRECT: regions and chunks are 4 KiB multiples), or, where every weight of the block is byte for
byte a tensor of the safetensors checkpoint (:mod:`.checkpoint`) or of another loader's read-only mapping
(:mod:`.mappings`), the checkpoint itself: a list of extents (file offset, bytes, offset in the block's store
layout), each chunk reading the parts of them that fall in it. Nothing is written for those; the few entries that
are not the file's bytes are copied from RAM into the chunks they fall in.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..memory.pinning import copy_finished
from .cache_file import ALIGN, CacheFile, aligned_buffer, padded
from .staging import StagingRing

__all__ = ["CHUNK_BYTES", "DiskSource", "DiskTier", "STAGING_CHUNKS", "TIGHT_CHUNK_BYTES",
           "staging_ring_bytes"]

CHUNK_BYTES = 16 * 2**20  # one staging chunk (a 4 KiB multiple), and the buffer blocks are written through
# Where RAM leaves no choice but the disk, the ring's chunks shrink to this (8 MiB of ring instead of 32): each is
# still read as four requests in flight (staging.py), as the read-rate probe measures the disk.
TIGHT_CHUNK_BYTES = 4 * 2**20
STAGING_CHUNKS = 2  # the staging ring: this many chunks of host RAM, whatever the block size


def staging_ring_bytes(largest_block_bytes: int, chunks: Optional[int] = None, tight: bool = False) -> int:
    """The disk tier's staging RAM for disk blocks of at most ``largest_block_bytes``: ``chunks``
    (:data:`STAGING_CHUNKS`) buffers of one :data:`CHUNK_BYTES` chunk each (``tight``, where RAM is short:
    :data:`TIGHT_CHUNK_BYTES`), or of the largest block, page-padded, where that is smaller. It does not grow with
    the block: the accounting (host/tier_planning.py) and the tier use this."""
    if largest_block_bytes <= 0:
        return 0
    return (STAGING_CHUNKS if chunks is None else max(1, int(chunks))) * _chunk_bytes(largest_block_bytes, tight)


def _chunk_bytes(largest_block_bytes: int, tight: bool = False) -> int:
    return max(ALIGN, min(TIGHT_CHUNK_BYTES if tight else CHUNK_BYTES, padded(largest_block_bytes)))


def _on_ring(name: str) -> property:
    """The tier's name for its ring's attribute ``name``, read and set there (the ring's readers and waits are
    the tier's as its users see them)."""
    return property(lambda tier: getattr(tier.staging, name), lambda tier, value: setattr(tier.staging, name, value))


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
    """The disk blocks' placement and cache file, and the staging ring they are read through (:class:`StagingRing`:
    ``ring_size`` chunks of :data:`CHUNK_BYTES`, or of the largest disk block where smaller; ``readers`` threads;
    ``pinner`` page-locks the ring, None: pageable)."""

    def __init__(self, folder: str, ring_size: int = STAGING_CHUNKS, readers: int = 4, pinner=None,
                 expected_bytes: int = 0, tight: bool = False):
        self.folder = folder
        self.tight = tight  # the ring's chunks are the small ones (the host plan says RAM is short)
        self.expected_bytes = expected_bytes
        self._file: Optional[CacheFile] = None  # made at the first block written (none: all from the checkpoint)
        self.regions: Dict[int, tuple] = {}  # block -> (cache-file offset, or None for the checkpoint; nbytes)
        self.extents: Dict[int, List[tuple]] = {}  # checkpoint blocks -> [(path, file offset, nbytes, offset)]
        self._fds: Dict[str, int] = {}  # checkpoint path -> O_RDONLY descriptor
        self.kept: Dict[int, tuple] = {}  # checkpoint blocks -> (layout, [(entry index, RAM tensor)])
        self._largest = 0  # the largest disk block, padded
        self._chunk: Optional[torch.Tensor] = None  # the buffer blocks are written through
        # The allocator and the copy test are looked up in this module at each call, where tests patch them. The
        # ring is handed the tier's maps, never the tier: no cycle keeps a dropped tier's cache file alive until
        # the collector runs.
        self.staging = StagingRing(self.regions, self.extents, self.kept, self._fds, ring_size, readers, pinner,
                                   allocate=lambda nbytes: aligned_buffer(nbytes),
                                   finished=lambda handle, wait: copy_finished(handle, wait=wait))

    ring = _on_ring("chunks")  # the staging chunks: empty until the first read
    ring_bytes = _on_ring("nbytes")
    pinned = _on_ring("pinned")
    bytes_read = _on_ring("bytes_read")
    reads = _on_ring("reads")
    read_seconds = _on_ring("read_seconds")
    stall_seconds = _on_ring("stall_seconds")
    demand_reads = _on_ring("demand_reads")
    settle_reads = _on_ring("settle_reads")
    quiesce = _on_ring("quiesce")
    _start = _on_ring("_start")  # set on the ring, a hook set here wraps the reads the ring starts itself
    _settle = _on_ring("_settle")
    _fill_kept = staticmethod(StagingRing._fill_kept)  # where tests reach it

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
            self._file = self.staging.file = CacheFile(self.folder, self.expected_bytes)
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
        self.staging.drop(index)
        self.regions.pop(index, None)
        self.extents.pop(index, None)
        self.kept.pop(index, None)

    def _reading(self) -> None:
        """Before the ring reads: the file is complete, the write buffer goes (packing is over, and it goes before
        the ring is allocated), and the ring's chunks are sized for the largest disk block."""
        self.finish()
        self._chunk = None
        self.staging.chunk_bytes = _chunk_bytes(self._largest, self.tight)

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Start reads for the disk blocks in ``indices`` (in the order they will be copied), chunk by chunk, while
        the ring has free chunks."""
        if not self.regions:
            return
        self._reading()
        self.staging.read_ahead(indices)

    def source(self, index: int, protect: Sequence[int] = ()) -> DiskSource:
        """Block ``index``'s bytes as its copy reads them (:class:`DiskSource`), its first chunks' reads started
        where the ring has room (before any read ahead of ``protect``, the blocks copied after it)."""
        self._reading()
        self.staging.begin(index)
        return DiskSource(self, index, protect)

    def _copy(self, index: int, protect: Sequence[int], put) -> object:
        """Block ``index`` through the ring (:meth:`StagingRing.copy`): ``put(first byte, bytes, staged bytes, is
        first, is last)`` queues each chunk's copy as its read is done. Returns the last chunk's handle."""
        self._reading()
        return self.staging.copy(index, protect, put)

    def pageable(self, index: int) -> bool:
        """Always: the host stages a disk block's copy (it waits for each chunk's read, and for chunks a copy still
        reads), as a copy from pageable memory, so the manager issues it after the running block is launched."""
        return True

    def copied(self, index: int, handle) -> None:
        """The copy of block ``index`` is queued: each of its chunks kept its own copy's handle as it was queued
        (:meth:`DiskSource.copy_to`), so nothing is left to do."""

    def close(self) -> None:
        """Finish the reads, free the ring, delete the file."""
        self.staging.close()
        self.regions.clear()  # emptied, not replaced: the ring reads these same maps
        self.extents.clear()
        self.kept.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._file is not None:
            self._file.close()
