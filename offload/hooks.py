"""The forward hooks that drive a manager: one pre/post pair per block, and optional forward scope."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

_compiler_disable = torch.compiler.disable


class HookMixin:
    """Hook installation and per-forward counting for :class:`LayerwiseOffloadManager`."""

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
            self.before_block(index)
        return pre_hook

    def _make_post_hook(self, index: int):
        def post_hook(module, args, output):
            self.after_block(index)
        return post_hook

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
        self._begin_tracking()

    @_compiler_disable
    def end_forward(self, completed: bool = True) -> None:
        """Close a forward: learn its call order, and make what it prefetched safe to read.

        Blocks prefetched for the next forward point at device memory whose copy may still be in
        flight on the copy stream. Code outside the hooks (ComfyUI reading weights, a run of this
        model without the offload) would read them without waiting, so the current stream waits now.
        """
        self._last_forward_bytes = self._forward_bytes
        self._last_forward_copies = self._forward_copies
        self._end_tracking(completed)
        self.wait_for_pending_copies()
        if self._release_after_forward:
            self.release_all()

    def wait_for_pending_copies(self) -> None:
        for index, handle in enumerate(self._pending_copy):
            if handle is not None:
                self.backend.wait_for_copy(handle)
                self._pending_copy[index] = None
