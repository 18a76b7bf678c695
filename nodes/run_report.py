"""What one sampling run of an offloaded model did, from the manager's counters before and after it."""

from __future__ import annotations

from .advice import RunReport, block_tiers


def run_report(controller, before, after, forwards: int, run_seconds: float) -> RunReport:
    """``before`` / ``after``: the manager's stats at the run's start and end (``OffloadStats``)."""
    return RunReport(
        forwards=forwards, resident_blocks=after.resident_blocks, num_blocks=after.num_blocks,
        resident_bytes=after.resident_bytes, bytes_per_forward=after.bytes_copied_last_forward,
        run_bytes=after.bytes_copied - before.bytes_copied,
        copy_seconds=after.copy_seconds - before.copy_seconds,
        stall_seconds=after.stall_seconds - before.stall_seconds,
        run_seconds=run_seconds, peak_device_bytes=after.peak_device_bytes,
        pinned_host_bytes=after.pinned_host_bytes, asynchronous=after.asynchronous,
        host_bytes=after.host_bytes, pin_requested_bytes=after.host_bytes_requested,
        steps=getattr(controller, "run_steps", 0), prefetch_size=controller.plan().prefetch_size,
        block_tiers=block_tiers(after), slot_count=after.slot_count,
        demand_copies=after.demand_copies - before.demand_copies, device_type=controller.device.type,
        other_device_bytes=controller.loaded_bytes() - after.device_bytes, host_ram_bytes=controller.host_ram_bytes(),
        disk_blocks=after.disk_blocks, disk_checkpoint_blocks=after.disk_checkpoint_blocks,
        disk_bytes_read=after.disk_bytes_read - before.disk_bytes_read,
        disk_seconds=after.disk_read_seconds - before.disk_read_seconds,
        disk_stall_seconds=after.disk_stall_seconds - before.disk_stall_seconds, head_bytes=after.head_bytes,
        pieces="layers" if controller.discovered.streams_weights else "blocks",
        forwards_without_blocks=after.forwards_without_blocks - before.forwards_without_blocks)
