"""A safetensors checkpoint mapped read-only, and where a tensor's bytes lie in it.

The disk tier can read a streamed block straight from the checkpoint instead of writing a cache file, but only
where the block's weight is byte for byte the file's tensor. That is decided from the tensor's memory alone: a
tensor whose bytes lie inside one of the mappings made here is the file's tensor at ``data_ptr - base``. Any
conversion on the way (a dtype cast, a concatenated key, a LoRA bake into a new tensor) makes a tensor in other
memory, so it is noticed without anyone having to report it.

The file is opened read-only and mapped private (copy-on-write): pages are the page cache's (reclaimable, never
anonymous RAM until written) and a write into a weight in place stays private to the process, never reaching the
file.

Format (safetensors): an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data; offsets count from the data's start.
"""

from __future__ import annotations

import bisect
import json
import math
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["CheckpointFile", "CheckpointError", "TensorInfo", "locate", "drop_cached_pages", "drop_from_page_cache",
           "is_mapped"]

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

MAX_HEADER_BYTES = 100 * 2**20  # the format's own limit


class CheckpointError(ValueError):
    """The file is not a safetensors file this module can map; the message names the file and the fault."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    nbytes: int


class _Mapping(mmap.mmap):
    """An mmap that can be weakly referenced: the registry forgets it when the last tensor over it is gone."""


_LOCK = threading.Lock()
_STARTS: List[int] = []  # sorted base addresses of the live mappings
_ENTRIES: Dict[int, tuple] = {}  # base -> (end, path, weakref to the mapping)


def _register(base: int, end: int, path: str, area: _Mapping) -> None:
    def forget(_ref, base=base):
        with _LOCK:
            if base in _ENTRIES and _ENTRIES[base][2] is _ref:
                del _ENTRIES[base]
                _STARTS.remove(base)
    with _LOCK:
        if base in _ENTRIES:
            _STARTS.remove(base)
        bisect.insort(_STARTS, base)
        _ENTRIES[base] = (end, path, weakref.ref(area, forget))


def parse_header(path: str, head: bytes, size: int) -> Tuple[Dict[str, TensorInfo], Dict[str, str], int]:
    """The tensors and metadata of a safetensors file from its first bytes (``head``: at least the header)."""
    if len(head) < 8:
        raise CheckpointError(f"{path!r} is not a safetensors file: it is shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", head[:8])
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CheckpointError(f"{path!r} is not a safetensors file: its header length {length} does not fit the file")
    try:
        header = json.loads(head[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path!r} is not a safetensors file: its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path!r} is not a safetensors file: its header is not a JSON object")
    data_start = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    tensors: Dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path!r}: tensor {name!r} has an entry this loader cannot read: {entry!r}"
                                  f" ({error!r})") from error
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(f"{path!r}: tensor {name!r} ({entry['dtype']} {list(shape)}) claims bytes "
                                  f"{begin}..{end} of the data, which do not match its size or the file")
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, nbytes)
    return tensors, metadata, data_start


class CheckpointFile:
    """One safetensors file, mapped: ``tensor(name)`` is a zero-copy view of the file's bytes."""

    def __init__(self, path: str):
        self.path = os.path.realpath(path)
        with open(self.path, "rb") as file:  # a file object: binary on every platform, no os.pread needed
            self.size = os.fstat(file.fileno()).st_size
            head = file.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            head += file.read(min(length, MAX_HEADER_BYTES)) if length else b""
            self.tensors, self.metadata, self.data_start = parse_header(self.path, head, self.size)
            # A private (copy-on-write) mapping, writable as torch wants: writes stay in the process. ACCESS_COPY
            # is MAP_PRIVATE on POSIX and FILE_MAP_COPY on Windows.
            self._area = _Mapping(file.fileno(), self.size, access=mmap.ACCESS_COPY)
        probe = torch.frombuffer(self._area, dtype=torch.uint8, count=1)
        self.base = probe.data_ptr()
        del probe
        _register(self.base, self.base + self.size, self.path, self._area)

    def tensor(self, name: str) -> torch.Tensor:
        """The file's tensor ``name`` over the mapping (made in the caller's inference mode)."""
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(self._area, dtype=info.dtype, count=info.nbytes // info.dtype.itemsize,
                                offset=info.offset)
        return flat.view(info.shape)

    def view_at(self, offset: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """A tensor over the file's bytes from ``offset`` (made in the caller's inference mode)."""
        count = math.prod(shape)
        return torch.frombuffer(self._area, dtype=dtype, count=count, offset=offset).view(shape)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self.tensors}


def _find(start: int, nbytes: int):
    """(base, path, mapping ref) of the live mapping holding bytes ``start .. start + nbytes``, or None."""
    with _LOCK:
        position = bisect.bisect_right(_STARTS, start) - 1
        if position < 0:
            return None
        base = _STARTS[position]
        end, path, ref = _ENTRIES[base]
    return (base, path, ref) if start + nbytes <= end else None


def locate(tensor: torch.Tensor) -> Optional[Tuple[str, int, int]]:
    """(file path, file offset, nbytes) when ``tensor``'s bytes are a contiguous range of a mapped checkpoint."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or not tensor.is_contiguous():
        return None
    found = _find(tensor.data_ptr(), nbytes)
    return None if found is None else (found[1], tensor.data_ptr() - found[0], nbytes)


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage lies in a mapped checkpoint (its bytes cost page cache, not anonymous RAM)."""
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    return storage.nbytes() > 0 and _find(storage.data_ptr(), storage.nbytes()) is not None


def drop_cached_pages(tensors) -> None:
    """Give back the pages that reading mapped ``tensors`` brought in: unmap them from this process
    (MADV_DONTNEED: a private file mapping refaults from the file) and drop them from the page cache."""
    spans: Dict[str, List[Tuple[int, int]]] = {}
    page = mmap.PAGESIZE
    for tensor in tensors:
        where = locate(tensor)
        if where is None:
            continue
        path, offset, nbytes = where
        area = _find(tensor.data_ptr(), nbytes)[2]()
        # Only whole pages of this tensor leave the mapping: a page it shares with a neighbour may hold that
        # neighbour's private (written) bytes, which MADV_DONTNEED would throw away.
        inner_first, inner_last = -(-offset // page) * page, (offset + nbytes) // page * page
        if area is not None and inner_last > inner_first:
            try:
                area.madvise(mmap.MADV_DONTNEED, inner_first, inner_last - inner_first)
            except (OSError, ValueError, AttributeError):
                pass
        first = offset // page * page  # the page cache drops only pages no process maps: the wide range is safe
        spans.setdefault(path, []).append((first, -(-(offset + nbytes) // page) * page - first))
    drop_from_page_cache(spans)


def drop_from_page_cache(spans: Dict[str, List[Tuple[int, int]]]) -> None:
    """Drop the file ranges ``spans`` ({path: [(offset, length)]}) from the page cache; pages some process still
    maps stay. Where there is no posix_fadvise (Windows, macOS) the OS keeps them as standby cache."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path, ranges in spans.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for offset, length in ranges:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
