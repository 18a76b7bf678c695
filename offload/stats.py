"""Counters a manager keeps, as one snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class OffloadStats:
    num_blocks: int
    resident_blocks: int
    streamed_blocks: int
    forwards: int
    bytes_copied: int  # host-to-device, since the manager was made
    copies_issued: int
    demand_copies: int  # copies issued when a block was about to run (not prefetched in time)
    bytes_copied_last_forward: int
    copies_last_forward: int
    materialized_blocks: int
    peak_materialized_blocks: int
    resident_bytes: int  # device bytes of the resident blocks' own buffers
    device_bytes: int  # every device byte the manager holds now (residents + streaming slots)
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

    @property
    def achieved_gbps(self) -> float:
        return self.bytes_copied / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        data = asdict(self)
        data["achieved_gbps"] = self.achieved_gbps
        return data


class Counters:
    """What a manager counts: copies (since it was made, and in the last forward), forwards, and peaks."""

    def __init__(self, num_blocks: int):
        self.bytes_copied = 0
        self.copies_issued = 0
        self.demand_copies = 0  # copies issued when a block was about to run (not prefetched in time)
        self.copies_per_block = [0] * num_blocks
        self.forwards = 0
        self._forward_bytes = self._forward_copies = 0
        self.last_forward_bytes = self.last_forward_copies = 0
        self.peak_materialized = self.peak_device_bytes = 0

    def count_copy(self, index: int, nbytes: int) -> None:
        self.bytes_copied += nbytes
        self.copies_issued += 1
        self._forward_bytes += nbytes
        self._forward_copies += 1
        self.copies_per_block[index] += 1

    def begin_forward(self) -> None:
        self.forwards += 1
        self._forward_bytes = self._forward_copies = 0

    def end_forward(self) -> None:
        self.last_forward_bytes = self._forward_bytes
        self.last_forward_copies = self._forward_copies

    def note_peaks(self, materialized: int, device_bytes: int, reset: bool = False) -> None:
        """Raise the peaks to what is held now (``reset``: start them again from it)."""
        self.peak_materialized = materialized if reset else max(self.peak_materialized, materialized)
        self.peak_device_bytes = device_bytes if reset else max(self.peak_device_bytes, device_bytes)


def snapshot(manager, schedule) -> OffloadStats:
    """The counters of ``manager`` under ``schedule`` (its current plan) as one frozen record."""
    m, counts, store = manager, manager.counters, manager.store
    disk = m.host.disk
    checkpoint_bytes = disk.checkpoint_bytes() if disk is not None else 0
    disk_bytes = disk.nbytes() if disk is not None else 0
    return OffloadStats(
        num_blocks=m.num_blocks,
        resident_blocks=len(schedule.resident_blocks),
        streamed_blocks=len(schedule.streamed_blocks),
        forwards=counts.forwards,
        bytes_copied=counts.bytes_copied,
        copies_issued=counts.copies_issued,
        demand_copies=counts.demand_copies,
        bytes_copied_last_forward=counts.last_forward_bytes,
        copies_last_forward=counts.last_forward_copies,
        materialized_blocks=len(m.materialized_blocks()),
        peak_materialized_blocks=counts.peak_materialized,
        resident_bytes=m.device_memory.resident_bytes(),
        device_bytes=m.device_bytes(),
        peak_device_bytes=counts.peak_device_bytes,
        planned_device_bytes=m.planned_device_bytes(schedule),
        host_bytes=store.nbytes() - (disk_bytes - checkpoint_bytes) if store is not None else 0,
        pinned_host_bytes=store.pinned_nbytes() if store is not None else 0,
        host_bytes_requested=store.ledger.bytes_requested if store is not None else 0,
        host_bytes_pinned=store.ledger.bytes_pinned if store is not None else 0,
        copy_seconds=m.backend.copy_seconds,
        stall_seconds=m.backend.stall_seconds,
        disk_blocks=len(disk.regions) if disk is not None else 0,
        disk_bytes=disk_bytes,
        disk_bytes_read=disk.bytes_read if disk is not None else 0,
        disk_reads=disk.reads if disk is not None else 0,
        disk_read_seconds=disk.read_seconds if disk is not None else 0.0,
        disk_stall_seconds=disk.stall_seconds if disk is not None else 0.0,
        staging_bytes=disk.ring_bytes if disk is not None else 0,
        disk_checkpoint_blocks=len(disk.extents) if disk is not None else 0,
    )
