"""What a plan weighs: each block's device bytes, the tails it can stream, and the footprint of a schedule.

Read from the host store's layouts once the blocks are packed, from the parameters before; a block whose host copy
is on disk streams whole (the disk tier reads whole blocks). The manager arms and replans from these figures, and
the node tells ComfyUI the footprint, so they are computed here and nowhere else.
"""

from __future__ import annotations

from typing import List, Optional

from .config import OffloadConfig
from .host.packing import BlockLayout, plan_layout
from .schedule import Footprint, Schedule, footprint


class BlockGeometry:
    """The sizes a manager plans with, over its ``params`` (:class:`~.blocks.params.BlockParameters`) and ``host``
    (:class:`~.host.side.HostSide`: the store's layouts, each block's tier)."""

    def __init__(self, params, host):
        self.params = params
        self.host = host
        self._planning_tiers = False

    @property
    def num_blocks(self) -> int:
        return len(self.params.named)

    def layouts(self) -> List[BlockLayout]:
        store = self.host.store
        return store.layouts if store is not None else [plan_layout(named) for named in self.params.named]

    def block_nbytes(self) -> List[int]:
        """Bytes each block occupies on the device once materialized."""
        return [layout.nbytes for layout in self.layouts()]

    def in_ram(self) -> List[bool]:
        """Per block, whether its host copy is (or, before packing, will be) in RAM. The host's tier plan asks what the
        plan takes from host RAM on the CPU loopback (the manager's ``planned_device_bytes``), which asks this: asked
        again while it plans, the blocks count as in RAM."""
        if self._planning_tiers:
            return [True] * self.num_blocks
        self._planning_tiers = True
        try:
            return [tier == "ram" for tier in self.host.tiers()]
        finally:
            self._planning_tiers = False

    def tail_options(self) -> List[tuple]:
        """Per block, the sizes its streamed tail can have, ascending, the whole block last
        (``BlockLayout.tail_sizes``); a block on disk streams whole."""
        return [layout.tail_sizes if in_ram else (layout.nbytes,)
                for layout, in_ram in zip(self.layouts(), self.in_ram())]

    def block_tails(self, config: OffloadConfig) -> Optional[List[int]]:
        """Per block, the bytes it streams when it streams under ``config``: its tail under ``streamed_tail_bytes``;
        None where every streamed block streams whole."""
        caps = config.tail_caps(self.num_blocks)
        if caps is None:
            return None
        return [layout.tail_bytes(cap) if in_ram else layout.nbytes
                for layout, in_ram, cap in zip(self.layouts(), self.in_ram(), caps)]

    def splits(self, schedule: Schedule, config: OffloadConfig) -> List[int]:
        """Per block, where its streamed tail begins under ``schedule`` and ``config`` (0: resident, or streamed
        whole)."""
        tails = self.block_tails(config)
        if tails is None:
            return [0] * self.num_blocks
        return [0 if keep else size - tail
                for keep, size, tail in zip(schedule.resident, self.block_nbytes(), tails)]

    def footprint(self, schedule: Schedule, config: OffloadConfig) -> Footprint:
        """What ``schedule`` holds on the device once armed under ``config``: resident buffers, streamed blocks'
        heads, the slot ring."""
        return footprint(self.block_nbytes(), schedule.resident, config.prefetch_size, self.block_tails(config))

    def host_ram_bytes(self, staging_bytes: int = 0) -> int:
        """Host RAM the blocks in the RAM tier take (packed, or not yet), plus the disk tier's ``staging_bytes``."""
        return staging_bytes + sum(n for n, tier in zip(self.block_nbytes(), self.host.tiers()) if tier == "ram")

