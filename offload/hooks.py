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
            self._hooks.append(root.register_forward_hook(
                lambda module, args, output: self.end_forward(), always_call=True))
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
        finally:
            self.end_forward()

    @_compiler_disable
    def begin_forward(self) -> None:
        self._forwards += 1
        self._forward_bytes = 0
        self._forward_copies = 0
        self.backend.settle(block=False)

    @_compiler_disable
    def end_forward(self) -> None:
        self._last_forward_bytes = self._forward_bytes
        self._last_forward_copies = self._forward_copies
