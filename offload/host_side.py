"""Building the host store from the blocks, and keeping it in step with them."""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch

from .host_memory import pinnable_bytes
from .host_store import HostStore, block_parameters, plan_layout
from .tensor_subclass import weight_pointer

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
            self.store = HostStore([plan_layout(named) for named in self._named_params])
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
        pinned = self._blocks_to_pin(indices)
        for done, index in enumerate(indices, 1):
            self._pack(index, pin=index in pinned)
            if progress is not None:
                progress(done, len(indices))

    def _blocks_to_pin(self, indices: Sequence[int]) -> set:
        """Pin what the host can spare with a margin; streamed blocks benefit most, so the trailing first."""
        if not self.pin_memory or not indices:
            return set()
        sizes = {i: plan_layout(block_parameters(self.blocks[i])).nbytes for i in indices}
        requested = sum(sizes.values())
        allowed = pinnable_bytes(requested, cap=self.pin_cap_bytes, available=self.available_host_bytes)
        chosen, total = set(), 0
        for index in sorted(indices, reverse=True):
            if total + sizes[index] <= allowed:
                chosen.add(index)
                total += sizes[index]
        if total < requested:
            log.warning("[layerwise-offload] pinning %.2f of %.2f GiB of the host store to keep host memory free "
                        "(pinned memory cannot be swapped); the rest stays pageable and copies from it are slower",
                        total / 2**30, requested / 2**30)
        return chosen

    def _pack(self, index: int, pin: bool) -> None:
        nbytes = plan_layout(block_parameters(self.blocks[index])).nbytes
        available = self.available_host_bytes()
        if available is not None and available < nbytes + HOST_OOM_MARGIN_BYTES:
            raise MemoryError(
                f"[layerwise-offload] host memory is short: block {index} needs {nbytes / 2**20:.0f} MiB but only "
                f"{available / 2**20:.0f} MiB is available. Free RAM (close programs, unload other models), use "
                f"a smaller checkpoint (fp8), or keep more blocks resident on the GPU")
        with torch.inference_mode(self.inference_tensors):
            named = block_parameters(self.blocks[index])
            self._named_params[index] = named
            self.store.layouts[index] = plan_layout(named)
            self.store.pack_block(index, pin)
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
