"""Turning one sampling run's counters into figures and a recommendation a person can act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .planner import format_bytes

# Below this share of the run spent waiting for copies, the copies count as hidden.
HIDDEN_STALL_FRACTION = 0.02


@dataclass(frozen=True)
class RunReport:
    forwards: int
    resident_blocks: int
    num_blocks: int
    resident_bytes: int
    bytes_per_forward: int  # steady state: the last forward's copies (the first also copies residents)
    run_bytes: int  # everything copied during the run
    copy_seconds: float
    stall_seconds: float
    run_seconds: float
    peak_device_bytes: int
    pinned_host_bytes: int
    asynchronous: bool = True  # copies can overlap compute (a copy stream); False on the CPU loopback
    host_bytes: int = 0  # the host store (every block once)
    pin_requested_bytes: int = 0  # page-locking asked for (the streamed blocks within the pin budget)
    disk_blocks: int = 0  # blocks whose host copy lives in the disk tier's file
    disk_bytes_read: int = 0  # read from that file during the run
    disk_seconds: float = 0.0  # wall time with a read in flight
    disk_stall_seconds: float = 0.0  # time copies waited for reads

    @property
    def disk_gbps(self) -> float:
        return self.disk_bytes_read / self.disk_seconds / 1e9 if self.disk_seconds > 0 else 0.0

    def disk_figures(self) -> str:
        """The disk tier's part of the run line (empty when no block is on disk)."""
        if not self.disk_blocks:
            return ""
        per_forward = self.disk_bytes_read // max(1, self.forwards)
        return (f", {self.disk_blocks} blocks on disk: {format_bytes(per_forward)} read per forward at "
                f"{self.disk_gbps:.2f} GB/s, stalled {self.disk_stall_seconds:.3f} s waiting for reads")

    @property
    def gbps(self) -> float:
        return self.run_bytes / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stall_seconds / self.run_seconds if self.run_seconds > 0 else 0.0

    def figures(self) -> str:
        return (f"{self.forwards} forwards, {self.resident_blocks}/{self.num_blocks} blocks resident "
                f"({format_bytes(self.resident_bytes)}), {format_bytes(self.bytes_per_forward)} copied per forward "
                f"at {self.gbps:.2f} GB/s, stalled {self.stall_fraction:.0%} of the run "
                f"({self.stall_seconds:.3f} of {self.run_seconds:.3f} s), peak device "
                f"{format_bytes(self.peak_device_bytes)}, pinned host {format_bytes(self.pinned_host_bytes)} "
                f"(of {format_bytes(self.pin_requested_bytes)} requested), host store {format_bytes(self.host_bytes)}"
                f"{self.disk_figures()}")


def recommend(report: RunReport, resident_block_bytes: Sequence[int]) -> str:
    """What to change, in words, from how much of the run waited on copies.

    ``resident_block_bytes``: the sizes of the resident blocks, in call order. When copies are
    hidden, the compute time not covered by copies could hide more of them: each
    block demoted from resident adds ``bytes / bandwidth`` of copying, so the advice names the
    count that still fits in the spare time and the VRAM that frees.
    """
    streamed = report.num_blocks - report.resident_blocks
    if report.forwards == 0:
        return "no forward ran yet: queue a prompt first"
    if not report.asynchronous:
        return (f"copies are synchronous on this device (no copy stream, nothing overlaps): they took "
                f"{report.stall_fraction:.0%} of the run; each block kept resident removes its copy")
    if report.disk_blocks and report.run_seconds > 0 and report.disk_stall_seconds / report.run_seconds >= HIDDEN_STALL_FRACTION:
        return (f"stalled {report.disk_stall_seconds / report.run_seconds:.0%} of the run waiting for disk reads: "
                f"fewer blocks on disk helps (free host RAM for host_store = auto, or an fp8/GGUF checkpoint), "
                f"or a faster disk for the cache file")
    if report.stall_fraction >= HIDDEN_STALL_FRACTION:
        return (f"stalled {report.stall_fraction:.0%} of the run waiting for copies: raise resident_layers "
                f"(or prefetch_size) if VRAM allows")
    if report.resident_blocks == 0 or report.copy_seconds <= 0 and streamed > 0:
        return "copies fully hidden: nothing to change"
    per_forward_seconds = report.run_seconds / report.forwards
    copy_per_forward = report.copy_seconds / report.forwards
    spare = max(0.0, per_forward_seconds - copy_per_forward) * (1 - HIDDEN_STALL_FRACTION)
    bandwidth = report.gbps * 1e9 if report.gbps > 0 else None
    resident_sizes = list(resident_block_bytes)  # call order: the last ones are demoted first
    demote = 0
    freed = 0
    if bandwidth:
        budget = spare * bandwidth
        for size in reversed(resident_sizes):
            if freed + size > budget:
                break
            freed += size
            demote += 1
    if demote == 0:
        return "copies fully hidden, with no spare time to stream more blocks: keep these settings"
    return (f"copies fully hidden: lowering resident_layers to {report.resident_blocks - demote} would free "
            f"{format_bytes(freed)} of VRAM at no cost")
