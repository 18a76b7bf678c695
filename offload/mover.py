"""One block's moves: its copy to the device (a resident's buffer, a slot, or a streamed block's head) queued and
its parameters pointed there, or its device copy given back and its parameters pointed at the host.

The engine (engine.py) decides which block moves when; the mover knows how. It holds the parts a move touches and
nothing of the plan: the engine passes what the plan says of each block (resident, where its tail begins, what
the host should read ahead).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from .blocks.params import BlockParameters
from .blocks.states import BlockStates
from .device.copier import BlockCopier
from .device.memory import DeviceMemory
from .host.side import HostSide
from .stats import Counters


class BlockMover:
    def __init__(self, host: HostSide, params: BlockParameters, device_memory: DeviceMemory, copier: BlockCopier,
                 states: BlockStates, counters: Counters, backend):
        self.host = host
        self.params = params
        self.device_memory = device_memory
        self.copier = copier
        self.states = states
        self.counters = counters
        self.backend = backend
        # Where a released block's parameters point: its host copy (True), or empty placeholders.
        self.release_to_host = False

    @property
    def inference_tensors(self) -> bool:
        return self.host.inference_tensors

    def copy_is_pageable(self, index: int) -> bool:
        return self.backend.asynchronous and self.host.pageable(index)

    def copy_in(self, index: int, resident: bool, split: int = 0, ahead: Sequence[int] = (),
                protect: Iterable[int] = (), may_fail: bool = False, after=None) -> bool:
        """Give block ``index`` its device buffer (its own when ``resident``, else a slot), queue its copy (from byte
        ``split`` on: its head stays in its own buffer) and make its views. False: no free slot, and ``may_fail``."""
        # Buffers and views are of the parameters' kind (see HostSide._restart): normal views made under
        # inference_mode would be unusable by autograd later, normal data in an inference parameter fails.
        inference = self.inference_tensors
        if torch.is_inference_mode_enabled() == inference:  # entering the mode costs more than the rest of a copy
            return self._copy_in(index, resident, split, ahead, protect, may_fail, after)
        with torch.inference_mode(inference):
            return self._copy_in(index, resident, split, ahead, protect, may_fail, after)

    def _copy_in(self, index: int, resident: bool, split: int, ahead, protect, may_fail: bool, after) -> bool:
        layout = self.host.store.layouts[index]
        memory = self.device_memory
        if resident:
            split = 0
            buffer, fresh = memory.resident(index, layout.nbytes)
            if fresh:  # a forced release gave the buffer back: it is new memory
                after = self.backend.mark_compute()
            key = ("resident", index)
        else:
            slot = memory.acquire(protect, not may_fail, self.states.running, self.release)
            if slot is None:
                if may_fail:
                    return False
                raise RuntimeError(
                    f"[layerwise-offload] no free device slot for block {index}: every slot holds a running "
                    f"block; raise prefetch_size or check for re-entrant block calls")
            buffer, after = memory.take(slot, index)
            key = (slot, index)
        if split:  # the head stays in its own buffer: the tail is what streams
            head = memory.heads[index]
            views = self.params.views(key, lambda: layout.weight_views(head, buffer, split), layout)
        else:
            views = self.params.views(key, lambda: layout.weight_views(buffer), layout)
        destination = views.destination
        if destination is None:
            destination = views.destination = buffer.narrow(0, 0, layout.nbytes - split)
        host = self.host
        source = host.source(index, ahead)
        if split:  # a RAM block (a disk block streams whole); made once per host buffer
            tail = views.source
            if tail is None or tail.data_ptr() != source.data_ptr() + split:
                tail = views.source = source.narrow(0, split, layout.nbytes - split)
            source = tail
        bounce = host.pinner if resident and host.pin_memory and self.copy_is_pageable(index) else None
        written = layout.weights_in_tail(split) if split and self.copier.transform is not None else None
        handle = self.copier.copy(self.backend, index, destination, source, after, views, bounce_pinner=bounce,
                                  written=written)
        host.copied(index, handle)
        self.states.copied_in(index, views, handle)
        self.counters.count_copy(index, layout.nbytes - split, resident=resident)
        self.note_peaks()
        return True

    def copy_head(self, index: int, split: int, after) -> None:
        """Queue the copy of streamed block ``index``'s head (its first ``split`` bytes) into its own buffer, once
        per arming like a resident's copy, the transform on its weights; the block's first run waits for it."""
        with torch.inference_mode(self.inference_tensors):
            layout = self.host.store.layouts[index]
            head = self.device_memory.heads[index]
            in_head = tuple(not tail for tail in layout.weights_in_tail(split))
            weights = layout.head_weight_views(head, split) if self.copier.transform is not None else ()
            source = self.host.source(index).narrow(0, 0, split)
            bounce = self.host.pinner if self.host.pin_memory and self.copy_is_pageable(index) else None
            handle = self.copier.copy(self.backend, index, head, source, after, weights, bounce_pinner=bounce,
                                      written=in_head)
            self.host.copied(index, handle)
            self.states.head_pending[index] = handle
            self.counters.count_copy(index, split, resident=True)

    def point_at(self, index: int, views: Sequence[torch.Tensor]) -> None:
        self.params.point_at(index, self.host.store.layouts[index], views)

    def point_released(self, index: int, at_host: Optional[bool] = None) -> None:
        at_host = self.release_to_host if at_host is None else at_host
        self.params.point_released(index, self.host.store, at_host, self.inference_tensors)

    def release(self, index: int) -> None:
        """Block ``index`` off the device: its parameters pointed away, its buffer given back."""
        if not self.states.materialized[index]:
            return
        unwaited = self.states.take_pending(index)
        self.point_released(index)
        self.states.released(index)
        if unwaited is not None and self.copier.transform is not None:
            # Evicted before it ran: its after-copy transform may still write the slot on its own stream, and the
            # slot's next copy waits only for the compute stream's mark. Order that mark after the transform.
            self.backend.order_compute_after(unwaited)
        self.device_memory.give_back(index, self.backend.mark_compute)

    def note_peaks(self, reset: bool = False) -> None:
        self.counters.note_peaks(self.states.count, self.device_memory.nbytes(), reset=reset)
