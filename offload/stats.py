"""Counters a manager keeps, as one snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class OffloadStats:
    num_blocks: int
    resident_blocks: int
    streamed_blocks: int
    forwards: int
    forwards_without_blocks: int
    bytes_copied: int  # host-to-device, since the manager was made
    copies_issued: int
    resident_copies: int  # of those, copies into a resident's own buffer (arming; a replan copies only new residents)
    demand_copies: int  # copies issued when a block was about to run (not prefetched in time)
    bytes_copied_last_forward: int
    copies_last_forward: int
    materialized_blocks: int
    peak_materialized_blocks: int
    resident_bytes: int  # device bytes of the resident blocks' own buffers
    device_bytes: int  # every device byte the manager holds now (residents + heads + streaming slots)
    peak_device_bytes: int
    planned_device_bytes: int  # what the current plan holds once armed
    host_bytes: int
    pinned_host_bytes: int  # page-locked now (the same as host_bytes_pinned)
    host_bytes_requested: int  # bytes the store asked to page-lock (the streamed blocks that fit the budget)
    host_bytes_pinned: int  # bytes the pinner granted
    copy_seconds: float  # time copies took (copy stream, or the CPU clock on loopback)
    stall_seconds: float  # time compute waited for copies
    disk_blocks: int = 0  # blocks whose host copy lives in the disk tier's cache file
    disk_bytes: int = 0  # their stored bytes (not in host_bytes)
    disk_bytes_read: int = 0  # read back from the file, since the manager was made
    disk_reads: int = 0
    disk_read_seconds: float = 0.0  # wall time with at least one read in flight
    disk_stall_seconds: float = 0.0  # time the host waited for a read a copy needed
    staging_bytes: int = 0  # the disk tier's staging ring (host RAM)
    disk_checkpoint_blocks: int = 0  # disk blocks read straight from the safetensors checkpoint (no cache file)

    block_tiers: Tuple[str, ...] = ()  # per block: "resident", or the host tier it streams from ("ram", "disk")
    slot_count: int = 0  # streaming slots the plan holds on the device
    asynchronous: bool = False  # copies overlap compute (a side stream), not the CPU loopback's synchronous copies
    head_bytes: int = 0  # device bytes of the streamed blocks' resident heads (streamed_tail_bytes)
    streamed_tail_bytes: int = 0  # the plan's tail cap (0: streamed blocks stream whole)
    block_nbytes: Tuple[int, ...] = ()  # per block: the bytes it occupies on the device once materialized
    host_ram_bytes: int = 0  # RAM the blocks hold: each block in the RAM tier (packed or not yet), the staging ring
    host_tier_reason: str = ""  # why blocks' host copies went to disk (empty where every block fit in RAM)

    @property
    def achieved_gbps(self) -> float:
        return self.bytes_copied / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0


class Counters:
    """What a manager counts: copies (since it was made, and in the last forward), forwards, and peaks."""

    def __init__(self, num_blocks: int):
        self.bytes_copied = 0
        self.copies_issued = 0
        self.resident_copies = 0  # copies into a resident's own buffer
        self.demand_copies = 0  # copies issued when a block was about to run (not prefetched in time)
        self.copies_per_block = [0] * num_blocks
        self.forwards = 0
        # Complete forwards that called none of the blocks: a model that uses its blocks' weights without calling
        # them (their hooks never fire), so nothing of the plan ran.
        self.forwards_without_blocks = 0
        self._forward_bytes = self._forward_copies = 0
        self.last_forward_bytes = self.last_forward_copies = 0
        self.peak_materialized = self.peak_device_bytes = 0

    def count_copy(self, index: int, nbytes: int, resident: bool = False) -> None:
        self.bytes_copied += nbytes
        self.copies_issued += 1
        self.resident_copies += resident
        self._forward_bytes += nbytes
        self._forward_copies += 1
        self.copies_per_block[index] += 1

    def begin_forward(self) -> None:
        self.forwards += 1
        self._forward_bytes = self._forward_copies = 0

    def end_forward(self, calls: int = 1, completed: bool = True) -> None:
        self.forwards_without_blocks += completed and calls == 0
        self.last_forward_bytes = self._forward_bytes
        self.last_forward_copies = self._forward_copies

    def figures(self) -> dict:
        """The counted fields of :class:`OffloadStats`."""
        return dict(forwards=self.forwards, forwards_without_blocks=self.forwards_without_blocks,
                    bytes_copied=self.bytes_copied, copies_issued=self.copies_issued,
                    resident_copies=self.resident_copies, demand_copies=self.demand_copies,
                    bytes_copied_last_forward=self.last_forward_bytes, copies_last_forward=self.last_forward_copies,
                    peak_materialized_blocks=self.peak_materialized, peak_device_bytes=self.peak_device_bytes)

    def note_peaks(self, materialized: int, device_bytes: int, reset: bool = False) -> None:
        """Raise the peaks to what is held now (``reset``: start them again from it)."""
        self.peak_materialized = materialized if reset else max(self.peak_materialized, materialized)
        self.peak_device_bytes = device_bytes if reset else max(self.peak_device_bytes, device_bytes)


def host_figures(store, disk) -> dict:
    """The host fields of :class:`OffloadStats`, from a manager's host store and disk tier (either may be None).
    ``host_bytes`` is what the store holds in RAM: a disk block's bytes are in its file, except those read straight
    from the checkpoint, which the store maps."""
    figures = dict(host_bytes=0, pinned_host_bytes=0, host_bytes_requested=0, host_bytes_pinned=0)
    disk_bytes = disk.nbytes() if disk is not None else 0
    if store is not None:
        checkpoint_bytes = disk.checkpoint_bytes() if disk is not None else 0
        figures.update(host_bytes=store.nbytes() - (disk_bytes - checkpoint_bytes),
                       pinned_host_bytes=store.pinned_nbytes(), host_bytes_requested=store.ledger.bytes_requested,
                       host_bytes_pinned=store.ledger.bytes_pinned)
    if disk is not None:
        figures.update(disk_blocks=len(disk.regions), disk_bytes=disk_bytes, disk_bytes_read=disk.bytes_read,
                       disk_reads=disk.reads, disk_read_seconds=disk.read_seconds,
                       disk_stall_seconds=disk.stall_seconds, staging_bytes=disk.ring_bytes,
                       disk_checkpoint_blocks=len(disk.extents))
    return figures
