"""What each block's parameters point at: its device copy, its host copy, or empty placeholders.

Blocks keep their parameter objects for life; only their data changes (``param.data``, or a swapped-in
quantized subclass). This module remembers where it last pointed each block, so a move by someone else (a LoRA
bake swapping Parameter objects, a whole-model ``.to()``) is noticed, and caches the views it points them at.

Pointing runs twice per streamed block per step (copied in, released), so it is the host's main cost per block:
the views of each place are made once and cached, a plain weight is one ``param.data =``, a quantized wrapper
weight a swap with a spare object of its own (:class:`~.weights.WrapperPointer`), where the parameters point is
recorded as the views list itself (its pointers are read only when a move by someone else is looked for), and the
inference mode is entered only when the caller's differs from the parameters' kind.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .checks import check_no_shared_parameters
from ..host.packing import BlockLayout, HostStore, block_parameters, params_are_inference
from ..weights import WrapperPointer, point_param_at, wrapper_inner, weight_pointer


class PlacedWeights(list):
    """A cached views list (``BlockLayout.weights`` order), with what the step reads of it at every copy read once:
    each wrapper weight's inner tensors (``inner``, in its ``__tensor_flatten__`` order; None for a plain weight, or
    for a layout without wrappers), and the caller's ``destination`` and ``source`` (the manager's: the buffer's bytes
    the copy writes, and a streamed tail's host bytes it reads)."""

    __slots__ = ("inner", "device", "destination", "source")

    def __init__(self, weights: Sequence[torch.Tensor], wrappers: Sequence[bool]):
        super().__init__(weights)
        self.inner = ([wrapper_inner(w) if wrapper else None for w, wrapper in zip(weights, wrappers)]
                      if any(wrappers) else None)
        devices = {w.device for w, wrapper in zip(weights, wrappers) if wrapper}
        self.device = devices.pop() if len(devices) == 1 else None  # the wrapper weights' device
        self.destination: Optional[torch.Tensor] = None
        self.source: Optional[torch.Tensor] = None  # the host bytes a streamed tail's copy reads (the caller's)


class _Pointing:
    """How to point one block's parameters (for one layout): the parameters in ``layout.weights`` order, and a
    :class:`WrapperPointer` for each wrapper-subclass weight (None for the others, pointed with ``param.data =``)."""

    __slots__ = ("layout", "params", "wrappers", "any_wrapper", "inference", "plain_torch_function")

    def __init__(self, layout: BlockLayout, inference: bool):
        self.layout = layout
        self.params = tuple(weight.param for weight in layout.weights)
        self.wrappers = tuple(WrapperPointer(weight.param) if weight.rebuild is not None else None
                              for weight in layout.weights)
        self.any_wrapper = any(wrapper is not None for wrapper in self.wrappers)
        self.inference = inference
        # Subclass parameters (GGUF, quantized wrappers) run every attribute access and ``.data =`` through
        # ``Tensor.__torch_function__``, which only calls the same function with torch functions off: when none of
        # them overrides it, the pointing runs with torch functions off at once (the same calls, without the dispatch).
        subclasses = {type(param) for param in self.params} - {torch.Tensor, nn.Parameter}
        self.plain_torch_function = bool(subclasses) and all(
            getattr(cls.__torch_function__, "__func__", None) is _DEFAULT_TORCH_FUNCTION for cls in subclasses)

    def point(self, views: Sequence[torch.Tensor]) -> None:
        if self.plain_torch_function:
            with torch._C.DisableTorchFunctionSubclass():
                self._point(views)
        elif not self.any_wrapper and getattr(views, "inner", None) is None:  # plain weights, our plain views
            for param, view in zip(self.params, views):
                param.data = view
        else:
            self._point(views)

    def _point(self, views: Sequence[torch.Tensor]) -> None:
        inner = getattr(views, "inner", None)
        device = views.device if inner is not None else None
        for k, (param, wrapper, view) in enumerate(zip(self.params, self.wrappers, views)):
            if wrapper is None:
                if type(view) is torch.Tensor or not _is_wrapper(view):
                    param.data = view
                else:  # a wrapper where the layout has a plain weight: the generic path says what is wrong
                    point_param_at(param, view)
            else:
                wrapper.point(view, inner[k] if inner is not None else None, device)

    def forget_spares(self) -> None:
        for wrapper in self.wrappers:
            if wrapper is not None:
                wrapper.forget_spares()


_DEFAULT_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__


def _is_wrapper(tensor: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    return is_traceable_wrapper_subclass(tensor)


class BlockParameters:
    """The parameters of ``blocks`` and where they point. Views are cached by (place, block index), place being a
    slot number, ``"resident"``, ``"host"`` or ``"placeholder"``."""

    def __init__(self, blocks: Sequence[nn.Module]):
        self.blocks = blocks
        self.named = [block_parameters(b) for b in blocks]
        check_no_shared_parameters(self.named)
        # What each block's parameters were last pointed at (``layout.weights`` order, which is ``named`` order),
        # to notice outside moves; their pointers are read then, not at every pointing.
        self._pointed: List[Optional[Sequence[torch.Tensor]]] = [None] * len(blocks)
        self._pointing: List[Optional[_Pointing]] = [None] * len(blocks)
        self._placeholders: Dict[tuple, torch.Tensor] = {}
        self._views: Dict[tuple, list] = {}

    def _pointing_for(self, index: int, layout: BlockLayout) -> _Pointing:
        pointing = self._pointing[index]
        if pointing is None or pointing.layout is not layout:
            pointing = self._pointing[index] = _Pointing(layout, params_are_inference(self.named[index]))
        return pointing

    def point_at(self, index: int, layout: BlockLayout, views: Sequence[torch.Tensor]) -> None:
        """Point block ``index``'s parameters (``layout.weights`` order) at ``views``."""
        pointing = self._pointing_for(index, layout)
        # A normal parameter's .data may only be swapped outside inference_mode (and an inference one's inside).
        if torch.is_inference_mode_enabled() == pointing.inference:
            pointing.point(views)
        else:
            with torch.inference_mode(pointing.inference):
                pointing.point(views)
        self._pointed[index] = views

    def point_released(self, index: int, store: HostStore, at_host: bool, inference: bool) -> None:
        """Point a released block at its host copy (``at_host``) or at empty placeholders; ``inference``: the
        parameters' kind (views made in the caller's mode, ComfyUI samples under inference_mode, would not fit)."""
        layout = store.layouts[index]
        if at_host:
            views = self.views(("host", index), lambda: store.weight_views(index), layout, inference)
        else:
            views = self.views(("placeholder", index, inference), lambda: self._placeholders_for(index, store,
                                                                                                 inference),
                               layout, inference)
        self.point_at(index, layout, views)

    def _placeholders_for(self, index: int, store: HostStore, inference: bool) -> list:
        layout = store.layouts[index]
        # A subclass weight (quantized) cannot be an empty placeholder: it points at its host copy.
        host = self.views(("host", index), lambda: store.weight_views(index), layout, inference) \
            if layout.has_subclass_weights else None
        return [self._placeholder(layout.entries[w.parts[0]].dtype, inference) if w.rebuild is None
                else host[i] for i, w in enumerate(layout.weights)]

    def _placeholder(self, dtype: torch.dtype, inference: bool) -> torch.Tensor:
        key = (dtype, inference)
        placeholder = self._placeholders.get(key)
        if placeholder is None:
            placeholder = self._placeholders[key] = torch.empty(0, dtype=dtype, device="cpu")
        return placeholder

    def views(self, key: tuple, make: Callable[[], list], layout: Optional[BlockLayout] = None,
              inference: Optional[bool] = None) -> list:
        """The cached views under ``key``, made by ``make()`` the first time (in the parameters' inference mode,
        ``inference``); with ``layout``, a :class:`PlacedWeights`."""
        views = self._views.get(key)
        if views is None:
            if inference is None or torch.is_inference_mode_enabled() == inference:
                made = make()
            else:
                with torch.inference_mode(inference):
                    made = make()
            if layout is not None:
                made = PlacedWeights(made, [w.rebuild is not None for w in layout.weights])
            views = self._views[key] = made
        return views

    def drop_views(self, index: int) -> None:
        """Forget block ``index``'s cached views."""
        for key in [k for k in self._views if k[1] == index]:
            del self._views[key]
        self._forget_spares()

    def drop_device_views(self, index: Optional[int] = None) -> None:
        """Forget the views of device memory that is freed: block ``index``'s resident buffer, or (None) every
        slot's (the ring is dropped)."""
        if index is not None:
            self._views.pop(("resident", index), None)
        else:
            for key in [k for k in self._views if isinstance(k[0], int)]:
                del self._views[key]
        self._forget_spares()

    def clear_views(self) -> None:
        self._views = {}
        self._forget_spares()

    def _forget_spares(self) -> None:
        """The wrapper weights' spare objects may view memory that is being freed: let them go."""
        for pointing in self._pointing:
            if pointing is not None:
                pointing.forget_spares()

    def repacked(self, index: int, named) -> None:
        """Block ``index`` was packed from these (name, parameter) pairs: its old views describe old buffers."""
        self.named[index] = named
        self.drop_views(index)

    def is_ours(self, index: int) -> bool:
        """Whether block ``index``'s parameters are the objects we know and point where we pointed them."""
        pointed = self._pointed[index]
        named = block_parameters(self.blocks[index])
        if pointed is None or len(named) != len(self.named[index]) or len(pointed) != len(named):
            return False
        return all(param is known and weight_pointer(param) == weight_pointer(view)
                   for (_, param), (_, known), view in zip(named, self.named[index], pointed))

    def let_go(self) -> None:
        """The blocks are given back: forget where they point, and the placeholders."""
        self._forget_spares()
        self._pointed = [None] * len(self.blocks)
        self._pointing = [None] * len(self.blocks)
        self._placeholders = {}
