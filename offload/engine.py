"""The per-step engine of a layerwise offload: what the block hooks drive.

Blocks keep their parameter objects for life; only their data changes (``param.data``, or a swapped-in
quantized subclass). A block is *materialized* (parameters view a device buffer) or *released* (empty
placeholders, or host views). Resident blocks own a device buffer each and stay materialized across forwards;
streamed blocks share a ring of ``prefetch_size + 1`` device slots and are copied in one ahead of use. With
``streamed_tail_bytes`` a streamed block streams only its tail: its head has a device buffer of its own, copied
once like a resident's, and its parameters view the head and its slot.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, List, Optional, Sequence

import torch
from torch import nn

from .blocks.checks import move_block_buffers
from .blocks.params import BlockParameters
from .blocks.states import BlockStates
from .call_order import CallTracker
from .config import OffloadConfig
from .device.backend import make_backend
from .device.copier import BlockCopier
from .device.memory import DeviceMemory
from .geometry import BlockGeometry
from .hooks import BlockHooks, compiler_disable
from .host.environment import HostEnvironment
from .host.packing import HostStore
from .host.side import HostSide
from .mover import BlockMover
from .schedule import Schedule
from .stats import Counters


class BlockEngine:
    """Arms a plan (``config``) over ``blocks`` on ``device`` and runs it step by step: before each block, its copy
    waited for and the next ones started; after it, its slot given back. The hooks (``hooks``) drive it.

    Its parts: ``host`` (where the host copies live: RAM or disk, packing, pinning), ``params`` (what the parameters
    point at), ``geometry`` (the sizes it plans with), ``device_memory`` (resident buffers, heads and slots),
    ``states`` (each block's state on the device), ``copier`` (the copy and its transform), ``calls`` (the learned
    call order), ``counters``. No part points back at the engine: ComfyUI frees a model by reference count alone.
    """

    def __init__(self, blocks: Sequence[nn.Module], device: torch.device, config: OffloadConfig,
                 environment: Optional[HostEnvironment] = None, backend=None):
        self.blocks: List[nn.Module] = list(blocks)
        self.device = device
        self._config = config
        this = weakref.ref(self)
        self.host = HostSide(self.blocks, device, lambda: this().config, environment)
        self.params = BlockParameters(self.blocks)
        self.geometry = BlockGeometry(self.params, self.host)
        self._backend = backend or make_backend(device, config.measure_time)
        self.device_memory = DeviceMemory(device, self.num_blocks)
        self.copier = BlockCopier()
        self.calls = CallTracker()
        self.hooks = BlockHooks(self.blocks, self)
        self.counters = Counters(self.num_blocks)
        self.states = BlockStates(self.num_blocks)
        self.mover = BlockMover(self.host, self.params, self.device_memory, self.copier, self.states, self.counters,
                                self._backend)
        self.schedule: Optional[Schedule] = None
        self.reset_device_state()
        self._release_after_forward = False
        self._in_strict_call = False  # the strict loopback's model call: released blocks point at placeholders
        self.config = config  # and where the mover points released blocks

    @property
    def backend(self):
        """How copies reach the device (``device/backend.py``); one the tests swap in reaches the mover too."""
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        self._backend = self.mover.backend = backend

    @property
    def config(self) -> OffloadConfig:
        return self._config

    @config.setter
    def config(self, config: OffloadConfig) -> None:
        self._config = config
        self.mover.release_to_host = config.released_params == "host" and not self._in_strict_call

    @property
    def store(self) -> Optional[HostStore]:
        return self.host.store

    @property
    def inference_tensors(self) -> bool:
        """Whether the blocks' parameters (and so every buffer of ours) are inference tensors."""
        return self.host.inference_tensors

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def armed(self) -> bool:
        return self.schedule is not None

    def holds_device_memory(self) -> bool:
        """Armed, or holding what a replan kept for the next arming."""
        memory = self.device_memory
        return self.armed or bool(memory.residents) or bool(memory.slots)

    def make_schedule(self) -> Schedule:
        return Schedule.for_config(self.config, self.num_blocks)

    # ----------------------------------------------------------------- forwards and blocks
    @compiler_disable
    def begin_forward(self) -> None:
        self.counters.begin_forward()
        self.backend.settle(block=False)
        self.copier.retire_bounce()
        self.calls.begin()

    @compiler_disable
    def end_forward(self, completed: bool = True) -> None:
        """Close a forward: learn its call order (what it prefetched for the next one stays unpointed, see
        blocks/states.py)."""
        calls = self.calls.end(completed)
        self.counters.end_forward(calls, completed)
        if self._release_after_forward:
            self.release_all()

    # ----------------------------------------------------------------- the step
    @compiler_disable
    def before_block(self, index: int) -> None:
        if not self.armed:
            self.arm()
        self.calls.track(index)
        states = self.states
        if not states.materialized[index]:
            self.counters.demand_copies += 1
            self._materialize(index, protect=self._upcoming(index))
        handle = states.take_pending(index)
        if handle is not None:
            self.backend.wait_for_copy(handle)
        if states.head_pending:  # a streamed block's head copied by the arming: waited for once
            self.backend.wait_for_copy(states.head_pending.pop(index, None))
        views = states.to_point(index)
        if views is not None:  # copied in since it last ran: the wait for its bytes is queued now
            self.mover.point_at(index, views)
        states.running[index] += 1
        states.deferred[index] = self._prefetch_after(index, pageable=False)

    @compiler_disable
    def after_block(self, index: int) -> None:
        if self.schedule is not None and self.states.deferred[index]:  # copies the pass before the block left
            self.states.deferred[index] = False
            self._prefetch_after(index, pageable=True)
        running = self.states.running
        if running[index] > 0:
            running[index] -= 1
        if self.schedule is None or self.schedule.resident[index] or running[index] > 0:
            return
        window = self.calls.window(index, self.config.prefetch_size)
        # Called again within the look-ahead (VACE: once per context; or every streamed call fits in the slots):
        # its slot keeps it rather than copy it in again.
        if window is None or index not in window:
            self.mover.release(index)
            # Its slot is free now: the look-ahead may want this very block again (next forward). What _upcoming
            # would give now, the block released: the window read above, once each.
            self._prefetch_after(index, targets=None if window is None else list(dict.fromkeys(window)))

    def _upcoming(self, index: int) -> List[int]:
        """The streamed blocks to have on the device next, after the block ``index`` runs."""
        return self.calls.upcoming(index, self.config.prefetch_size, self.schedule, self.states.materialized[index])

    def _prefetch_after(self, index: int, pageable: Optional[bool] = None,
                        targets: Optional[List[int]] = None) -> bool:
        """Start the copies of the blocks to run next; ``pageable`` picks only the copies from pageable
        (True) or page-locked (False) host memory. A pageable copy is staged by the host and waits for the
        copy stream: issued before block ``index`` is launched it would leave the GPU idle, issued after it
        overlaps its compute. Returns whether some copy was left for later (of the other kind, or no free slot):
        the pass after the block runs is needed only then. ``targets``: :meth:`_upcoming`'s answer, when known."""
        if targets is None:
            targets = self._upcoming(index)
        materialized = self.states.materialized
        left = False
        for target in targets:
            if materialized[target]:
                continue
            if pageable is not None and self.mover.copy_is_pageable(target) != pageable:
                left = True
                continue
            if not self._materialize(target, protect=targets, may_fail=True):
                return True
        return left

    # ----------------------------------------------------------------- arming
    def _make_schedule(self) -> Schedule:
        return Schedule.for_config(self.config, self.num_blocks)

    @compiler_disable
    def arm(self) -> None:
        """Allocate what the plan's device memory lacks and queue the copies of the residents not on the device
        (by the first forward; after a replan that kept some residents, only the blocks that joined). All is
        allocated before the plan is published: out of memory leaves it unarmed, holding nothing."""
        if self.armed:
            return
        self.prepare()
        schedule = self.make_schedule()
        sizes = self.geometry.block_nbytes()
        plan = self.geometry.footprint(schedule, self.config)
        move_block_buffers(self.blocks, self.device)
        self.sync_pinning(schedule)
        memory = self.device_memory
        memory.inference = self.inference_tensors
        self.splits = self.geometry.splits(schedule, self.config)
        heads = [(i, split) for i, split in enumerate(self.splits) if split > 0]
        new_heads = [i for i, _ in heads if i not in memory.heads]
        try:
            allocated = memory.hold([(i, sizes[i]) for i in schedule.resident_blocks], plan.slot_count,
                                    plan.slot_size, self.backend.mark_compute, heads=heads)
        except BaseException:
            self.release_all()  # what a replan kept goes too: an unarmed manager holds nothing
            raise
        self.schedule = schedule
        self.calls.set_plan(schedule.resident)
        for index in schedule.resident_blocks:
            if not self.states.materialized[index]:
                self._materialize(index, after=allocated)
        for index in new_heads:
            self.mover.copy_head(index, self.splits[index], allocated)
        self.note_peaks()

    # ----------------------------------------------------------------- moves
    def _materialize(self, index: int, protect: Iterable[int] = (), may_fail: bool = False, after=None) -> bool:
        """Block ``index`` copied in as the plan says: into its resident buffer, or a slot with its tail."""
        host = self.host
        ahead = (self.calls.lookahead(index, self.config.prefetch_size + host.ring_size, self.schedule)
                 if host.reads_ahead(index) else ())
        return self.mover.copy_in(index, self.schedule.resident[index], self.splits[index], ahead, protect,
                                  may_fail, after)

    # ----------------------------------------------------------------- release
    @compiler_disable
    def release_all(self) -> None:
        """Release every block, residents included, and free every device byte the manager holds.

        Asked for inside a forward (a garbage-collected patcher's ``__del__`` can run at any allocation, even
        between two statements of a copy), the release waits for the end of that forward: done at once it
        would pull the slots from under the block being copied in.
        """
        if self.calls.in_forward:
            self._release_after_forward = True
            return
        self._release_after_forward = False
        try:
            self.backend.synchronize()
            if self.store is not None:
                for index in range(self.num_blocks):
                    self.mover.release(index)
            self.backend.settle(block=True)
            self.copier.retire_bounce(wait=True)
            self.host.settled()
        finally:
            # Even when a failed forward left the bookkeeping half-updated, nothing of it survives.
            self.reset_device_state()

    def reset_device_state(self) -> None:
        self.splits = [0] * self.num_blocks  # per block: where its streamed tail begins (0: streams whole)
        self.schedule = None
        self.calls.set_plan(None)
        self.device_memory.clear()
        self.states.clear()
        self.params.clear_views()

    def point_unpointed(self, at_host: bool) -> None:
        """The strict loopback (offload/strict.py): every block not pointed at its device copy to placeholders for a
        model call, or back to its host copy after it."""
        self._in_strict_call = not at_host
        self.config = self.config  # where released blocks point follows
        if self.store is None:
            return
        for index in range(self.num_blocks):
            if not self.states.pointed(index) and self.store.buffers[index] is not None:
                self.mover.point_released(index)

    def sync_pinning(self, schedule: Optional[Schedule] = None) -> None:
        schedule = schedule or self.schedule or self.make_schedule()
        self.host.sync_pinning(self.backend, schedule.streamed_blocks)

    def note_peaks(self, reset: bool = False) -> None:
        self.mover.note_peaks(reset)

    # ----------------------------------------------------------------- the host copies
    def prepare(self, progress: Optional[Callable[[int, int], None]] = None) -> List[int]:
        """Pack the blocks whose host copies are missing or outdated (parameters replaced or moved by someone else:
        a LoRA bake swapping Parameter objects, a whole-model ``.to()``); returns their indices. What is on the
        device is released first: it was copied from what changed."""
        changed = self.host.outdated(self.params)
        if changed and self.holds_device_memory():
            self.release_all()
        self.pack(changed, progress)
        return changed

    def pack(self, indices: Sequence[int], progress=None) -> None:
        def packed(index: int) -> None:
            self.states.released(index)
            self.mover.point_released(index)  # ComfyUI's copy of the block is freed here
        self.host.pack(indices, self.params, packed, progress)
        if indices:
            self.sync_pinning()
