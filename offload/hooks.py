"""The forward hooks that drive a manager: one pre/post pair per block, and optional forward scope."""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import List, Optional, Sequence

import torch
from torch import nn

compiler_disable = torch.compiler.disable


def cuda_graph_refusal(compile_kwargs: Optional[dict]) -> Optional[str]:
    """Why these torch.compile settings cannot run with streamed blocks, or None when they can.

    CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"``, inductor's ``triton.cudagraphs``, or the
    ``cudagraphs`` backend, which ComfyUI's TorchCompileModel offers) replay the kernels with the addresses they
    were recorded with, while a streamed block's weights live in whichever slot the prefetch gave it this forward:
    a replay would read another block's weights, or record again at every change."""
    if not compile_kwargs:
        return None
    mode = str(compile_kwargs.get("mode") or "")
    options = compile_kwargs.get("options") or {}
    backend = compile_kwargs.get("backend")
    backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", "")
    if backend_name == "cudagraphs":
        what = "backend='cudagraphs'"
    elif mode in ("reduce-overhead", "max-autotune") or options.get("triton.cudagraphs"):
        what = f"mode={mode!r}" if mode else "options triton.cudagraphs"
    else:
        what = None
    if what is not None:
        return (f"[layerwise-offload] torch.compile with CUDA graphs ({what}) cannot run with streamed blocks: a "
                "graph replays the weight addresses it recorded, and streamed weights move between slots every "
                "forward. Use the inductor backend with mode 'default' or 'max-autotune-no-cudagraphs' in the compile "
                "node, or keep every block resident (resident_layers = the block count).")
    return None


class BlockHooks:
    """The forward hooks that drive a manager: a pre/post pair on every block, a begin/end pair on the root.

    The hooks are installed once and stay; ``active`` switches what they do. Adding and removing hooks
    around every forward would change the modules' hook dicts, which torch.compile guards on: every
    forward would recompile. The check runs inside compiler-disabled calls, so it adds no guard either.
    ``driver`` has ``before_block(i)``, ``after_block(i)``, ``begin_forward()``, ``end_forward(completed)`` and
    ``release_all()``. Only the installed hooks hold it strongly (a model with hooks keeps its manager working);
    this object holds it weakly, since the driver holds this object: that cycle would keep a dropped manager (and
    its host store, the whole model in RAM) alive until the cycle collector runs, which ComfyUI's unload does not
    wait for.
    """

    def __init__(self, blocks: Sequence[nn.Module], driver):
        self._blocks = blocks
        self._driver_ref = weakref.ref(driver)
        self._handles: List[torch.utils.hooks.RemovableHandle] = []
        self.active = True

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def attach(self, root: Optional[nn.Module] = None) -> None:
        """Install the block hooks (and forward-scope hooks on ``root``, if given). Idempotent."""
        if self._handles:
            return
        driver = self._driver_ref()
        for index, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_hook(index, driver)))
            self._handles.append(block.register_forward_hook(self._make_post_hook(index, driver), always_call=True))
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(lambda module, args: driver.begin_forward()))
            # After an exception PyTorch calls this hook with no output: that forward is not learned from.
            self._handles.append(root.register_forward_hook(
                lambda module, args, output: driver.end_forward(completed=output is not None), always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextmanager
    def forward_scope(self):
        """Count one model forward where no root module's hooks do (what happens inside is that forward)."""
        driver = self._driver_ref()
        driver.begin_forward()
        try:
            yield driver
        except BaseException:
            driver.end_forward(completed=False)
            # The failure may have come between two steps of the bookkeeping (a copy issued, its slot not yet
            # recorded): the next forward starts from nothing rather than from what this one left.
            driver.release_all()
            raise
        driver.end_forward()

    def _make_pre_hook(self, index: int, driver):
        def pre_hook(module, args):
            self._pre_block(driver, index)
        return pre_hook

    def _make_post_hook(self, index: int, driver):
        def post_hook(module, args, output):
            self._post_block(driver, index)
        return post_hook

    @compiler_disable
    def _pre_block(self, driver, index: int) -> None:
        if self.active:
            driver.before_block(index)

    @compiler_disable
    def _post_block(self, driver, index: int) -> None:
        if self.active:
            driver.after_block(index)
