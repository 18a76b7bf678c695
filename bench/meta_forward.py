"""One forward of a DiT built on the ``meta`` device: the live bytes of what it allocates (:class:`LiveBytes`),
ComfyUI's attention replaced by a stand-in that allocates what CUDA flash SDPA does, hooks around each block."""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Live bytes of every storage created by an operator while the mode is active, and their peaks."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.window_peak = 0  # peak since the last reset_window()
        self.outside_peak = 0  # peak reached while no block was running
        self.in_block = False
        self._sizes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf.untyped_storage())
        return out

    def ignore(self, module) -> None:
        """Weights and buffers existed before the forward: views of them allocate nothing."""
        for tensor in list(module.parameters()) + list(module.buffers()):
            self._track(tensor.untyped_storage(), counted=False)

    def _track(self, storage, counted: bool = True) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes() if counted else 0
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.window_peak = max(self.window_peak, self.live)
        if not self.in_block:
            self.outside_peak = max(self.outside_peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.live -= self._sizes.pop(key, 0)

    def reset_window(self) -> None:
        self.window_peak = self.live


def flash_like_attention(calls):
    """A stand-in for ComfyUI's attention functions that allocates what CUDA flash SDPA allocates."""
    def attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
        calls.append(1)
        if skip_reshape:
            batch, heads, tokens, _ = q.shape
            value_dim = v.shape[-1]
        else:
            batch, tokens = q.shape[:2]
            value_dim = v[0].numel() // (v.shape[1] * heads)  # v may come as (b, L, heads, dim) or (b, L, heads * dim)
        logsumexp = torch.empty((batch, heads, tokens), dtype=torch.float32, device=q.device)
        out = torch.empty((batch, tokens, heads, value_dim), dtype=q.dtype, device=q.device)
        del logsumexp
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.view(batch, tokens, heads * value_dim)
    return attention


@contextmanager
def attention_replaced(replacement):
    """Swap every ``optimized_attention*`` name bound in ComfyUI's model modules, restore them after."""
    names = ("optimized_attention", "optimized_attention_masked")
    saved = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("comfy.ldm"):
            continue
        for name in names:
            if callable(getattr(module, name, None)):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def block_lists(model):
    """The blocks as the node finds them (the pack's own discovery)."""
    from ..nodes.discovery import discover_blocks  # imports ComfyUI: only after import_comfyui
    return discover_blocks(model).blocks


def meta_forward(model, spec, latent, batch: int, dtype: torch.dtype, attention, mode, enter, leave):
    """One forward of ``model`` (``spec``'s, built on the meta device) under ``mode`` (a dispatch or counting mode),
    ComfyUI's attention replaced by ``attention`` and ``enter(i)`` / ``leave(i)`` around block i; its blocks."""
    blocks = block_lists(model)
    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(lambda m, a, i=i: enter(i)),
                                                          b.register_forward_hook(lambda m, a, o, i=i: leave(i)))]
    try:
        with torch.no_grad(), torch.device("meta"), attention_replaced(attention), mode:
            x = torch.empty((batch,) + tuple(latent), dtype=dtype)
            model(x, **spec.inputs(x, batch, dtype), transformer_options={})
    finally:
        for handle in handles:
            handle.remove()
    return blocks
