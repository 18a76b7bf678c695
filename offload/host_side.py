"""Building the host store from the blocks, and keeping it in step with them."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch

from .host_memory import pinnable_bytes
from .pinning import return_freed_host_memory
from .host_store import HostStore, block_parameters, params_are_inference, plan_layout
from .tensor_subclass import point_param_at, weight_pointer

log = logging.getLogger("layerwise_offload")

# Never let the host store take the host below this much available memory: fail with a clear error instead.
HOST_OOM_MARGIN_BYTES = 512 * 2**20


class HostSideMixin:
    """The host half of :class:`LayerwiseOffloadManager`: packing, pinning policy, resync."""

    def prepare(self, progress: Optional[Callable[[int, int], None]] = None) -> List[int]:
        """Build the host store from the blocks' current parameters, or bring it up to date.

        The first call packs every block. Later calls repack only blocks whose parameters were
        replaced or moved by someone else (a LoRA bake swapping Parameter objects, a whole-model
        ``.to()``), and return their indices; an unchanged model costs a pointer comparison.
        ``progress(done, total)`` is called after each packed block (a UI progress bar).
        """
        inference = bool(block_parameters(self.blocks[0])) and block_parameters(self.blocks[0])[0][1].is_inference()
        if self.store is None or inference != self.inference_tensors:
            # Parameters made under inference_mode (ComfyUI loads models inside it) are inference
            # tensors and accept only inference tensors as .data: every buffer follows their kind.
            self.inference_tensors = inference
            if self.armed:
                self.release_all()
            if self.store is not None:
                self.store.clear()
            self.store = HostStore([plan_layout(named) for named in self._named_params], self.pinner)
            changed = list(range(self.num_blocks))
        else:
            changed = [i for i in range(self.num_blocks) if not self._block_is_ours(i)]
        if changed and self.armed:
            self.release_all()
        self._pack_blocks(changed, progress)
        return changed

    def repack_block(self, index: int) -> None:
        """Re-read one block's parameters (new objects or new values) into the host store."""
        if self.armed:
            self.release_all()
        if self.store is None:
            self.prepare()
        else:
            self._pack_blocks([index])

    def _pack_blocks(self, indices: Sequence[int], progress=None) -> None:
        for done, index in enumerate(indices, 1):
            self._pack(index)
            if progress is not None:
                progress(done, len(indices))
        if indices:
            return_freed_host_memory()  # the CPU weights packing replaced
            self._sync_pinning()

    def _sync_pinning(self, schedule=None) -> None:
        """Page-lock exactly the streamed blocks (as many as the host can spare), nothing else.

        Residents are copied once per arming, so their host copy stays pageable. The store is
        already allocated, so pinning it takes no more RAM; the margin keeps the host from having
        all its memory locked. Streamed blocks late in the step are pinned first.
        """
        store = self.store
        if store is None or not store.built:
            return
        schedule = schedule or self.schedule or self._make_schedule()
        streamed = list(schedule.streamed_blocks) if self.pin_memory else []
        sizes = {i: store.buffers[i].numel() for i in streamed}
        requested = sum(sizes.values())
        chosen = set()
        if requested:
            available = self.available_host_bytes()
            # The blocks are allocated already: what they take is available to lock them with.
            spare = None if available is None else available + requested
            allowed = pinnable_bytes(requested, cap=self.pin_cap_bytes, available=spare)
            total = 0
            for index in sorted(streamed, reverse=True):
                if total + sizes[index] <= allowed:
                    chosen.add(index)
                    total += sizes[index]
            warning_key = (tuple(streamed), total)
            if total < requested and warning_key != self._last_pin_warning:
                self._last_pin_warning = warning_key
                log.warning("[layerwise-offload] page-locking %.2f of %.2f GiB of streamed blocks to keep host memory "
                            "free (pinned memory cannot be swapped); the rest stays pageable and copies from it are "
                            "slower", total / 2**30, requested / 2**30)
        if [i in chosen for i in range(self.num_blocks)] != store.pinned:
            self.backend.synchronize()  # (un)registering memory a queued copy reads is undefined
            for index in range(self.num_blocks):
                store.set_pinned(index, index in chosen)

    def _copy_is_pageable(self, index: int) -> bool:
        return self.backend.asynchronous and not self.store.is_pinned(index)

    def _drop_store(self, target: torch.device) -> None:
        """Give every parameter its own copy on ``target``, then unlock and free the store."""
        for index, layout in enumerate(self.store.layouts):
            with torch.inference_mode(params_are_inference(self._named_params[index])):
                copies = [view.to(target, copy=True) for view in self.store.views(index)]
                for weight, view in zip(layout.weights, layout.weights_from(copies)):
                    point_param_at(weight.param, view)
        self.store.clear()
        self.store = None
        return_freed_host_memory()

    def host_memory_shortfall(self, settings: Optional[str] = None) -> Optional[str]:
        """Why packing the blocks not in the store yet would take the host below its safety margin, or None.

        Packing replaces ComfyUI's CPU copy block by block, so the peak extra need is one block.
        ``settings`` names the caller's settings in the message (the node's inputs, say).
        """
        waiting = [i for i in range(self.num_blocks) if self.store is None or self.store.buffers[i] is None]
        if not waiting:
            return None
        sizes = self.block_nbytes()
        index = max(waiting, key=lambda i: sizes[i])
        return self._shortfall(index, sizes[index], settings)

    def _shortfall(self, index: int, nbytes: int, settings: Optional[str] = None) -> Optional[str]:
        available = self.available_host_bytes()
        if available is None or available >= nbytes + HOST_OOM_MARGIN_BYTES:
            return None
        config = self.config
        settings = settings or (f"resident_layers={config.resident_layers}, prefetch_size={config.prefetch_size}, "
                                f"pin_memory={self.pin_memory}")
        return (f"[layerwise-offload] host memory is short: block {index} needs {nbytes / 2**20:.0f} MiB but only "
                f"{available / 2**20:.0f} MiB is available, with a {HOST_OOM_MARGIN_BYTES // 2**20} MiB safety "
                f"margin ({settings}). Every block is kept in host "
                f"RAM whatever resident_layers is, so raising it does not help. What helps: unload other models "
                f"(or restart ComfyUI), a smaller checkpoint or an fp8/GGUF one, pin_memory off (page-locked RAM "
                f"cannot be swapped out), or more RAM.")

    def _pack(self, index: int) -> None:
        nbytes = plan_layout(block_parameters(self.blocks[index])).nbytes
        refusal = self._shortfall(index, nbytes)
        if refusal is not None:
            raise MemoryError(refusal)
        with torch.inference_mode(self.inference_tensors):
            named = block_parameters(self.blocks[index])
            self._named_params[index] = named
            self.store.layouts[index] = plan_layout(named)
            self.store.pack_block(index, pin=False)  # page-locked by _sync_pinning, streamed blocks only
            self._drop_views(index)
            self._materialized[index] = False
            self._point_released(index)

    def _block_is_ours(self, index: int) -> bool:
        expected = self._expected_pointers[index]
        named = block_parameters(self.blocks[index])
        if expected is None or len(named) != len(self._named_params[index]):
            return False
        return all(param is known and weight_pointer(param) == pointer
                   for (_, param), (_, known), pointer in zip(named, self._named_params[index], expected))
