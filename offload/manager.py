"""The face of a layerwise offload: what its users call (the nodes, the public verb, bench/).

It plans, applies a plan, releases and reports; the per-step work the block hooks drive is the engine's
(engine.py), one block's copy the mover's (mover.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from .blocks.checks import move_block_buffers
from .config import OffloadConfig
from .device.backend import normalize_device
from .device.copier import BlockTransform
from .engine import BlockEngine
from .host.environment import HostEnvironment
from .host.packing import HostStore
from .replan import keep_what_stays
from .schedule import Schedule
from .stats import OffloadStats, host_figures
from .strict import strict_loopback


class LayerwiseOffloadManager:
    """Keeps the leading (or strided) blocks on ``device`` and streams the rest from host memory.

    Args:
        blocks: the transformer blocks, several lists joined in the order the model runs them; residency
            follows this order, prefetch the order each forward really ran (see call_order.py).
        device: the compute device. ``cpu`` runs the same code path synchronously (CPU loopback).
        config: the plan, an :class:`OffloadConfig`; keyword arguments override its fields. :meth:`apply` changes it.
        environment: what the machine provides (:class:`HostEnvironment`: pinner, pin cap, free-RAM probe, disk
            folder), fixed for the manager's life; by default the device's pinner and the OS's figures.
        backend: how copies reach the device (``device/backend.py``); by default the device's own. The tests'
            stand-ins for a GPU pass a recording one here.

    Lifecycle: ``attach()`` installs the hooks; the first block forward arms the plan (host store,
    device slots, resident copies); ``release_all()`` returns every device byte; ``apply()`` changes the plan;
    ``detach()`` gives the blocks back as ordinary parameters.
    """

    def __init__(self, blocks: Sequence[nn.Module], device, config: Optional[OffloadConfig] = None,
                 environment: Optional[HostEnvironment] = None, backend=None, **overrides):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("LayerwiseOffloadManager needs at least one block to manage")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("the same module appears twice in the block list; pass each block once")
        config = dataclasses.replace(config or OffloadConfig(), **overrides)
        config.tail_caps(len(blocks))  # one cap per block, or one for all
        self.engine = BlockEngine(blocks, normalize_device(torch.device(device)), config, environment, backend)
        self.host_device = torch.device("cpu")

    # ----------------------------------------------------------------- the plan and its figures
    @property
    def blocks(self) -> List[nn.Module]:
        return self.engine.blocks

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def config(self) -> OffloadConfig:
        """The plan applied: what the next forward arms."""
        return self.engine.config

    @property
    def num_blocks(self) -> int:
        return self.engine.num_blocks

    @property
    def store(self) -> Optional[HostStore]:
        return self.engine.store

    @property
    def schedule(self) -> Optional[Schedule]:
        """The armed plan's schedule (None until the next forward arms it)."""
        return self.engine.schedule

    @property
    def armed(self) -> bool:
        return self.engine.armed

    @property
    def pin_memory(self) -> bool:
        return self.engine.host.pin_memory

    def is_materialized(self, index: int) -> bool:
        return self.engine.states.materialized[index]

    def points_at_device(self, index: int) -> bool:
        """Whether block ``index``'s parameters view its device copy: materialized, and run (or waited for) since it
        was copied in. A block copied in ahead of its run points at its host copy until its pre-hook."""
        return self.engine.states.pointed(index)

    def materialized_blocks(self) -> List[int]:
        return self.engine.states.materialized_blocks()

    def block_nbytes(self) -> List[int]:
        """Bytes each block occupies on the device once materialized."""
        return self.engine.geometry.block_nbytes()

    def tail_options(self) -> List[tuple]:
        """Per block, the sizes its streamed tail can have (see :meth:`BlockGeometry.tail_options`)."""
        return self.engine.geometry.tail_options()

    def block_tails(self, config: Optional[OffloadConfig] = None) -> Optional[List[int]]:
        """Per block, the bytes it streams when it streams under ``config`` (the manager's by default); None where
        every streamed block streams whole."""
        return self.engine.geometry.block_tails(config or self.config)

    def device_bytes(self, plan: Optional[OffloadConfig] = None) -> int:
        """The device bytes the manager holds now; given a ``plan``, those that plan holds once armed (resident
        buffers, streamed blocks' heads, streaming slots)."""
        engine = self.engine
        if plan is None:
            return engine.device_memory.nbytes()
        return engine.geometry.footprint(Schedule.for_config(plan, self.num_blocks), plan).total

    # ----------------------------------------------------------------- apply, run, release
    def attach(self, root: Optional[nn.Module] = None) -> "LayerwiseOffloadManager":
        """Install the block hooks (and forward-scope hooks on ``root``, if given). Idempotent."""
        self.engine.hooks.attach(root)
        return self

    def apply(self, config: OffloadConfig) -> None:
        """Make ``config`` the plan; it takes effect at the next forward.

        A change of the resident set alone (``resident_layers``, ``policy``, ``streamed_tail_bytes``) moves only
        the blocks whose place changes: a resident that stays keeps its device buffer and views and is never copied
        again, a block that leaves the set is released and its buffer freed now, a block that joins it is copied in
        when the next forward arms the plan. The slot ring stays unless its geometry (``prefetch_size + 1`` slots of
        the largest streamed block) changes, and with it the streamed blocks it holds. Any other change
        (``prefetch_size``, ``pin_memory``, ``host_store``, ...) releases every device byte (:meth:`release_all`),
        as does a plan applied inside a forward (after that forward).
        """
        engine = self.engine
        if config == engine.config:
            return
        config.tail_caps(self.num_blocks)
        changed = {f.name for f in dataclasses.fields(config)
                   if getattr(config, f.name) != getattr(engine.config, f.name)}
        if changed <= self.RESIDENCY_SETTINGS and not engine.calls.in_forward:
            keep_what_stays(engine, config)
        else:
            engine.release_all()
        engine.config = config

    RESIDENCY_SETTINGS = frozenset({"resident_layers", "policy", "streamed_tail_bytes"})

    def replan(self, **changes) -> None:
        """:meth:`apply` the plan with ``changes`` (:class:`OffloadConfig` fields)."""
        self.apply(dataclasses.replace(self.config, **changes))

    @contextmanager
    def running(self):
        """One model call under the plan, for a caller that installs no forward-scope hooks (``attach()`` without
        a root): armed first (every device byte allocated before the model runs, so a recorder of the call's
        allocations never sees ours), the block hooks installed and active, the call counted as one forward."""
        engine = self.engine
        engine.arm()
        self.attach()
        engine.hooks.active = True
        strict = self.device.type == "cpu" and self.config.released_params == "host" and strict_loopback()
        try:
            if strict:
                engine.point_unpointed(at_host=False)
            with engine.hooks.forward_scope():
                yield self
        finally:
            engine.hooks.active = False
            if strict:
                engine.point_unpointed(at_host=True)

    def release_all(self, remove_hooks: bool = False) -> None:
        """Release every block, residents included, and free every device byte the manager holds (inside a
        forward: at its end); ``remove_hooks`` also takes the hooks off (the next :meth:`running` installs them)."""
        self.engine.release_all()
        if remove_hooks:
            self.engine.hooks.remove()

    def detach(self, device=None) -> None:
        """Give the blocks back as ordinary parameters on ``device`` (the host by default).

        Removes the hooks and frees the device slots and the host store; the parameter objects are
        the same ones the blocks had before the manager was made.
        """
        engine = self.engine
        target = torch.device(device) if device is not None else self.host_device
        engine.release_all()
        engine.hooks.remove()
        if engine.store is not None:
            engine.host.give_back(engine.params, target)
        engine.params.let_go()
        move_block_buffers(engine.blocks, target)

    # ----------------------------------------------------------------- the host copies
    def prepare(self, progress: Optional[Callable[[int, int], None]] = None, repack: Sequence[int] = ()) -> List[int]:
        """Build the host store from the blocks' current parameters, or bring it up to date; returns the blocks
        packed again.

        The first call packs every block. Later calls repack only blocks whose parameters were replaced or moved by
        someone else (a LoRA bake swapping Parameter objects, a whole-model ``.to()``), and the blocks in ``repack``
        (new values in the same parameters). ``progress(done, total)`` is called after each packed block.
        """
        engine = self.engine
        if not repack or engine.store is None:
            return engine.prepare(progress)
        if engine.holds_device_memory():
            engine.release_all()
        engine.pack(list(repack), progress)
        return list(repack)

    def host_buffers(self) -> List[Optional[torch.Tensor]]:
        """Each block's host buffer (None before it is packed); a disk block's is its file's placeholder."""
        return list(self.store.buffers) if self.store is not None else []

    def host_weight_views(self, index: int) -> List[torch.Tensor]:
        """Block ``index``'s weights as views of its host copy, in the order of its parameters."""
        return self.store.weight_views(index)

    def shortfall(self, config: Optional[OffloadConfig] = None, settings: Optional[str] = None) -> Optional[str]:
        """Why packing the blocks not in the host store yet would fail for want of host memory, or None (see
        :meth:`HostSide.shortfall`). ``config``: plan under that caller's settings instead of the manager's (a
        manager may be shared, and still hold another caller's); ``settings`` names them in the message."""
        return self.engine.host.shortfall(settings, (config or self.config).host_store)

    # ----------------------------------------------------------------- transform and report
    @property
    def after_copy(self) -> Optional[BlockTransform]:
        """The transform applied to each block copied to the device (None: plain copies). Blocks on the device were
        copied with the old one, so setting another releases them (residents included); the next forward copies
        them again."""
        return self.engine.copier.transform

    @after_copy.setter
    def after_copy(self, transform: Optional[BlockTransform]) -> None:
        engine = self.engine
        if transform is engine.copier.transform:
            return
        if engine.store is not None:
            engine.release_all()
        engine.copier.transform = transform

    def stats(self, synchronize: bool = True, reset_peaks: bool = False) -> OffloadStats:
        """A snapshot of the counters and the plan (the armed one, else the one the next forward arms);
        ``synchronize`` waits for pending copy timings first; ``reset_peaks`` starts the peak counters again from
        what is held now, before the snapshot (a run's start)."""
        engine = self.engine
        if reset_peaks:
            engine.note_peaks(reset=True)
        engine.backend.settle(block=synchronize)
        schedule = engine.schedule or engine.make_schedule()
        plan = engine.geometry.footprint(schedule, self.config)
        host_tiers = engine.host.tiers()
        disk, tier_plan = engine.host.disk, getattr(engine.host, "tier_plan", None)
        return OffloadStats(
            num_blocks=self.num_blocks,
            resident_blocks=len(schedule.resident_blocks),
            streamed_blocks=len(schedule.streamed_blocks),
            materialized_blocks=len(self.materialized_blocks()),
            resident_bytes=engine.device_memory.resident_bytes(),
            device_bytes=self.device_bytes(),
            planned_device_bytes=plan.total,
            block_nbytes=tuple(self.block_nbytes()),
            host_ram_bytes=engine.geometry.host_ram_bytes(disk.ring_bytes if disk is not None else 0),
            host_tier_reason=tier_plan.reason if tier_plan is not None else "",
            copy_seconds=engine.backend.copy_seconds,
            stall_seconds=engine.backend.stall_seconds,
            block_tiers=tuple("resident" if schedule.resident[i] else host_tiers[i] for i in range(self.num_blocks)),
            slot_count=plan.slot_count,
            asynchronous=engine.backend.asynchronous,
            head_bytes=engine.device_memory.head_bytes(),
            streamed_tail_bytes=self.config.streamed_tail_bytes,
            **engine.counters.figures(),
            **host_figures(engine.store, engine.host.disk),
        )
