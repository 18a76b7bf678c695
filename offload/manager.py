"""The resident layerwise offload manager.

Blocks keep their parameter objects for life; only their data changes (``param.data``, or a swapped-in
quantized subclass). A block is *materialized* (parameters view a device buffer) or *released* (empty
placeholders, or host views). Resident blocks own a device buffer each and stay materialized across forwards;
streamed blocks share a ring of ``prefetch_size + 1`` device slots and are copied in one ahead of use.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from .config import OffloadConfig, resolve_resident_count
from .device_backend import make_backend, normalize_device
from .host_memory import available_host_bytes
from .pinning import default_pinner
from .host_store import HostStore, block_parameters, params_are_inference, plan_layout
from .block_checks import check_no_shared_parameters, move_block_buffers
from .schedule import Schedule, choose_resident_blocks
from .call_order import CallOrderMixin
from .hooks import HookMixin
from .tensor_subclass import point_param_at, weight_pointer
from .host_side import HostSideMixin
from .after_copy import AfterCopyMixin
from .stats import CountersMixin, OffloadStats, snapshot

_compiler_disable = torch.compiler.disable


class LayerwiseOffloadManager(HookMixin, CallOrderMixin, HostSideMixin, AfterCopyMixin, CountersMixin):
    """Keeps the leading (or strided) blocks on ``device`` and streams the rest from host memory.

    Args:
        blocks: the transformer blocks, several lists joined in the order the model runs them; residency
            follows this order, prefetch the order each forward really ran (see call_order.py).
        device: the compute device. ``cpu`` runs the same code path synchronously (CPU loopback).
        config: an :class:`OffloadConfig`; keyword arguments override its fields.

    Lifecycle: ``attach()`` installs the hooks; the first block forward arms the plan (host store,
    device slots, resident copies); ``release_all()`` returns every device byte; ``replan()``
    changes the plan; ``detach()`` gives the blocks back as ordinary parameters.
    """

    def __init__(self, blocks: Sequence[nn.Module], device, config: Optional[OffloadConfig] = None,
                 **overrides):
        self.blocks: List[nn.Module] = list(blocks)
        if not self.blocks:
            raise ValueError("LayerwiseOffloadManager needs at least one block to manage")
        if len({id(b) for b in self.blocks}) != len(self.blocks):
            raise ValueError("the same module appears twice in the block list; pass each block once")
        self.config = dataclasses.replace(config or OffloadConfig(), **overrides)
        self.device = normalize_device(torch.device(device))
        self.host_device = torch.device("cpu")
        self._named_params = [block_parameters(b) for b in self.blocks]
        # Where each block's parameters point now (in _named_params order), to notice outside moves.
        self._expected_pointers: List[Optional[List[int]]] = [None] * len(self.blocks)
        check_no_shared_parameters(self._named_params)
        self.backend = make_backend(self.device, self.config.measure_time)
        self.store: Optional[HostStore] = None
        self.inference_tensors = False  # whether the blocks' parameters (and so our buffers) are inference tensors
        # Host-memory policy: an outside cap on pinned bytes (ComfyUI's own limit), and the reader of
        # available host memory (replaceable, so tests can pass a figure instead of patching psutil).
        self.pin_cap_bytes: Optional[int] = None
        self.available_host_bytes = available_host_bytes
        self.pinner = default_pinner(self.device)  # how host buffers are page-locked (None: never)
        self._last_pin_warning = None
        self.schedule: Optional[Schedule] = None
        self._hooks: List[torch.utils.hooks.RemovableHandle] = []
        self._placeholders: Dict[tuple, torch.Tensor] = {}
        self._reset_call_tracking()
        self._reset_device_state()
        self._release_after_forward = False
        self._bytes_copied = 0
        self._copies_issued = 0
        self._demand_copies = 0
        self.copies_per_block = [0] * self.num_blocks
        self._forwards = 0
        self._forward_bytes = 0
        self._forward_copies = 0
        self._last_forward_bytes = self._last_forward_copies = 0
        self._peak_materialized = self._peak_device_bytes = 0

    # ----------------------------------------------------------------- state
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def armed(self) -> bool:
        return self.schedule is not None

    @property
    def pin_memory(self) -> bool:
        pin = self.config.pin_memory
        return self.device.type != "cpu" if pin is None else pin

    def is_materialized(self, index: int) -> bool:
        return self._materialized[index]

    def materialized_blocks(self) -> List[int]:
        return [i for i, m in enumerate(self._materialized) if m]

    def resident_count(self) -> int:
        return resolve_resident_count(self.config.resident_layers, self.num_blocks)

    def block_nbytes(self) -> List[int]:
        """Bytes each block occupies on the device once materialized."""
        if self.store is not None:
            return [layout.nbytes for layout in self.store.layouts]
        return [plan_layout(named).nbytes for named in self._named_params]

    def planned_device_bytes(self, schedule: Optional[Schedule] = None) -> int:
        """The device bytes the plan holds once armed: resident buffers plus streaming slots."""
        schedule = schedule or self.schedule or self._make_schedule()
        sizes = self.block_nbytes()
        resident = sum(sizes[i] for i in schedule.resident_blocks)
        streamed = [sizes[i] for i in schedule.streamed_blocks]
        slots = min(self.config.prefetch_size + 1, len(streamed))
        return resident + (slots * max(streamed) if streamed else 0)

    def device_bytes(self) -> int:
        held = sum(b.numel() for b in self._resident_buffers.values())
        return held + sum(b.numel() for b in self._slots)

    # ----------------------------------------------------------------- the step
    @_compiler_disable
    def before_block(self, index: int) -> None:
        if not self.armed:
            self.arm()
        self._track_call(index)
        if not self._materialized[index]:
            self._demand_copies += 1
            self._materialize(index, protect=self._upcoming(index))
        handle = self._pending_copy[index]
        if handle is not None:
            self.backend.wait_for_copy(handle)
            self._pending_copy[index] = None
        if index in self._hidden:  # prefetched by the last forward (hooks.end_forward): the wait is queued now
            self._hidden.discard(index)
            self._point_at(index, self._device_views[index])
        self._running[index] += 1
        self._prefetch_after(index, pageable=False)

    @_compiler_disable
    def after_block(self, index: int) -> None:
        if self.schedule is not None:
            self._prefetch_after(index, pageable=True)
        if self._running[index] > 0:
            self._running[index] -= 1
        if self.schedule is None or self.schedule.resident[index] or self._running[index] > 0:
            return
        if not self._runs_again_soon(index):
            self._release(index)
            # Its slot is free now: the look-ahead may want this very block again (next forward).
            self._prefetch_after(index)

    # ----------------------------------------------------------------- arming
    def _make_schedule(self) -> Schedule:
        count = self.resident_count()
        return Schedule(choose_resident_blocks(self.num_blocks, count, self.config.policy))

    @_compiler_disable
    def arm(self) -> None:
        """Allocate the plan's device memory and queue the resident copies (by the first forward).
        All is allocated before the plan is published: out of memory leaves it unarmed, holding nothing."""
        if self.armed:
            return
        self.prepare()
        schedule = self._make_schedule()
        sizes = self.block_nbytes()
        streamed = schedule.streamed_blocks
        slot_count = min(self.config.prefetch_size + 1, len(streamed))
        slot_bytes = max((sizes[i] for i in streamed), default=0)
        move_block_buffers(self.blocks, self.device)
        self._sync_pinning(schedule)
        residents = {index: self._allocate_device(sizes[index]) for index in schedule.resident_blocks}
        slots = [self._allocate_device(slot_bytes) for _ in range(slot_count)]
        self._resident_buffers, self._slots = residents, slots
        self._slot_owner = [None] * slot_count
        # Fresh memory may have been freed by tensors that queued compute work still reads: the first
        # copy into each buffer waits for the compute stream as it is now.
        allocated = self.backend.mark_compute()
        self._slot_free = [allocated] * slot_count
        self.schedule = schedule
        self._rebuild_order()
        for index in schedule.resident_blocks:
            self._materialize(index, after=allocated)
        self._note_peaks()

    def _allocate_device(self, nbytes: int) -> torch.Tensor:
        with torch.inference_mode(self.inference_tensors):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # ----------------------------------------------------------------- copies
    def _materialize(self, index: int, protect: Iterable[int] = (), may_fail: bool = False, after=None) -> bool:
        # Buffers and views are of the parameters' kind (see prepare): normal views made under
        # inference_mode would be unusable by autograd later, normal data in an inference parameter fails.
        with torch.inference_mode(self.inference_tensors):
            return self._materialize_normal(index, protect, may_fail, after)

    def _materialize_normal(self, index: int, protect: Iterable[int], may_fail: bool, after) -> bool:
        layout = self.store.layouts[index]
        if self.schedule.resident[index]:
            buffer = self._resident_buffers.get(index)
            if buffer is None:
                buffer = self._resident_buffers[index] = self._allocate_device(layout.nbytes)
                after = self.backend.mark_compute()
            views = self._view_cache.get(("resident", index))
            if views is None:
                views = self._view_cache[("resident", index)] = layout.weight_views(buffer)
            self._block_slot[index] = None
        else:
            slot = self._acquire_slot(set(protect), evict_protected=not may_fail)
            if slot is None:
                if may_fail:
                    return False
                raise RuntimeError(
                    f"[layerwise-offload] no free device slot for block {index}: every slot holds a running "
                    f"block; raise prefetch_size or check for re-entrant block calls")
            buffer = self._slots[slot]
            after = self._slot_free[slot]
            views = self._view_cache.get((slot, index))
            if views is None:
                views = self._view_cache[(slot, index)] = layout.weight_views(buffer)
            self._slot_owner[slot] = index
            self._block_slot[index] = slot
        # The host side answers where the bytes are: the store's buffer, or a disk block's staging buffer.
        handle = self._pending_copy[index] = self._copy_in(index, buffer.narrow(0, 0, layout.nbytes),
                                                           self._copy_source(index), after, views)
        self._copy_sourced(index, handle)
        self._point_at(index, views)
        self._device_views[index] = views
        self._hidden.discard(index)
        self._materialized[index] = True
        self._count_copy(index, layout.nbytes)
        self._note_peaks()
        return True

    def _acquire_slot(self, protect: set, evict_protected: bool) -> Optional[int]:
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                return slot
        # Evict a block nobody is running: first one the plan no longer expects (a skipped or
        # out-of-order block), then an expected one, but only when a block needs a slot right now.
        passes = (False, True) if evict_protected else (False,)
        for allow_protected in passes:
            for slot, owner in enumerate(self._slot_owner):
                if self._running[owner] or (owner in protect and not allow_protected):
                    continue
                self._release(owner)
                return slot
        return None

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        key = (dtype, self.inference_tensors)
        placeholder = self._placeholders.get(key)
        if placeholder is None:
            with torch.inference_mode(self.inference_tensors):
                placeholder = self._placeholders[key] = torch.empty(0, dtype=dtype, device=self.host_device)
        return placeholder

    def _point_at(self, index: int, views: Sequence[torch.Tensor]) -> None:
        # A normal parameter's .data may only be swapped outside inference_mode.
        with torch.inference_mode(params_are_inference(self._named_params[index])):
            for weight, view in zip(self.store.layouts[index].weights, views):
                point_param_at(weight.param, view)
        self._expected_pointers[index] = [weight_pointer(param) for _, param in self._named_params[index]]

    def _point_released(self, index: int) -> None:
        # Views made in the caller's mode (ComfyUI samples under inference_mode) would not fit the parameters.
        with torch.inference_mode(self.inference_tensors):
            self._point_released_views(index)

    def _point_released_views(self, index: int) -> None:
        if self.config.released_params == "host":
            views = self._view_cache.get(("host", index))
            if views is None:
                views = self._view_cache[("host", index)] = self.store.weight_views(index)
        else:
            # A subclass weight (quantized) cannot be an empty placeholder: it points at its host copy.
            layout = self.store.layouts[index]
            host = self.store.weight_views(index) if layout.has_subclass_weights else None
            views = [self._placeholder(layout.entries[w.parts[0]].dtype) if w.rebuild is None else host[i]
                     for i, w in enumerate(layout.weights)]
        self._point_at(index, views)

    def _drop_views(self, index: int) -> None:
        for key in [k for k in self._view_cache if k[1] == index]:
            del self._view_cache[key]

    def _release(self, index: int) -> None:
        if not self._materialized[index]:
            return
        self._point_released(index)
        self._materialized[index] = False
        self._pending_copy[index] = None
        self._hidden.discard(index)
        self._device_views.pop(index, None)
        slot = self._block_slot[index]
        if slot is not None:
            self._slot_owner[slot] = None
            self._slot_free[slot] = self.backend.mark_compute()
            self._block_slot[index] = None

    # ----------------------------------------------------------------- public release
    @_compiler_disable
    def release_layer(self, index: int, force: bool = False) -> bool:
        """Release one block. Residents stay unless ``force``; a forced resident gives its buffer back.

        Returns whether the block was released.
        """
        if not 0 <= index < self.num_blocks:
            raise IndexError(f"block index {index} is outside 0..{self.num_blocks - 1}")
        if not self._materialized[index]:
            return False
        if self.schedule is not None and self.schedule.resident[index] and not force:
            return False
        self._release(index)
        buffer = self._resident_buffers.pop(index, None)
        if buffer is not None:
            self.backend.synchronize()
            self._view_cache.pop(("resident", index), None)
        return True

    @_compiler_disable
    def release_all(self) -> None:
        """Release every block, residents included, and free every device byte the manager holds.

        Asked for inside a forward (a garbage-collected patcher's ``__del__`` can run at any allocation, even
        between two statements of a copy), the release waits for the end of that forward: done at once it
        would pull the slots from under the block being copied in.
        """
        if self._in_forward:
            self._release_after_forward = True
            return
        self._release_after_forward = False
        try:
            self.backend.synchronize()
            if self.store is not None:
                for index in range(self.num_blocks):
                    self._release(index)
            self.backend.settle(block=True)
            self._retire_bounce(wait=True)
        finally:
            # Even when a failed forward left the bookkeeping half-updated, nothing of it survives.
            self._reset_device_state()

    def _reset_device_state(self) -> None:
        self.schedule = None
        self._order = None
        self._materialized = [False] * self.num_blocks
        self._pending_copy = [None] * self.num_blocks
        self._block_slot: List[Optional[int]] = [None] * self.num_blocks
        self._running = [0] * self.num_blocks
        self._resident_buffers: Dict[int, torch.Tensor] = {}
        self._slots: List[torch.Tensor] = []
        self._slot_owner: List[Optional[int]] = []
        self._slot_free: List[object] = []
        self._view_cache: Dict[tuple, list] = {}
        self._device_views: Dict[int, list] = {}  # what a materialized block's parameters view on the device
        self._hidden: set = set()  # materialized blocks pointed at the host until their copy is waited for
        self._host_reads: Dict[int, object] = {}  # block -> the last copy queued from its host buffer

    def replan(self, **changes) -> None:
        """Change resident_layers / prefetch_size / policy; takes effect at the next forward."""
        config = dataclasses.replace(self.config, **changes)
        self.release_all()
        self.config = config

    @_compiler_disable
    def detach(self, device=None) -> None:
        """Give the blocks back as ordinary parameters on ``device`` (the host by default).

        Removes the hooks and frees the device slots and the host store; the parameter objects are
        the same ones the blocks had before the manager was made.
        """
        target = torch.device(device) if device is not None else self.host_device
        self.release_all()
        self.remove_hooks()
        if self.store is not None:
            self._drop_store(target)
        self._expected_pointers = [None] * self.num_blocks
        move_block_buffers(self.blocks, target)
        self._placeholders = {}

    def stats(self, synchronize: bool = True) -> OffloadStats:
        """A snapshot of the counters; ``synchronize`` waits for pending copy timings first."""
        self.backend.settle(block=synchronize)
        return snapshot(self, self.schedule or self._make_schedule())
