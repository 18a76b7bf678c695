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

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "UnsupportedWeightError",
    "WeightParts",
    "weight_parts",
    "register_storage_subclass",
    "point_param_at",
    "weight_pointer",
    "is_wrapper_weight",
    "weight_nbytes",
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
