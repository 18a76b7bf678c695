"""Planning the host tiers: which blocks' host copies go to RAM and which to disk, what packing them costs, and
the refusals for want of host RAM, from the RAM free to this process and the disk's read rate."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..disk import tier as disk_tier
from ..disk.budget import (PACKING_SLACK_BYTES, RAM_MARGIN_BYTES, TierPlan, freed_by_packing, plan_host_tiers,
                          refusal)
from ..disk.cache_file import disk_tier_unsupported
from ..disk.checkpoint import locate
from ..disk.mappings import MappedFiles
from ..disk.read_rate import disk_read_rate
from ..disk.tier import CHUNK_BYTES, staging_ring_bytes
from ..formatting import format_mib
from ..memory.ram import available_host_bytes
from .environment import HostEnvironment
from .packing import block_parameters, plan_layout
from .tiers import HostTier


class TierPlanner:
    """Plans the host tiers of ``blocks``: ``settings()`` reads the manager's config, which only the manager holds
    (host_store; the rest names the settings in a refusal); ``environment`` is what the machine provides.

    Which blocks are on disk now is the host side's to say: each call is given its disk tier (``disk``; None: no
    block on disk), and each that may refuse the pin_memory in force (``pin_memory``), which the refusal names.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], settings: Callable[[], Any],
                 environment: HostEnvironment):
        self.blocks = blocks
        self._settings = settings
        self.environment = environment

    @property
    def ring_size(self) -> int:
        """The disk tier's staging chunks (:data:`~..disk.tier.STAGING_CHUNKS`): a fixed few, whatever the block
        size or prefetch_size."""
        return disk_tier.STAGING_CHUNKS

    def plan(self, waiting: Sequence[int], mode: Optional[str] = None, mapped_files: Optional[MappedFiles] = None,
             disk: Optional[HostTier] = None) -> TierPlan:
        """Which blocks' host copies go to disk under ``config.host_store``, and what packing ``waiting`` costs.
        Where the platform has no disk tier, auto keeps every block in RAM and disk is refused."""
        mode = mode or self._settings().host_store
        unsupported = disk_tier_unsupported()
        if unsupported is not None:
            if mode == "disk":
                raise ValueError(f"[layerwise-offload] host_store = disk: {unsupported}. Use host_store = auto "
                                 f"or ram (every block's host copy in RAM)")
            mode = "ram"
        waiting_set = set(waiting)
        named = [block_parameters(block) for block in self.blocks]
        layouts = [plan_layout(n) for n in named]
        sizes = [layout.nbytes for layout in layouts]
        padding = [layout.nbytes - sum(e.span_elements * e.dtype.itemsize for e in layout.entries) for layout in layouts]
        if mapped_files is None and waiting_set:
            mapped_files = MappedFiles()
        freed = [freed_by_packing([p for _, p in n], mapped_files) if i in waiting_set else 0
                 for i, n in enumerate(named)]
        ring = self.ring_size
        return plan_host_tiers(
            sizes, freed, mode, self.available_bytes(beside_device=False), device_share=self.device_share_bytes(),
            ring_bytes=lambda tiers, tight: staging_ring_bytes(max((s for s, d in zip(sizes, tiers) if d), default=0),
                                                               ring, tight),
            margin=RAM_MARGIN_BYTES, waiting=[i in waiting_set for i in range(len(self.blocks))], chunk_bytes=CHUNK_BYTES,
            padding_bytes=padding,
            already_disk=[disk is not None and disk.holds(i) for i in range(len(self.blocks))],
            read_rate=lambda: self._read_rate(named, waiting, mapped_files))

    def _read_rate(self, named, waiting: Sequence[int], mapped_files: Optional[MappedFiles]):
        """(bytes per second, in words) of the file system the disk blocks would be read from: the checkpoint where
        the block latest in the step (the first to go to disk) is a mapped file's bytes, else the cache folder.
        (None, why) where it cannot be measured: the disk tier then fails with its own message, if used at all."""
        path = None
        for _, param in named[max(waiting, default=len(named) - 1)]:
            where = locate(param) or (mapped_files.locate(param) if mapped_files is not None else None)
            if where is not None:
                path = where[0]
                break
        path = path or self.environment.cache_folder()
        try:
            rate = disk_read_rate(path)
        except OSError as error:
            return None, f"not measurable on {path}: {error}"
        return rate.bytes_per_s, rate.how

    def available_bytes(self, beside_device: bool = True) -> Optional[int]:
        """Host RAM free to this process; with ``beside_device``, less what a device living in host RAM will take
        once the plan is armed (see :class:`HostEnvironment`)."""
        probe = self.environment.available_host_bytes
        free = available_host_bytes() if probe is None else probe()
        if free is None or not beside_device:
            return free
        return max(0, free - self.device_share_bytes())

    def device_share_bytes(self) -> int:
        """What a device living in host RAM (the CPU loopback) will take from it once the plan is armed, beyond
        what it holds now: 0 beside a GPU. The tier plan weighs it after packing, not during it: the slots are
        allocated at the first forward, when packing's peak and temporaries are gone (TierPlan)."""
        device_takes = self.environment.device_bytes_from_host
        return 0 if device_takes is None else max(0, device_takes())

    # ----------------------------------------------------------------- refusals
    def shortfall(self, waiting: Sequence[int], mode: str, disk: Optional[HostTier], pin_memory: bool,
                  settings: Optional[str] = None) -> Optional[str]:
        """Why packing ``waiting`` under host_store ``mode`` would fail for want of host memory, or None."""
        plan = self.plan(waiting, mode, disk=disk)
        if plan.shortfall() is None:
            return None
        return self.refusal(plan, disk, pin_memory, settings, waiting)

    def check_room(self, need: int, plan: Optional[TierPlan], disk: Optional[HostTier], pin_memory: bool) -> None:
        """Refuse (MemoryError) to pack a block whose new buffer takes ``need`` bytes at once where the host RAM
        free now, less packing's slack, is short of it; ``plan`` is the pass's (None: every block in RAM)."""
        # The device's share is taken when the first forward arms the plan, after packing: this block's peak sees
        # the RAM as it is now (the tier plan already left the device its share of what packing keeps).
        available = self.available_bytes(beside_device=False)
        if available is not None and available < need + PACKING_SLACK_BYTES:
            tiers = plan.disk if plan is not None else (False,) * len(self.blocks)
            ring = plan.ring_bytes if plan is not None else 0
            raise MemoryError(self.refusal(TierPlan(tiers, peak_bytes=need, growth_bytes=need, ring_bytes=ring,
                                                    available_bytes=available, margin_bytes=0), disk, pin_memory))

    def refusal(self, plan: TierPlan, disk: Optional[HostTier], pin_memory: bool, settings: Optional[str] = None,
                waiting: Optional[Sequence[int]] = None) -> str:
        """The message refusing ``plan``: ``settings`` names the caller's settings (by default the config's)."""
        config = self._settings()
        settings = settings or (f"resident_layers={config.resident_layers}, prefetch_size={config.prefetch_size}, "
                                f"pin_memory={pin_memory}, host_store={config.host_store}")
        unsupported = disk_tier_unsupported()
        disk_fits = True
        if unsupported is None and plan.disk_blocks < len(self.blocks):
            waiting = range(len(self.blocks)) if waiting is None else waiting
            disk_fits = self.plan(waiting, "disk", disk=disk).shortfall() is None
        ring = (f"{self.ring_size} chunks of at most {format_mib(disk_tier.CHUNK_BYTES)}, "
                f"{format_mib(disk_tier.TIGHT_CHUNK_BYTES)} where RAM is short")
        return refusal(plan, settings, ring, len(self.blocks), unsupported, disk_fits)
