"""The forward hooks that drive a manager: one pre/post pair per block, and optional forward scope."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

_compiler_disable = torch.compiler.disable


def cuda_graph_refusal(compile_kwargs: Optional[dict]) -> Optional[str]:
    """Why these torch.compile settings cannot run with streamed blocks, or None when they can.

    CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"``, or inductor's ``triton.cudagraphs``) replay
    the kernels with the addresses they were recorded with, while a streamed block's weights live in whichever
    slot the prefetch gave it this forward: a replay would read another block's weights, silently."""
    if not compile_kwargs:
        return None
    mode = str(compile_kwargs.get("mode") or "")
    options = compile_kwargs.get("options") or {}
    if mode in ("reduce-overhead", "max-autotune") or options.get("triton.cudagraphs"):
        what = f"mode={mode!r}" if mode else "options triton.cudagraphs"
        return (f"[layerwise-offload] torch.compile with CUDA graphs ({what}) cannot run with streamed blocks: a "
                "graph replays the weight addresses it recorded, and streamed weights move between slots every "
                "forward. Use mode 'default' or 'max-autotune-no-cudagraphs' in the compile node, or keep every "
                "block resident (resident_layers = the block count).")
    return None


class HookMixin:
    """Hook installation and per-forward counting for :class:`LayerwiseOffloadManager`.

    The hooks are installed once and stay; ``hooks_active`` switches what they do. Adding and removing
    hooks around every forward would change the modules' hook dicts, which torch.compile guards on: every
    forward would recompile. The check runs inside compiler-disabled calls, so it adds no guard either.
    """

    hooks_active = True

    def attach(self, root: Optional[nn.Module] = None) -> "HookMixin":
        """Install the block hooks (and forward-scope hooks on ``root``, if given). Idempotent."""
        if self._hooks:
            return self
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._make_pre_hook(index)))
            self._hooks.append(block.register_forward_hook(self._make_post_hook(index), always_call=True))
        if root is not None:
            self._hooks.append(root.register_forward_pre_hook(lambda module, args: self.begin_forward()))
            # After an exception PyTorch calls this hook with no output: that forward is not learned from.
            self._hooks.append(root.register_forward_hook(
                lambda module, args, output: self.end_forward(completed=output is not None), always_call=True))
        return self

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def hooks_installed(self) -> bool:
        return bool(self._hooks)

    def _make_pre_hook(self, index: int):
        def pre_hook(module, args):
            self._pre_block(index)
        return pre_hook

    def _make_post_hook(self, index: int):
        def post_hook(module, args, output):
            self._post_block(index)
        return post_hook

    @_compiler_disable
    def _pre_block(self, index: int) -> None:
        if self.hooks_active:
            self.before_block(index)

    @_compiler_disable
    def _post_block(self, index: int) -> None:
        if self.hooks_active:
            self.after_block(index)

    @contextmanager
    def forward_scope(self):
        """Count one model forward: per-forward counters cover what happens inside."""
        self.begin_forward()
        try:
            yield self
        except BaseException:
            self.end_forward(completed=False)
            # The failure may have come between two steps of the bookkeeping (a copy issued, its slot not yet
            # recorded): the next forward starts from nothing rather than from what this one left.
            self.release_all()
            raise
        self.end_forward()

    @_compiler_disable
    def begin_forward(self) -> None:
        self._forwards += 1
        self._forward_bytes = 0
        self._forward_copies = 0
        self.backend.settle(block=False)
        self._retire_bounce()
        self._begin_tracking()

    @_compiler_disable
    def end_forward(self, completed: bool = True) -> None:
        """Close a forward: learn its call order, and keep what it prefetched out of outside code's reach.

        Blocks prefetched for the next forward sit in device memory whose copy may still be in flight on the
        copy stream. Code outside the hooks (ComfyUI reading weights, a run of this model without the offload)
        would read them without waiting; making the compute stream wait here instead would hold everything
        queued after this forward (the sampler's math, the next forward's resident blocks) behind the next
        forward's first copies. So their parameters point back at the host copy (or the placeholders) until
        their block's pre-hook waits for the copy on the compute stream and points them at the device again.
        """
        self._last_forward_bytes = self._forward_bytes
        self._last_forward_copies = self._forward_copies
        self._end_tracking(completed)
        self._hide_pending_copies()
        if self._release_after_forward:
            self.release_all()

    def _hide_pending_copies(self) -> None:
        for index, handle in enumerate(self._pending_copy):
            if handle is not None and index not in self._hidden:
                self._point_released(index)
                self._hidden.add(index)
