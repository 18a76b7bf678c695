"""What each block's parameters point at: its device copy, its host copy, or empty placeholders.

Blocks keep their parameter objects for life; only their data changes (``param.data``, or a swapped-in
quantized subclass). This module remembers where it last pointed each block, so a move by someone else (a LoRA
bake swapping Parameter objects, a whole-model ``.to()``) is noticed, and caches the views it points them at.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .checks import check_no_shared_parameters
from ..host.packing import BlockLayout, HostStore, block_parameters, params_are_inference
from .weights import point_param_at, weight_pointer


class BlockParameters:
    """The parameters of ``blocks`` and where they point. Views are cached by (place, block index), place being a
    slot number, ``"resident"`` or ``"host"``."""

    def __init__(self, blocks: Sequence[nn.Module]):
        self.blocks = blocks
        self.named = [block_parameters(b) for b in blocks]
        check_no_shared_parameters(self.named)
        # Where each block's parameters point now (in ``named`` order), to notice outside moves.
        self._expected: List[Optional[List[int]]] = [None] * len(blocks)
        self._placeholders: Dict[tuple, torch.Tensor] = {}
        self._views: Dict[tuple, list] = {}

    def point_at(self, index: int, layout: BlockLayout, views: Sequence[torch.Tensor]) -> None:
        """Point block ``index``'s parameters (``layout.weights`` order) at ``views``."""
        # A normal parameter's .data may only be swapped outside inference_mode.
        with torch.inference_mode(params_are_inference(self.named[index])):
            for weight, view in zip(layout.weights, views):
                point_param_at(weight.param, view)
        self._expected[index] = [weight_pointer(param) for _, param in self.named[index]]

    def point_released(self, index: int, store: HostStore, at_host: bool, inference: bool) -> None:
        """Point a released block at its host copy (``at_host``) or at empty placeholders; ``inference``: the
        parameters' kind (views made in the caller's mode, ComfyUI samples under inference_mode, would not fit)."""
        with torch.inference_mode(inference):
            layout = store.layouts[index]
            if at_host:
                views = self.views(("host", index), lambda: store.weight_views(index))
            else:
                # A subclass weight (quantized) cannot be an empty placeholder: it points at its host copy.
                host = store.weight_views(index) if layout.has_subclass_weights else None
                views = [self._placeholder(layout.entries[w.parts[0]].dtype, inference) if w.rebuild is None
                         else host[i] for i, w in enumerate(layout.weights)]
        self.point_at(index, layout, views)

    def _placeholder(self, dtype: torch.dtype, inference: bool) -> torch.Tensor:
        key = (dtype, inference)
        placeholder = self._placeholders.get(key)
        if placeholder is None:
            placeholder = self._placeholders[key] = torch.empty(0, dtype=dtype, device="cpu")
        return placeholder

    def views(self, key: tuple, make: Callable[[], list]) -> list:
        """The cached views under ``key``, made by ``make()`` the first time."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = make()
        return views

    def drop_views(self, index: int) -> None:
        """Forget block ``index``'s cached views."""
        for key in [k for k in self._views if k[1] == index]:
            del self._views[key]

    def drop_device_views(self, index: Optional[int] = None) -> None:
        """Forget the views of device memory that is freed: block ``index``'s resident buffer, or (None) every
        slot's (the ring is dropped)."""
        if index is not None:
            self._views.pop(("resident", index), None)
        else:
            for key in [k for k in self._views if isinstance(k[0], int)]:
                del self._views[key]

    def clear_views(self) -> None:
        self._views = {}

    def repacked(self, index: int, named) -> None:
        """Block ``index`` was packed from these (name, parameter) pairs: its old views describe old buffers."""
        self.named[index] = named
        self.drop_views(index)

    def is_ours(self, index: int) -> bool:
        """Whether block ``index``'s parameters are the objects we know and point where we pointed them."""
        expected = self._expected[index]
        named = block_parameters(self.blocks[index])
        if expected is None or len(named) != len(self.named[index]):
            return False
        return all(param is known and weight_pointer(param) == pointer
                   for (_, param), (_, known), pointer in zip(named, self.named[index], expected))

    def let_go(self) -> None:
        """The blocks are given back: forget where they point, and the placeholders."""
        self._expected = [None] * len(self.blocks)
        self._placeholders = {}
