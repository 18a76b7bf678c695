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


def snapshot(manager, schedule) -> OffloadStats:
    """The counters of ``manager`` under ``schedule`` (its current plan) as one frozen record."""
    m = manager
    disk = getattr(m, "_disk", None)
    checkpoint_bytes = disk.checkpoint_bytes() if disk is not None else 0
    disk_bytes = disk.nbytes() if disk is not None else 0
    return OffloadStats(
        num_blocks=m.num_blocks,
        resident_blocks=len(schedule.resident_blocks),
        streamed_blocks=len(schedule.streamed_blocks),
        forwards=m._forwards,
        bytes_copied=m._bytes_copied,
        copies_issued=m._copies_issued,
        demand_copies=m._demand_copies,
        bytes_copied_last_forward=m._last_forward_bytes,
        copies_last_forward=m._last_forward_copies,
        materialized_blocks=sum(m._materialized),
        peak_materialized_blocks=m._peak_materialized,
        resident_bytes=sum(b.numel() for b in m._resident_buffers.values()),
        device_bytes=m.device_bytes(),
        peak_device_bytes=m._peak_device_bytes,
        planned_device_bytes=m.planned_device_bytes(schedule),
        host_bytes=m.store.nbytes() - (disk_bytes - checkpoint_bytes) if m.store is not None else 0,
        pinned_host_bytes=m.store.pinned_nbytes() if m.store is not None else 0,
        host_bytes_requested=m.store.ledger.bytes_requested if m.store is not None else 0,
        host_bytes_pinned=m.store.ledger.bytes_pinned if m.store is not None else 0,
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


class CountersMixin:
    """The copy and peak counters of :class:`LayerwiseOffloadManager` that :func:`snapshot` reads."""

    def _count_copy(self, index: int, nbytes: int) -> None:
        self._bytes_copied += nbytes
        self._copies_issued += 1
        self._forward_bytes += nbytes
        self._forward_copies += 1
        self.copies_per_block[index] += 1

    def reset_peaks(self) -> None:
        """Start the peak counters (materialized blocks, device bytes) again from what is held now."""
        self._peak_materialized = sum(self._materialized)
        self._peak_device_bytes = self.device_bytes()

    def _note_peaks(self) -> None:
        self._peak_materialized = max(self._peak_materialized, sum(self._materialized))
        self._peak_device_bytes = max(self._peak_device_bytes, self.device_bytes())
