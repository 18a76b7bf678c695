"""The resident layerwise offload manager.

Blocks keep their parameter objects for life; only their data changes (``param.data``, or a swapped-in
quantized subclass). A block is *materialized* (parameters view a device buffer) or *released* (empty
placeholders, or host views). Resident blocks own a device buffer each and stay materialized across forwards;
streamed blocks share a ring of ``prefetch_size + 1`` device slots and are copied in one ahead of use. With
``streamed_tail_bytes`` a streamed block streams only its tail: its head has a device buffer of its own, copied
once like a resident's, and its parameters view the head and its slot.
"""

from __future__ import annotations

import dataclasses
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable, List, Optional, Sequence

import torch
from torch import nn

from .blocks.checks import move_block_buffers
from .device.copier import BlockCopier, BlockTransform
from .blocks.params import BlockParameters
from .blocks.states import BlockStates
from .call_order import CallTracker
from .config import OffloadConfig
from .device.backend import make_backend, normalize_device
from .device.memory import DeviceMemory
from .geometry import BlockGeometry
from .hooks import BlockHooks, compiler_disable
from .host.environment import HostEnvironment
from .host.side import HostSide
from .host.packing import HostStore
from .schedule import Schedule
from .stats import Counters, OffloadStats, host_figures
from .strict import strict_loopback



class LayerwiseOffloadManager:
    """Keeps the leading (or strided) blocks on ``device`` and streams the rest from host memory.

    Args:
        blocks: the transformer blocks, several lists joined in the order the model runs them; residency
            follows this order, prefetch the order each forward really ran (see call_order.py).
        device: the compute device. ``cpu`` runs the same code path synchronously (CPU loopback).
        config: an :class:`OffloadConfig`; keyword arguments override its fields. The manager is its only
            holder: :meth:`replan` changes it.
        environment: what the machine provides (:class:`HostEnvironment`: pinner, pin cap, free-RAM probe, disk
            folder), fixed for the manager's life; by default the device's pinner and the OS's figures.
        backend: how copies reach the device (``device/backend.py``); by default the device's own. The tests'
            stand-ins for a GPU and the timing model pass a recording one here.

    Lifecycle: ``attach()`` installs the hooks; the first block forward arms the plan (host store,
    device slots, resident copies); ``release_all()`` returns every device byte; ``replan()``
    changes the plan; ``detach()`` gives the blocks back as ordinary parameters.

    The manager owns the plan and drives the step; its parts own the rest: ``host`` (where the host copies
    live: RAM or disk, packing, pinning), ``params`` (what the parameters point at), ``device_memory`` (resident
    buffers and slots), ``states`` (each block's state on the device), ``copier`` (the copy and its
    transform), ``calls`` (the learned call order), ``hooks`` and ``counters``.
    """

    def __init__(self, blocks: Sequence[nn.Module], device, config: Optional[OffloadConfig] = None,
                 environment: Optional[HostEnvironment] = None, backend=None, **overrides):
        self.blocks: List[nn.Module] = list(blocks)
        if not self.blocks:
            raise ValueError("LayerwiseOffloadManager needs at least one block to manage")
        if len({id(b) for b in self.blocks}) != len(self.blocks):
            raise ValueError("the same module appears twice in the block list; pass each block once")
        self.device = normalize_device(torch.device(device))
        self.host_device = torch.device("cpu")
        self.config: OffloadConfig = dataclasses.replace(config or OffloadConfig(), **overrides)
        self.config.tail_caps(len(self.blocks))  # one cap per block, or one for all
        # Read through a weak reference: no part may point back at the manager, which ComfyUI frees by reference
        # count alone (tests/unit/test_host_side.py).
        this = weakref.ref(self)
        self.host = HostSide(self.blocks, self.device, lambda: this().config, environment)
        self.params = BlockParameters(self.blocks)
        self.geometry = BlockGeometry(self.params, self.host)
        self.backend = backend or make_backend(self.device, self.config.measure_time)
        self.device_memory = DeviceMemory(self.device, self.num_blocks)
        self.copier = BlockCopier()
        self.calls = CallTracker()
        self.hooks = BlockHooks(self.blocks, self)
        self.counters = Counters(self.num_blocks)
        self.states = BlockStates(self.num_blocks)
        self.schedule: Optional[Schedule] = None
        self._reset_device_state()
        self._release_after_forward = False
        self._in_strict_call = False  # the strict loopback's model call: released blocks point at placeholders

    # ----------------------------------------------------------------- state
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

    def _holds_device_memory(self) -> bool:
        """Armed, or holding what a replan kept for the next arming."""
        memory = self.device_memory
        return self.armed or bool(memory.residents) or bool(memory.slots)

    @property
    def pin_memory(self) -> bool:
        return self.host.pin_memory

    def is_materialized(self, index: int) -> bool:
        return self.states.materialized[index]

    def points_at_device(self, index: int) -> bool:
        """Whether block ``index``'s parameters view its device copy: materialized, and run (or waited for) since it
        was copied in. A block copied in ahead of its run points at its host copy until its pre-hook."""
        return self.states.pointed(index)

    def materialized_blocks(self) -> List[int]:
        return self.states.materialized_blocks()

    def resident_count(self) -> int:
        return self.config.resident_count(self.num_blocks)

    def block_nbytes(self) -> List[int]:
        """Bytes each block occupies on the device once materialized."""
        return self.geometry.block_nbytes()

    def tail_options(self) -> List[tuple]:
        """Per block, the sizes its streamed tail can have (see :meth:`BlockGeometry.tail_options`)."""
        return self.geometry.tail_options()

    def block_tails(self, config: Optional[OffloadConfig] = None) -> Optional[List[int]]:
        """Per block, the bytes it streams when it streams under ``config`` (the manager's by default); None where
        every streamed block streams whole."""
        return self.geometry.block_tails(config or self.config)

    def planned_device_bytes(self, schedule: Optional[Schedule] = None) -> int:
        """The device bytes the plan holds once armed: resident buffers, streamed blocks' heads, streaming slots."""
        return self.geometry.footprint(schedule or self.schedule or self._make_schedule(), self.config).total

    def device_bytes(self) -> int:
        return self.device_memory.nbytes()

    # ----------------------------------------------------------------- hooks and forwards
    def attach(self, root: Optional[nn.Module] = None) -> "LayerwiseOffloadManager":
        """Install the block hooks (and forward-scope hooks on ``root``, if given). Idempotent."""
        self.hooks.attach(root)
        return self

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
            self._point_at(index, views)
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
            self._release(index)
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
            if pageable is not None and self._copy_is_pageable(target) != pageable:
                left = True
                continue
            if not self._materialize(target, protect=targets, may_fail=True):
                return True
        return left

    def _copy_is_pageable(self, index: int) -> bool:
        return self.backend.asynchronous and self.host.pageable(index)

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
        schedule = self._make_schedule()
        sizes = self.block_nbytes()
        plan = self.geometry.footprint(schedule, self.config)
        move_block_buffers(self.blocks, self.device)
        self._sync_pinning(schedule)
        memory = self.device_memory
        memory.inference = self.inference_tensors
        self._splits = self.geometry.splits(schedule, self.config)
        heads = [(i, split) for i, split in enumerate(self._splits) if split > 0]
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
            self._copy_head(index, allocated)
        self._note_peaks()

    # ----------------------------------------------------------------- copies
    def _materialize(self, index: int, protect: Iterable[int] = (), may_fail: bool = False, after=None) -> bool:
        # Buffers and views are of the parameters' kind (see HostSide._restart): normal views made under
        # inference_mode would be unusable by autograd later, normal data in an inference parameter fails.
        inference = self.inference_tensors
        if torch.is_inference_mode_enabled() == inference:  # entering the mode costs more than the rest of a copy
            return self._copy_block_in(index, protect, may_fail, after)
        with torch.inference_mode(inference):
            return self._copy_block_in(index, protect, may_fail, after)

    def _copy_block_in(self, index: int, protect: Iterable[int], may_fail: bool, after) -> bool:
        """Give block ``index`` its device buffer (its own, or a slot), queue its copy, point it there."""
        layout = self.store.layouts[index]
        memory = self.device_memory
        split = 0
        if self.schedule.resident[index]:
            buffer, fresh = memory.resident(index, layout.nbytes)
            if fresh:  # a forced release gave the buffer back: it is new memory
                after = self.backend.mark_compute()
            key = ("resident", index)
        else:
            slot = memory.acquire(protect, not may_fail, self.states.running, self._release)
            if slot is None:
                if may_fail:
                    return False
                raise RuntimeError(
                    f"[layerwise-offload] no free device slot for block {index}: every slot holds a running "
                    f"block; raise prefetch_size or check for re-entrant block calls")
            buffer, after = memory.take(slot, index)
            key = (slot, index)
            split = self._splits[index]
        if split:  # the head stays in its own buffer: the tail is what streams
            head = memory.heads[index]
            views = self.params.views(key, lambda: layout.weight_views(head, buffer, split), layout)
        else:
            views = self.params.views(key, lambda: layout.weight_views(buffer), layout)
        destination = views.destination
        if destination is None:
            destination = views.destination = buffer.narrow(0, 0, layout.nbytes - split)
        host = self.host
        if host.reads_ahead(index):
            ahead = self.calls.lookahead(index, self.config.prefetch_size + host.ring_size, self.schedule)
        else:
            ahead = ()
        source = host.source(index, ahead)
        if split:  # a RAM block (a disk block streams whole); made once per host buffer
            tail = views.source
            if tail is None or tail.data_ptr() != source.data_ptr() + split:
                tail = views.source = source.narrow(0, split, layout.nbytes - split)
            source = tail
        bounce = (host.pinner if self.schedule.resident[index] and self.pin_memory
                  and self._copy_is_pageable(index) else None)
        written = layout.weights_in_tail(split) if split and self.copier.transform is not None else None
        handle = self.copier.copy(self.backend, index, destination, source, after, views, bounce_pinner=bounce,
                                  written=written)
        self.host.copied(index, handle)
        self.states.copied_in(index, views, handle)
        self.counters.count_copy(index, layout.nbytes - split, resident=self.schedule.resident[index])
        self._note_peaks()
        return True

    def _copy_head(self, index: int, after) -> None:
        """Queue the copy of streamed block ``index``'s head into its own buffer (once per arming, like a resident's
        copy, the transform on its weights); the block's first run waits for it."""
        inference = self.inference_tensors
        with torch.inference_mode(inference):
            layout, split = self.store.layouts[index], self._splits[index]
            head = self.device_memory.heads[index]
            in_head = tuple(not tail for tail in layout.weights_in_tail(split))
            weights = layout.head_weight_views(head, split) if self.copier.transform is not None else ()
            source = self.host.source(index).narrow(0, 0, split)
            bounce = self.host.pinner if self.pin_memory and self._copy_is_pageable(index) else None
            handle = self.copier.copy(self.backend, index, head, source, after, weights, bounce_pinner=bounce,
                                      written=in_head)
            self.host.copied(index, handle)
            self.states.head_pending[index] = handle
            self.counters.count_copy(index, split, resident=True)

    def _point_at(self, index: int, views: Sequence[torch.Tensor]) -> None:
        self.params.point_at(index, self.store.layouts[index], views)

    def _point_released(self, index: int) -> None:
        at_host = self.config.released_params == "host" and not self._in_strict_call
        self.params.point_released(index, self.store, at_host, self.inference_tensors)

    def _release(self, index: int) -> None:
        if not self.states.materialized[index]:
            return
        unwaited = self.states.take_pending(index)
        self._point_released(index)
        self.states.released(index)
        if unwaited is not None and self.copier.transform is not None:
            # Evicted before it ran: its after-copy transform may still write the slot on its own stream, and the
            # slot's next copy waits only for the compute stream's mark. Order that mark after the transform.
            self.backend.order_compute_after(unwaited)
        self.device_memory.give_back(index, self.backend.mark_compute)

    # ----------------------------------------------------------------- public release
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
                    self._release(index)
            self.backend.settle(block=True)
            self.copier.retire_bounce(wait=True)
            self.host.settled()
        finally:
            # Even when a failed forward left the bookkeeping half-updated, nothing of it survives.
            self._reset_device_state()

    def _reset_device_state(self) -> None:
        self._splits = [0] * self.num_blocks  # per block: where its streamed tail begins (0: streams whole)
        self.schedule = None
        self.calls.set_plan(None)
        self.device_memory.clear()
        self.states.clear()
        self.params.clear_views()

    def replan(self, **changes) -> None:
        """Change the settings (:class:`OffloadConfig` fields); takes effect at the next forward.

        A change of the resident set alone (``resident_layers``, ``policy``) moves only the blocks whose membership
        changed: a resident that stays keeps its device buffer and views and is never copied again, a block that
        leaves the set is released and its buffer freed now, a block that joins it is copied in when the next
        forward arms the plan. The slot ring stays unless its geometry (``prefetch_size + 1`` slots of the largest
        streamed block) changes, and with it the streamed blocks it holds. Any other change (``prefetch_size``,
        ``pin_memory``, ``host_store``, ...) releases every device byte (:meth:`release_all`), as does a replan
        asked for inside a forward (after that forward).
        """
        config = dataclasses.replace(self.config, **changes)
        config.tail_caps(self.num_blocks)
        changed = {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(self.config, f.name)}
        if changed <= self.RESIDENCY_SETTINGS and not self.calls.in_forward:
            self._keep_what_stays(config)
        else:
            self.release_all()
        self.config = config

    RESIDENCY_SETTINGS = frozenset({"resident_layers", "policy", "streamed_tail_bytes"})

    @compiler_disable
    def _keep_what_stays(self, config: OffloadConfig) -> None:
        """Release what the plan under ``config`` no longer holds where it is now; unarm, so that the next forward
        arms that plan over what stayed (see :meth:`replan`)."""
        memory, states = self.device_memory, self.states
        if self.store is None or not self._holds_device_memory():
            self._reset_device_state()
            return
        try:
            schedule = Schedule.for_config(config, self.num_blocks)
            ring = self.geometry.footprint(schedule, config)
            keep_ring = memory.ring_is(ring.slot_count, ring.slot_size)
            splits = self.geometry.splits(schedule, config)
            for index in range(self.num_blocks):
                resident = index in memory.residents
                if resident and schedule.resident[index]:
                    continue  # stays, copied and pointed as it is
                split_changed = splits[index] != self._splits[index]
                if index in memory.heads and split_changed:  # its head is freed (another split, or now resident)
                    self.backend.wait_host(states.head_pending.pop(index, None))
                    if states.materialized[index]:
                        self.backend.wait_host(states.take_pending(index))
                        self._release(index)
                    memory.drop_head(index)
                    self.params.drop_views(index)
                if resident or (states.materialized[index] and (schedule.resident[index] or not keep_ring
                                                                or split_changed)):
                    # Its memory is freed or changes hands: a copy into it nobody waited for must be done first.
                    self.backend.wait_host(states.take_pending(index))
                    self._release(index)
                    if resident:
                        memory.drop_resident(index)
                        self.params.drop_device_views(index)
            if not keep_ring:
                memory.drop_ring()
                self.params.drop_device_views()
            self.schedule = None
            self.calls.set_plan(None)
        except BaseException:
            self.release_all()
            raise

    @compiler_disable
    def detach(self, device=None) -> None:
        """Give the blocks back as ordinary parameters on ``device`` (the host by default).

        Removes the hooks and frees the device slots and the host store; the parameter objects are
        the same ones the blocks had before the manager was made.
        """
        target = torch.device(device) if device is not None else self.host_device
        self.release_all()
        self.hooks.remove()
        if self.store is not None:
            self.host.give_back(self.params, target)
        self.params.let_go()
        move_block_buffers(self.blocks, target)

    def stats(self, synchronize: bool = True) -> OffloadStats:
        """A snapshot of the counters and the plan (the armed one, else the one the next forward arms);
        ``synchronize`` waits for pending copy timings first."""
        self.backend.settle(block=synchronize)
        schedule = self.schedule or self._make_schedule()
        plan = self.geometry.footprint(schedule, self.config)
        host_tiers = self.host.tiers()
        return OffloadStats(
            num_blocks=self.num_blocks,
            resident_blocks=len(schedule.resident_blocks),
            streamed_blocks=len(schedule.streamed_blocks),
            materialized_blocks=len(self.materialized_blocks()),
            resident_bytes=self.device_memory.resident_bytes(),
            device_bytes=self.device_bytes(),
            planned_device_bytes=plan.total,
            copy_seconds=self.backend.copy_seconds,
            stall_seconds=self.backend.stall_seconds,
            block_tiers=tuple("resident" if schedule.resident[i] else host_tiers[i] for i in range(self.num_blocks)),
            slot_count=plan.slot_count,
            asynchronous=self.backend.asynchronous,
            head_bytes=self.device_memory.head_bytes(),
            streamed_tail_bytes=self.config.streamed_tail_bytes,
            **self.counters.figures(),
            **host_figures(self.store, self.host.disk),
        )

    def host_ram_bytes(self) -> int:
        """Host RAM the blocks hold: each block in the RAM tier (packed, or not yet), and the disk tier's
        staging ring (a block in the disk tier holds nothing else)."""
        disk = self.host.disk
        return self.geometry.host_ram_bytes(disk.ring_bytes if disk is not None else 0)

    def shortfall(self, config: Optional[OffloadConfig] = None, settings: Optional[str] = None) -> Optional[str]:
        """Why packing the blocks not in the host store yet would fail for want of host memory, or None (see
        :meth:`HostSide.shortfall`). ``config``: plan under that caller's settings instead of the manager's (a
        manager may be shared, and still hold another caller's); ``settings`` names them in the message."""
        return self.host.shortfall(settings, (config or self.config).host_store)

    @property
    def after_copy(self) -> Optional[BlockTransform]:
        """The transform applied to each block copied in (:meth:`set_after_copy`), or None."""
        return self.copier.transform

    def host_buffers(self) -> List[Optional[torch.Tensor]]:
        """Each block's host buffer (None before it is packed); a disk block's is its file's placeholder."""
        return list(self.store.buffers) if self.store is not None else []

    def host_weight_views(self, index: int) -> List[torch.Tensor]:
        """Block ``index``'s weights as views of its host copy, in the order of its parameters."""
        return self.store.weight_views(index)

    @contextmanager
    def running(self):
        """One model call under the plan, for a caller that installs no forward-scope hooks (``attach()`` without
        a root): armed first (every device byte allocated before the model runs, so a recorder of the call's
        allocations never sees ours), the block hooks installed and active, the call counted as one forward."""
        self.arm()
        self.attach()
        self.hooks.active = True
        strict = self.device.type == "cpu" and self.config.released_params == "host" and strict_loopback()
        try:
            if strict:
                self._point_unpointed(at_host=False)
            with self.hooks.forward_scope():
                yield self
        finally:
            self.hooks.active = False
            if strict:
                self._point_unpointed(at_host=True)

    def _point_unpointed(self, at_host: bool) -> None:
        """The strict loopback (offload/strict.py): every block not pointed at its device copy to placeholders for a
        model call, or back to its host copy after it."""
        self._in_strict_call = not at_host
        if self.store is None:
            return
        for index in range(self.num_blocks):
            if not self.states.pointed(index) and self.store.buffers[index] is not None:
                self._point_released(index)

    def unload(self) -> None:
        """Release every device byte and remove the hooks (the next :meth:`running` installs them again)."""
        self.release_all()
        self.hooks.remove()

    # ----------------------------------------------------------------- the host copies
    def prepare(self, progress: Optional[Callable[[int, int], None]] = None) -> List[int]:
        """Build the host store from the blocks' current parameters, or bring it up to date.

        The first call packs every block. Later calls repack only blocks whose parameters were
        replaced or moved by someone else (a LoRA bake swapping Parameter objects, a whole-model
        ``.to()``), and return their indices. ``progress(done, total)`` is called after each packed block.
        """
        changed = self.host.outdated(self.params)
        if changed and self._holds_device_memory():
            self.release_all()
        self._pack(changed, progress)
        return changed

    def repack_block(self, index: int) -> None:
        """Re-read one block's parameters (new objects or new values) into the host store."""
        if self._holds_device_memory():
            self.release_all()
        if self.store is None:
            self.prepare()
        else:
            self._pack([index])

    def _pack(self, indices: Sequence[int], progress=None) -> None:
        def packed(index: int) -> None:
            self.states.released(index)
            self._point_released(index)  # ComfyUI's copy of the block is freed here
        self.host.pack(indices, self.params, packed, progress)
        if indices:
            self._sync_pinning()

    def _sync_pinning(self, schedule: Optional[Schedule] = None) -> None:
        schedule = schedule or self.schedule or self._make_schedule()
        self.host.sync_pinning(self.backend, schedule.streamed_blocks)

    # ----------------------------------------------------------------- transform and counters
    def set_after_copy(self, transform: Optional[BlockTransform]) -> None:
        """Apply ``transform`` to every block copied to the device from now on (None: plain copies).

        Blocks on the device were copied with the old transform, so a different one releases them
        (residents included); the next forward copies them again.
        """
        if transform is self.copier.transform:
            return
        if self.store is not None:
            self.release_all()
        self.copier.transform = transform

    def reset_peaks(self) -> None:
        """Start the peak counters (materialized blocks, device bytes) again from what is held now."""
        self.counters.note_peaks(self.states.count, self.device_bytes(), reset=True)

    def _note_peaks(self) -> None:
        self.counters.note_peaks(self.states.count, self.device_bytes())
