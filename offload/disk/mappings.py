"""Which file a host tensor's bytes are mapped from, and which of a block's bytes the disk tier can read from it.

ComfyUI-GGUF maps the whole ``.gguf`` file read-only (``numpy.memmap``) and its weights are views of that mapping,
so a GGUF block is already on disk, byte for byte: the disk tier can read it from the ``.gguf`` file at each step
instead of writing a cache file first. This module answers "which file, at which offset" from the kernel's own
list of this process's mappings (``/proc/self/maps``), for read-only mappings only: the bytes of such a mapping
are the file's page cache, so they are the file's bytes, and nothing in the process can write them (a write
faults). ComfyUI 0.33+ with dynamic VRAM maps safetensors the same way (comfy-aimdo's ``ModelMMAP``: private and
read-only) and loads the weights as views of it. A writable private mapping may hold pages the process wrote
(copy-on-write), so it is never taken here; the mappings our own loader makes are known without this
(:mod:`.checkpoint_file`).

A file deleted or replaced after it was mapped is not the file at that path any more: the kernel marks such a
mapping "(deleted)", and its inode must still be the path's. (The devices are not compared: on some filesystems,
btrfs among them, the maps line and stat() name different device numbers for one file.)
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import stat
from typing import Dict, List, Optional, Tuple

import torch

from .checkpoint import drop_from_page_cache, locate

__all__ = ["CONVERTED_SHARE_LIMIT", "MappedFiles", "checkpoint_extents"]

MAPS = "/proc/self/maps"
_MADV_DONTNEED = 4  # Linux's value on every architecture Python runs on


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError, TypeError):  # Windows: CDLL(None) is a TypeError
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


class MappedFiles:
    """A snapshot of this process's shared, read-only mappings of regular files (empty where the kernel has no
    ``/proc/self/maps``). Take one per packing pass: mappings made or removed later are not in it."""

    def __init__(self, maps_path: str = MAPS):
        self._starts: List[int] = []
        self.spans: List[Tuple[int, int, str, int]] = []  # (start, end, path, file offset at start)
        self._same_file: Dict[Tuple[str, int], bool] = {}
        try:
            with open(maps_path) as maps:
                lines = maps.read().splitlines()
        except OSError:
            return
        for line in lines:
            span = self._parse(line)
            if span is None:
                continue
            start, end, path, offset = span
            if self.spans and self.spans[-1][1] == start and self.spans[-1][2] == path and (
                    self.spans[-1][3] + (start - self.spans[-1][0]) == offset):
                # The kernel splits one mapping where its pages' advice or locking differs: one span again.
                first = self.spans[-1]
                self.spans[-1] = (first[0], end, path, first[3])
                continue
            self._starts.append(start)
            self.spans.append(span)

    def _parse(self, line: str) -> Optional[Tuple[int, int, str, int]]:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            return None
        addresses, perms, offset, _device, inode, path = fields
        if len(perms) < 4 or perms[1] != "-" or perms[3] not in "sp" or int(inode) == 0 or not path.startswith("/"):
            return None
        if path.endswith(" (deleted)"):
            return None
        if not self._is_this_file(path, int(inode)):
            return None
        start, end = (int(part, 16) for part in addresses.split("-"))
        return start, end, path, int(offset, 16)

    def _is_this_file(self, path: str, inode: int) -> bool:
        key = (path, inode)
        if key not in self._same_file:
            try:
                info = os.stat(path)
            except OSError:
                self._same_file[key] = False
            else:
                self._same_file[key] = stat.S_ISREG(info.st_mode) and info.st_ino == inode
        return self._same_file[key]

    def locate(self, tensor: torch.Tensor) -> Optional[Tuple[str, int, int]]:
        """(file path, file offset, nbytes) when ``tensor``'s bytes are a contiguous range of one read-only file
        mapping of this snapshot, else None."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        nbytes = tensor.numel() * tensor.element_size()
        span = self._span(tensor.data_ptr(), nbytes)
        if span is None:
            return None
        first, _, path, offset = span
        return path, offset + (tensor.data_ptr() - first), nbytes

    def holds_storage(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s whole storage lies in a mapping of this snapshot: its bytes are page cache, and
        letting the tensor go frees no anonymous RAM."""
        if tensor.device.type != "cpu":
            return False
        storage = tensor.untyped_storage()
        return self._span(storage.data_ptr(), storage.nbytes()) is not None

    def _span(self, start: int, nbytes: int) -> Optional[Tuple[int, int, str, int]]:
        position = bisect.bisect_right(self._starts, start) - 1
        if nbytes == 0 or position < 0:
            return None
        span = self.spans[position]
        return span if start + nbytes <= span[1] else None

    def drop_pages(self, tensors) -> None:
        """Give back the pages that reading ``tensors`` (views of a mapping of this snapshot) brought in: unmap
        them from this process and drop them from the page cache. Packing a block into RAM reads it once through
        the mapping; left mapped, those pages stay charged to the process's memory cgroup as active file pages,
        beside the block's new copy. Pages of a shared read-only mapping are the file's: a later read refaults
        them from the file, nothing is lost (a neighbour's bytes in a shared page included)."""
        if not self.spans:  # no mapping of another loader here (or no /proc/self/maps: Windows, macOS)
            return
        madvise = _madvise()
        page = mmap.PAGESIZE
        spans: Dict[str, List[Tuple[int, int]]] = {}
        for tensor in tensors:
            where = self.locate(tensor)
            if where is None:
                continue
            path, offset, nbytes = where
            start = tensor.data_ptr()
            first, last = start // page * page, -(-(start + nbytes) // page) * page
            if madvise is not None:
                madvise(first, last - first, _MADV_DONTNEED)  # a refusal leaves the pages to the kernel
            file_first = offset - (start - first)
            spans.setdefault(path, []).append((file_first, last - first))
        drop_from_page_cache(spans)


# A block is read from the checkpoint when at most this share of its bytes is not the file's (a converted scale
# of a quantized layer, say): those few bytes stay in RAM and are copied into the staging buffer with the reads.
CONVERTED_SHARE_LIMIT = 1 / 16


def checkpoint_extents(layout, sources, mapped_files: Optional[MappedFiles] = None):
    """``(extents, kept)`` for a block read from a mapped checkpoint: extents [(path, file offset, nbytes, offset in
    the layout)] of the entries that are byte for byte a contiguous tensor of the file, kept [(entry index,
    tensor)] for the rest (held in RAM); None when no entry is the file's, or the rest is more than
    :data:`CONVERTED_SHARE_LIMIT` of the block (``sources``: the entries' tensors now). The file is one our loader
    mapped, or one in ``mapped_files`` (another loader's read-only mapping)."""
    extents, kept, kept_bytes = [], [], 0
    for position, (entry, source) in enumerate(zip(layout.entries, sources)):
        where = locate(source)
        if where is None and mapped_files is not None:
            where = mapped_files.locate(source)
        if where is None or where[2] != entry.span_elements * entry.dtype.itemsize or source.dtype != entry.dtype:
            kept.append((position, source))
            kept_bytes += entry.span_elements * entry.dtype.itemsize
        else:
            extents.append((where[0], where[1], where[2], entry.offset))
    if not extents or kept_bytes > layout.nbytes * CONVERTED_SHARE_LIMIT:
        return None
    return extents, kept
