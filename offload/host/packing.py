"""Packing a block's parameters into one flat byte buffer, and viewing them back out.

One buffer per block means one host-to-device copy per block, whatever its mix of dtypes.
Each tensor starts at an aligned offset, so every view is a plain reinterpretation of bytes
(``view(dtype)``) with the parameter's own strides. The largest weights come first, a weight's parts together.

A quantized weight that is a tensor subclass is stored as its plain parts (quantized data, scales; see
``tensor_subclass``) and rebuilt as the same subclass over the views, so what streams is the packed bytes.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..formatting import format_bytes
from ..memory.pinning import Pinner, PinLedger
from ..schedule import tail_within
from ..weights import RebuildFn, weight_parts

log = logging.getLogger("layerwise_offload")

# cuBLASLt picks its kernel from the operands' pointer alignment (up to 256 bytes), and a full load gives
# 512-aligned weights: an entry off 256 could compute other bits than the full load it must equal.
ALIGNMENT_BYTES = 256
# cudaHostRegister locks whole pages: a buffer that shared a page with a neighbour could be refused as
# "already registered", or unlock the neighbour's page with its own.
PAGE_BYTES = mmap.PAGESIZE
# Every entry starts on a page of its own. A released block's parameters view the store, and ComfyUI run without the
# node page-locks each weight it leaves in RAM on its own: a weight starting on a page another weight locked first
# is refused as "already registered", and ComfyUI 0.3.75 leaves that error set for its next CUDA call to raise
# (bench/results/gpu/README.md). A page is a multiple of ALIGNMENT_BYTES, so cuBLASLt's holds too.
ENTRY_ALIGNMENT_BYTES = max(ALIGNMENT_BYTES, PAGE_BYTES)


@dataclass(frozen=True)
class ParamEntry:
    """One plain tensor in the block's buffer: a parameter's data, or one part of a subclass weight."""
    name: str  # the parameter's name, plus ":<part>" for a part of a subclass weight
    param: nn.Parameter
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the block's buffer
    span_elements: int  # elements covered by the strided view, holes included
    part: str = ""  # the part's name inside a subclass weight


@dataclass(frozen=True)
class WeightEntry:
    """One parameter of the block: which entries hold it, and how to rebuild it when it is a subclass."""
    param: nn.Parameter
    parts: Tuple[int, ...]  # indices into BlockLayout.entries
    rebuild: Optional[RebuildFn] = None  # None: the parameter's data is its single entry's view


@dataclass(frozen=True)
class BlockLayout:
    entries: Tuple[ParamEntry, ...]
    nbytes: int
    weights: Tuple[WeightEntry, ...] = ()

    @property
    def has_subclass_weights(self) -> bool:
        return any(weight.rebuild is not None for weight in self.weights)

    def views(self, buffer: torch.Tensor, tail: Optional[torch.Tensor] = None, split: int = 0) -> List[torch.Tensor]:
        """Typed, strided views of every entry inside ``buffer`` (a uint8 tensor); with ``tail``, the entries from
        byte ``split`` on view ``tail`` instead (its first byte is the block's byte ``split``: a streamed block's
        tail, copied into a slot, while the entries before stay in its resident head)."""
        views = []
        for entry in self.entries:
            nbytes = entry.span_elements * _itemsize(entry.dtype)
            if tail is not None and entry.offset >= split:
                typed = tail.narrow(0, entry.offset - split, nbytes).view(entry.dtype)
            else:
                typed = buffer.narrow(0, entry.offset, nbytes).view(entry.dtype)
            views.append(typed.as_strided(entry.shape, entry.stride))
        return views

    @cached_property
    def tail_sizes(self) -> Tuple[int, ...]:
        """The sizes the block's streamed tail can have, ascending, the whole block last: the buffer's suffixes
        that begin at an entry and leave no weight with parts on both sides (a weight is patched and rebuilt
        whole). Its entries keep their 256-byte alignment inside a tail buffer, as in the whole one."""
        first_part = [min(weight.parts) for weight in self.weights]
        last_part = [max(weight.parts) for weight in self.weights]
        starts = []
        for k, entry in enumerate(self.entries):
            if k and not any(first < k <= last for first, last in zip(first_part, last_part)):
                starts.append(entry.offset)
        return tuple(sorted({self.nbytes - start for start in starts} | {self.nbytes}))

    def tail_bytes(self, cap: int) -> int:
        """The tail a streamed block streams under a cap of ``cap`` bytes (0: the whole block): the largest
        :attr:`tail_sizes` within it, at least the smallest one."""
        return tail_within(self.tail_sizes, cap)

    def head_weight_views(self, head: torch.Tensor, split: int) -> List[Optional[torch.Tensor]]:
        """The weights (``weights`` order) whose bytes lie before byte ``split``, viewed in ``head``; None for
        the others (the tail's)."""
        in_tail = self.weights_in_tail(split)
        weights = []
        for weight, tail in zip(self.weights, in_tail):
            if tail:
                weights.append(None)
                continue
            views = {}
            for i in weight.parts:
                entry = self.entries[i]
                typed = head.narrow(0, entry.offset, entry.span_elements * _itemsize(entry.dtype)).view(entry.dtype)
                views[i] = typed.as_strided(entry.shape, entry.stride)
            weights.append(views[weight.parts[0]] if weight.rebuild is None
                           else weight.rebuild({self.entries[i].part: views[i] for i in weight.parts}))
        return weights

    def weights_in_tail(self, split: int) -> Tuple[bool, ...]:
        """Per weight (``weights`` order), whether its bytes lie from byte ``split`` on."""
        return tuple(self.entries[weight.parts[0]].offset >= split for weight in self.weights)

    def weight_views(self, buffer: torch.Tensor, tail: Optional[torch.Tensor] = None,
                     split: int = 0) -> List[torch.Tensor]:
        """What each parameter (``weights`` order) should hold to live in ``buffer`` (and ``tail`` from byte
        ``split`` on, see :meth:`views`): a plain view, or its subclass rebuilt over the views of its parts."""
        return self.weights_from(self.views(buffer, tail, split))

    def weights_from(self, views: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        weights = []
        for weight in self.weights:
            if weight.rebuild is None:
                weights.append(views[weight.parts[0]])
            else:
                weights.append(weight.rebuild({self.entries[i].part: views[i] for i in weight.parts}))
        return weights


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _align(value: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return (value + alignment - 1) // alignment * alignment


def _kept_stride(tensor: torch.Tensor) -> Tuple[Tuple[int, ...], int]:
    """The stride to store ``tensor`` with, and the elements that stride spans.

    A dense layout (contiguous or a permutation of it, e.g. a transposed weight) is kept as it is;
    anything overlapping or with gaps is stored contiguous, since copying into it is undefined.
    """
    shape = tuple(tensor.size())  # size(), not shape: a subclass may report a logical shape (GGUF)
    numel = tensor.numel()
    if numel and _is_dense_permutation(shape, tuple(tensor.stride())):
        return tuple(tensor.stride()), numel
    return _contiguous_stride(shape), numel


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _is_dense_permutation(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for size, step in sorted((p for p in zip(shape, stride) if p[0] != 1), key=lambda p: p[1]):
        if step != expected:
            return False
        expected *= size
    return True


def params_are_inference(named_params: Sequence[Tuple[str, nn.Parameter]]) -> bool:
    """Whether a block's parameters are inference tensors (then their data is swapped under inference_mode)."""
    return bool(named_params) and named_params[0][1].is_inference()


def block_parameters(block: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    return list(block.named_parameters(recurse=True))


def plan_layout(named_params: Sequence[Tuple[str, nn.Parameter]]) -> BlockLayout:
    # (parameter index, part name, plain tensor) for every tensor that holds bytes of the block
    pieces: List[Tuple[int, str, torch.Tensor]] = []
    rebuilds = []
    for index, (name, param) in enumerate(named_params):
        parts = weight_parts(name, param)
        rebuilds.append(parts.rebuild)
        pieces.extend((index, part, tensor) for part, tensor in parts.tensors)
    # Every entry starts on ENTRY_ALIGNMENT_BYTES, whatever its dtype. A weight's parts (a quantized weight's data and scale)
    # sit side by side, and the largest weights come first: a streamed tail (a suffix of the buffer, see tail_sizes)
    # may begin at any weight and grows by the smallest steps.
    weight_bytes: Dict[int, int] = {}
    for index, _, tensor in pieces:
        weight_bytes[index] = weight_bytes.get(index, 0) + tensor.numel() * _itemsize(tensor.dtype)
    placed: Dict[int, ParamEntry] = {}
    offset = 0
    for position in sorted(range(len(pieces)), key=lambda p: (-weight_bytes[pieces[p][0]], pieces[p][0])):
        index, part, tensor = pieces[position]
        name, param = named_params[index]
        stride, span = _kept_stride(tensor)
        offset = _align(offset, ENTRY_ALIGNMENT_BYTES)
        placed[position] = ParamEntry(f"{name}:{part}" if part else name, param, tuple(tensor.size()), stride,
                                      tensor.dtype, offset, span, part)
        offset += span * _itemsize(tensor.dtype)
    order = sorted(placed, key=lambda p: placed[p].offset)
    entries = tuple(placed[p] for p in order)
    where = {p: i for i, p in enumerate(order)}
    weights = tuple(
        WeightEntry(param, tuple(where[p] for p, piece in enumerate(pieces) if piece[0] == index), rebuilds[index])
        for index, (_, param) in enumerate(named_params))
    return BlockLayout(entries, _align(offset, ENTRY_ALIGNMENT_BYTES), weights)


def allocate_host_buffer(nbytes: int) -> torch.Tensor:
    """A pageable uint8 host buffer of exactly ``nbytes`` that owns every page it touches, its storage starting on
    the first: torch's ``is_pinned()`` asks about a storage's first byte, so a view of a buffer whose pages are
    page-locked reads as pinned, and ComfyUI, which page-locks the weights it leaves in RAM unless they read as
    pinned, does not try again what is locked (CUDA would refuse it as "already registered"). Anonymous pages of their
    own, returned to the OS when the buffer is freed; page-locking is the store's pin ledger's job."""
    pages = mmap.mmap(-1, _align(max(nbytes, 1), PAGE_BYTES))
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes]


def _packed_sources(layout: BlockLayout) -> List[torch.Tensor]:
    """The plain tensors whose bytes the entries store, read from the parameters now (the layout keeps no
    reference to them, so packing can free ComfyUI's copy). Never a subclass: its copy_ may dequantize or recurse."""
    sources: List[Optional[torch.Tensor]] = [None] * len(layout.entries)
    for weight in layout.weights:
        name = layout.entries[weight.parts[0]].name.split(":", 1)[0]
        parts = dict(weight_parts(name, weight.param).tensors)
        for i in weight.parts:
            sources[i] = parts[layout.entries[i].part]
    return sources


class HostStore:
    """The authoritative host copy of every managed block's parameters."""

    def __init__(self, layouts: Sequence[BlockLayout], pinner: Optional[Pinner] = None):
        self.layouts = list(layouts)
        self.buffers: List[Optional[torch.Tensor]] = [None] * len(layouts)
        # Blocks whose bytes stay in the mapped checkpoint (the disk tier reads them from there): the file's own
        # tensors are their host views, one per entry; their buffer is an empty stand-in.
        self.mapped: Dict[int, List[torch.Tensor]] = {}
        self.ledger = PinLedger(pinner)
        self.ledger.watch(self)  # a store dropped without clear() still unlocks its buffers
        self._warned_pin = False  # one warning per store; every block is still asked for on its own

    @property
    def built(self) -> bool:
        return all(buffer is not None for buffer in self.buffers)

    def pack_block(self, index: int, pin: bool) -> None:
        """Copy a block's current parameter data into a fresh host buffer.

        Writes only into the store's own memory: the source tensors (which may be ComfyUI's
        CPU weights, or backups pointing at them) are read, never modified.
        """
        layout = self.layouts[index]
        self._drop_buffer(index)
        buffer = allocate_host_buffer(layout.nbytes)
        with torch.no_grad():
            for view, source in zip(layout.views(buffer), _packed_sources(layout)):
                view.copy_(source)
        self.buffers[index] = buffer
        self.set_pinned(index, pin)

    def keep_mapped(self, index: int, tensors: Sequence[torch.Tensor]) -> None:
        """Block ``index``'s host copy is the checkpoint's mapped ``tensors`` (one per entry, in entry order)."""
        self._drop_buffer(index)
        self.mapped[index] = list(tensors)
        self.buffers[index] = torch.empty(0, dtype=torch.uint8)

    def views(self, index: int) -> List[torch.Tensor]:
        if index in self.mapped:
            return list(self.mapped[index])
        buffer = self.buffers[index]
        if buffer is None:
            raise RuntimeError(f"block {index} has no host copy yet")
        return self.layouts[index].views(buffer)

    def weight_views(self, index: int) -> List[torch.Tensor]:
        """Each parameter's weight over the host copy (subclasses rebuilt), in ``layouts[index].weights`` order."""
        return self.layouts[index].weights_from(self.views(index))

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    @property
    def pinned(self) -> List[bool]:
        return [b is not None and self.ledger.is_pinned(b) for b in self.buffers]

    def is_pinned(self, index: int) -> bool:
        buffer = self.buffers[index]
        return buffer is not None and self.ledger.is_pinned(buffer)

    def pinned_nbytes(self) -> int:
        return self.ledger.bytes_pinned

    def set_pinned(self, index: int, pin: bool) -> bool:
        """Page-lock block ``index``'s buffer in place, or unlock it; returns whether it is locked.

        Call with the copy stream quiet (no copy from this buffer in flight). A refusal leaves this block
        pageable and asks again for the next one: one refused range (a neighbour's page, a transient limit)
        must not leave the whole model on slow pageable copies. It warns once per store.
        """
        buffer = self.buffers[index]
        if buffer is None:
            return False
        if not pin:
            self.ledger.unpin(buffer)
            return False
        if self.ledger.is_pinned(buffer):
            return True
        pinned = self.ledger.pin(buffer)
        if not pinned and not self._warned_pin:
            self._warned_pin = True
            reason = "refused" if self.ledger.pinner is not None else "no CUDA runtime to page-lock with"
            log.warning("[layerwise-offload] could not pin %s of host memory (%s); each block that is "
                        "refused stays pageable (its copies are slower), the others are still pinned",
                        format_bytes(buffer.numel()), reason)
        return pinned

    def _drop_buffer(self, index: int) -> None:
        buffer = self.buffers[index]
        self.mapped.pop(index, None)
        if buffer is not None:
            self.ledger.unpin(buffer)
            self.buffers[index] = None

    def clear(self) -> None:
        """Unlock and drop every buffer (the memory returns once no parameter views it any more)."""
        self.ledger.unpin_all()
        self.buffers = [None] * len(self.layouts)
        self.mapped = {}
