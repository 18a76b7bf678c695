"""Weights that are tensor subclasses (quantized checkpoints): which plain tensors hold their bytes, and
how to put the same kind of weight back together over copies of those tensors.

Three kinds of weight are understood:

- plain tensors (and ``nn.Parameter``): the tensor itself is the data;
- *storage subclasses*, whose bytes live in the tensor's own storage and whose metadata lives in Python
  attributes (ComfyUI-GGUF's ``GGMLTensor``: quantized bytes plus ``tensor_type`` / ``tensor_shape`` /
  ``patches``): swapping ``param.data`` keeps the Python object, so the metadata stays;
- *wrapper subclasses* that implement PyTorch's flatten protocol (``__tensor_flatten__`` /
  ``__tensor_unflatten__``; ComfyUI's ``QuantizedTensor`` on 0.3.75 and, through comfy-kitchen, 0.14.1): the
  inner tensors (quantized data, scales) are stored, and the subclass is rebuilt over their copies with the same
  context (layout, non-tensor parameters), then swapped into the Parameter object with
  ``torch.utils.swap_tensors`` (what ``nn.Module._apply`` does for such subclasses), so the Parameter keeps its
  identity and ComfyUI's ops see the type and metadata they loaded.

Anything else is refused with :class:`UnsupportedWeightError`, naming the type: copying a subclass whose state
the store cannot see would silently lose it (or dequantize it).
"""

from __future__ import annotations

import copyreg
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "UnsupportedWeightError",
    "WeightParts",
    "weight_parts",
    "register_storage_subclass",
    "point_param_at",
    "WrapperPointer",
    "wrapper_inner",
    "weight_pointer",
    "is_wrapper_weight",
    "weight_nbytes",
    "weight_format",
    "cast_nbytes",
]

# Subclasses whose whole state is their storage plus Python attributes, by class name (the defining pack is not
# importable from here). ComfyUI-GGUF: ``ops.GGMLTensor``.
_STORAGE_SUBCLASS_NAMES = {"GGMLTensor"}

RebuildFn = Callable[[Dict[str, torch.Tensor]], torch.Tensor]


class UnsupportedWeightError(TypeError):
    """A weight whose tensor type the host store cannot copy without losing part of it."""


def register_storage_subclass(cls_or_name) -> None:
    """Declare a tensor subclass whose bytes are its own storage and whose metadata are Python attributes."""
    _STORAGE_SUBCLASS_NAMES.add(cls_or_name if isinstance(cls_or_name, str) else cls_or_name.__name__)


@dataclass(frozen=True)
class WeightParts:
    """The plain tensors that make up one weight, and how to rebuild the weight from copies of them.

    ``tensors`` maps part names ("" for a weight that is its own data) to plain tensors; ``rebuild`` is None when
    the weight is pointed at its single part with ``param.data = part`` (plain tensors, storage subclasses).
    """
    tensors: Tuple[Tuple[str, torch.Tensor], ...]
    rebuild: Optional[RebuildFn] = None


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a plain tensor object (a subclass's ``shape`` may not be its storage's shape)."""
    with torch.no_grad():
        return tensor.detach().as_subclass(torch.Tensor)


def _is_storage_subclass(tensor: torch.Tensor) -> bool:
    return any(cls.__name__ in _STORAGE_SUBCLASS_NAMES for cls in type(tensor).__mro__)


def weight_parts(name: str, tensor: torch.Tensor) -> WeightParts:
    """Split ``tensor`` (a block parameter named ``name``) into plain parts; refuse types it cannot rebuild."""
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return WeightParts((("", tensor.data),))
    if is_traceable_wrapper_subclass(tensor):
        parts: List[Tuple[str, torch.Tensor]] = []
        rebuild = _flatten(name, tensor, "", parts)
        return WeightParts(tuple(parts), rebuild)
    if _is_storage_subclass(tensor):
        return WeightParts((("", _plain(tensor)),))
    kind = type(tensor)
    raise UnsupportedWeightError(
        f"[layerwise-offload] parameter {name!r} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass the "
        f"offload host store does not know how to copy without losing its state. Supported: plain tensors, "
        f"subclasses with __tensor_flatten__/__tensor_unflatten__ (ComfyUI's QuantizedTensor) and ComfyUI-GGUF's "
        f"GGMLTensor. Run this model without the Layerwise Offload node, or load it unquantized")


def _flatten(name: str, tensor: torch.Tensor, prefix: str, parts: List[Tuple[str, torch.Tensor]]) -> RebuildFn:
    """Collect the plain leaves of a (possibly nested) wrapper subclass into ``parts``; return its rebuilder."""
    inner_names, ctx = tensor.__tensor_flatten__()
    cls = type(tensor)
    outer_size, outer_stride = tuple(tensor.size()), tuple(tensor.stride())
    children: Dict[str, Optional[RebuildFn]] = {}
    for inner_name in inner_names:
        inner = getattr(tensor, inner_name)
        path = f"{prefix}{inner_name}"
        if is_traceable_wrapper_subclass(inner):
            children[inner_name] = _flatten(name, inner, path + ".", parts)
        elif type(inner) in (torch.Tensor, nn.Parameter):
            children[inner_name] = None
            parts.append((path, inner.data))
        else:
            raise UnsupportedWeightError(
                f"[layerwise-offload] parameter {name!r} ({cls.__qualname__}) holds {inner_name!r} as a "
                f"{type(inner).__qualname__}, which the offload host store cannot copy; load the model unquantized")

    def rebuild(views: Dict[str, torch.Tensor]) -> torch.Tensor:
        inner = {}
        for inner_name, child in children.items():
            path = f"{prefix}{inner_name}"
            inner[inner_name] = views[path] if child is None else child(views)
        return cls.__tensor_unflatten__(inner, ctx, outer_size, outer_stride)

    return rebuild


def is_wrapper_weight(tensor: torch.Tensor) -> bool:
    return is_traceable_wrapper_subclass(tensor)


def point_param_at(param: nn.Parameter, weight: torch.Tensor) -> None:
    """Make ``param`` hold ``weight`` (a plain view, or a rebuilt wrapper subclass), keeping the object.

    A wrapper subclass cannot take new data through ``param.data =`` (its metadata are Python attributes and its
    device is fixed at construction), so its contents are swapped in whole, as ``nn.Module._apply`` does.
    """
    if is_traceable_wrapper_subclass(weight):
        torch.utils.swap_tensors(param, _fresh_like(param, weight))
    else:
        param.data = weight


def _fresh_like(param: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A new object over ``weight``'s own inner tensors, with ``param``'s plain attributes (``_is_param``).

    Not ``nn.Parameter(weight)``: that detaches, and a subclass's detach may clone its scales on the compute
    stream, reading a device buffer whose copy is still in flight on the copy stream. ``swap_tensors`` trades
    contents, so the object handed over must be a throwaway, never a cached one."""
    inner_names, ctx = weight.__tensor_flatten__()
    fresh = type(weight).__tensor_unflatten__({name: getattr(weight, name) for name in inner_names}, ctx,
                                              weight.size(), weight.stride())
    for key, value in vars(param).items():
        if key not in vars(fresh) and not isinstance(value, torch.Tensor):
            setattr(fresh, key, value)
    return fresh


def wrapper_inner(weight: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """A wrapper weight's inner tensors in its ``__tensor_flatten__`` order, when each is a plain tensor (None for
    nested wrappers: :class:`WrapperPointer` then takes the generic path)."""
    inner_names, _ = weight.__tensor_flatten__()
    inner = [getattr(weight, name) for name in inner_names]
    return inner if all(type(t) is torch.Tensor for t in inner) else None


_SLOTLESS: Dict[type, bool] = {}


def _slotless(cls: type) -> bool:
    known = _SLOTLESS.get(cls)
    if known is None:
        known = _SLOTLESS[cls] = not copyreg._slotnames(cls)
    return known


class WrapperPointer:
    """Points one wrapper-subclass parameter (a quantized weight) at weights of its kind, many times, cheaply.

    :func:`point_param_at` builds a throwaway object over the target's inner tensors and swaps it in with
    ``torch.utils.swap_tensors``, twice per streamed block per step: costly at every weight. Here the parameter is
    given, once, contents of its own: an object built by the class's ``__tensor_unflatten__`` over *aliases* of the
    target's inner tensors (views nobody else holds), swapped in whole like :func:`point_param_at` does. From then
    on pointing it elsewhere re-points those aliases (``.data =``: no kernel, no copy) and, when the device changes,
    trades the parameter's C++ tensor (a wrapper's holds only its size, dtype and device) with a *donor* of the
    target's device kept for that (``torch._C._swap_tensor_impl``, what ``swap_tensors`` does under its checks; the
    parameter's ``__dict__``, its contents and own attributes, stays). The parameter object never changes, and its
    contents always describe the target's bytes as the class itself built them (the context is the one the layout
    recorded, the same for every place). Anything unusual (nested wrappers, slots, a class change, a C++ tensor
    someone else holds) takes :func:`point_param_at`'s path.
    """

    __slots__ = ("param", "_aliases", "_device", "_donors")

    def __init__(self, param: torch.Tensor):
        self.param = param
        self._aliases: Optional[List[torch.Tensor]] = None  # the parameter's inner tensors, ours alone
        self._device: Optional[torch.device] = None  # the device of the parameter's C++ tensor, while ours
        self._donors: Dict[torch.device, torch.Tensor] = {}  # per device: an object whose C++ tensor is the swap's

    def forget_spares(self) -> None:
        self._donors = {}

    def point(self, weight: torch.Tensor, inner: Optional[Sequence[torch.Tensor]] = None,
              device: Optional[torch.device] = None) -> None:
        """Make the parameter hold ``weight`` (a wrapper rebuilt over views); ``inner``: its inner tensors
        (:func:`wrapper_inner`, read once per cached views list), ``device``: its device (None: read them now)."""
        param, aliases = self.param, self._aliases
        if inner is None:
            inner = wrapper_inner(weight) if is_traceable_wrapper_subclass(weight) else None
        if device is None:
            device = weight.device
        if aliases is None or inner is None or len(inner) != len(aliases) or type(weight) is not type(param):
            self._install(weight, inner, device)
            return
        if device != self._device:
            donor = self._donors.pop(device, None)
            if donor is None:
                donor = self._donor(weight)
            if param._use_count() != 1 or donor._use_count() != 1:  # autograd holds it: the checked path
                self._generic(weight)
                return
            torch._C._swap_tensor_impl(param, donor)
            self._donors[self._device] = donor
            self._device = device
        try:
            for alias, target in zip(aliases, inner):
                alias.data = target
        except RuntimeError:  # a tensor type .data cannot take (not a dense device): the checked path
            self._generic(weight)

    def _install(self, weight: torch.Tensor, inner, device) -> None:
        """Give the parameter contents of its own over ``weight``'s inner tensors (swapped in whole, once)."""
        cls = type(weight)
        if inner is None or type(self.param) is not cls or not _slotless(cls):
            self._generic(weight)
            return
        inner_names, ctx = weight.__tensor_flatten__()
        own = cls.__tensor_unflatten__({name: getattr(weight, name).detach() for name in inner_names}, ctx,
                                       weight.size(), weight.stride())
        own_names, _ = own.__tensor_flatten__()  # some classes set attributes here (their inner tensors)
        aliases = [getattr(own, name) for name in own_names]
        if len(aliases) != len(inner) or not all(type(t) is torch.Tensor for t in aliases):
            self._generic(weight)
            return
        for key, value in vars(self.param).items():  # the parameter's own attributes (``_is_param``) stay
            if key not in vars(own) and not isinstance(value, torch.Tensor):
                setattr(own, key, value)
        torch.utils.swap_tensors(self.param, own)
        self._aliases, self._device = aliases, device

    def _donor(self, weight: torch.Tensor) -> torch.Tensor:
        """An object of ``weight``'s class with a C++ tensor like its (device, size, dtype), holding nothing else."""
        inner_names, ctx = weight.__tensor_flatten__()
        donor = type(weight).__tensor_unflatten__({name: getattr(weight, name).detach() for name in inner_names}, ctx,
                                                  weight.size(), weight.stride())
        vars(donor).clear()  # only its C++ tensor is used: keep no view of the target's memory alive
        return donor

    def _generic(self, weight: torch.Tensor) -> None:
        point_param_at(self.param, weight)
        self._aliases = self._device = None  # the parameter shares its inner tensors with ``weight`` now


def weight_pointer(tensor: torch.Tensor) -> int:
    """The address of a weight's first byte: its own storage, or its first inner tensor's for a wrapper."""
    while is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner_names[0])
    return tensor.data_ptr()


def weight_nbytes(tensor: torch.Tensor) -> int:
    """The bytes a weight really holds: its parts' for a wrapper subclass (whose own dtype and shape may be the
    dequantized ones), its storage's otherwise (a GGUF weight's ``shape`` is the logical one; ``numel`` is not)."""
    if is_traceable_wrapper_subclass(tensor):
        inner_names, _ = tensor.__tensor_flatten__()
        return sum(weight_nbytes(getattr(tensor, name)) for name in inner_names)
    return tensor.numel() * tensor.element_size()


def _logical_numel(tensor: torch.Tensor) -> int:
    """The elements the weight stands for once dequantized (a GGUF weight carries them as ``tensor_shape``)."""
    shape = getattr(tensor, "tensor_shape", None)
    if shape is None:
        return tensor.numel()
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _is_narrow(tensor: torch.Tensor) -> bool:
    """Stored in fewer bits than any dtype a DiT computes in: fp8, or a quantized subclass."""
    return (is_traceable_wrapper_subclass(tensor) or _is_storage_subclass(tensor)
            or (tensor.dtype.is_floating_point and tensor.element_size() == 1))


def weight_format(blocks: Sequence[nn.Module]) -> str:
    """What the blocks' weights are stored as, in the timing model's words (``offload/timing/costs.py``'s host time per streamed
    block): ``gguf`` (ComfyUI-GGUF's storage subclass), ``quantized`` (a flatten-protocol subclass: ComfyUI's
    QuantizedTensor), ``fp8`` (plain fp8 tensors) or ``bf16`` (anything else: 16- or 32-bit floats)."""
    found = set()
    for block in blocks:
        for param in block.parameters():
            if _is_storage_subclass(param):
                found.add("gguf")
            elif is_traceable_wrapper_subclass(param):
                found.add("quantized")
            elif param.dtype.is_floating_point and param.element_size() == 1:
                found.add("fp8")
    for kind in ("gguf", "quantized", "fp8"):  # the costliest to re-point first
        if kind in found:
            return kind
    return "bf16"


def cast_nbytes(block: nn.Module, compute_itemsize: int) -> int:
    """Device-memory bytes one forward of ``block`` moves to cast or dequantise its narrow weights (fp8, quantized)
    to the compute dtype: each one read as stored and written at ``compute_itemsize`` bytes an element."""
    return sum(weight_nbytes(param) + _logical_numel(param) * compute_itemsize
               for param in block.parameters() if _is_narrow(param))
