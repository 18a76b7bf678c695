"""Turning one sampling run's counters into figures and a recommendation a person can act on.

Every figure is said in a form that cannot contradict another: a speed only next to the bytes it moved, a wait
only with its cause, and on a device where copies cannot overlap compute (the CPU loopback) that fact instead of
overlap or pinning figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from ..offload import format_bytes, format_rate, format_seconds

# Below this share of the run spent waiting for copies, the copies count as hidden.
HIDDEN_STALL_FRACTION = 0.02

# One letter per block in call order: kept in VRAM, copied in from RAM every step, read from disk every step.
RESIDENT, STREAMED, ON_DISK = "R", "S", "D"
PARTLY_RESIDENT = "P"
TIER_WORDS = {RESIDENT: "in VRAM", PARTLY_RESIDENT: "partly in VRAM", STREAMED: "streamed from RAM",
              ON_DISK: "streamed from disk"}


def tiers_by_block(unit_tiers: str, block_of, num_blocks: int) -> str:
    """Weight units' letters (:func:`block_tiers`) folded into one per transformer block: a block whose units all have
    one letter keeps it, one with some units in VRAM and some streamed is partly resident, and one without units (its
    few weights stay with the model's other weights) is in VRAM. A real model has hundreds of units; the Stats
    node's map shows its blocks."""
    letters = [set() for _ in range(num_blocks)]
    for letter, block in zip(unit_tiers, block_of):
        letters[block].add(letter)
    return "".join(RESIDENT if not found else next(iter(found)) if len(found) == 1
                   else PARTLY_RESIDENT if RESIDENT in found else STREAMED for found in letters)


def block_tiers(stats) -> str:
    """A manager's plan (its :class:`~layerwise_offload.offload.OffloadStats`) as one letter per block
    (``TIER_WORDS``): resident, or streamed from the host tier it lives in (RAM, or the disk tier's file)."""
    letters = {"resident": RESIDENT, "ram": STREAMED, "disk": ON_DISK}
    return "".join(letters[tier] for tier in stats.block_tiers)


def activation_words(source: str) -> str:
    """An activation estimate's origin (planner.ActivationEstimate.source) as a person reads it: the source names
    a row of the measured table ("wan_1_3b scaled to width 256"), which means nothing to a ComfyUI user."""
    if source.startswith("measured"):
        return "measured"
    return "roughly estimated" if source == "heuristic" else "estimated"


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
    steps: int = 0  # the sampler's steps in this run (0: unknown, the figures are then per forward)
    block_tiers: str = ""  # one of R / S / D per block, in call order
    prefetch_size: int = 1
    slot_count: int = 0  # streaming slots the plan holds on the device
    demand_copies: int = 0  # copies issued only when their block was about to run (not prefetched in time)
    device_type: str = "cuda"
    other_device_bytes: int = 0  # this model's weights outside the blocks, on the device
    host_ram_bytes: int = 0  # RAM this model holds (the host store and the weights left on the host)
    disk_blocks: int = 0  # blocks whose host copy lives in the disk tier's file
    disk_bytes_read: int = 0  # read from that file during the run
    disk_seconds: float = 0.0  # wall time with a read in flight
    disk_stall_seconds: float = 0.0  # time copies waited for reads
    head_bytes: int = 0  # the streamed blocks' heads in VRAM (streamed tails)
    disk_checkpoint_blocks: int = 0  # of the disk blocks, those read straight from the safetensors checkpoint
    pieces: str = "blocks"  # what streams: "blocks", or "layers" with residency_policy weights (weight units)
    forwards_without_blocks: int = 0  # complete forwards in which no block ran through the offload's hooks

    @property
    def disk_bytes_per_s(self) -> float:
        return self.disk_bytes_read / self.disk_seconds if self.disk_seconds > 0 else 0.0

    def disk_figures(self) -> str:
        """The disk tier's part of the run line (empty when no block is on disk)."""
        if not self.disk_blocks:
            return ""
        per_step = int(self.disk_bytes_read / self.step_count) if self.step_count else 0
        source = (f" ({self.disk_checkpoint_blocks} from the checkpoint file)"
                  if self.disk_checkpoint_blocks else "")
        return (f"{self.disk_blocks} blocks on disk{source}: {format_bytes(per_step)} read per {self.step_word} at "
                f"{format_rate(self.disk_bytes_per_s)}, waited {format_seconds(self.per_step(self.disk_stall_seconds))} "
                f"per {self.step_word} for reads")

    @property
    def copy_bytes_per_s(self) -> float:
        return self.run_bytes / self.copy_seconds if self.copy_seconds > 0 else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stall_seconds / self.run_seconds if self.run_seconds > 0 else 0.0

    @property
    def streamed_blocks(self) -> int:
        return self.num_blocks - self.resident_blocks

    @property
    def step_word(self) -> str:
        return "step" if self.steps > 0 else "forward"

    @property
    def step_count(self) -> int:
        return self.steps if self.steps > 0 else self.forwards

    def per_step(self, value: float) -> float:
        return value / self.step_count if self.step_count else 0.0

    @property
    def copy_per_step(self) -> float:
        return self.per_step(self.copy_seconds)

    @property
    def compute_per_step(self) -> float:
        """The step's time apart from waiting on copies (the model, the sampler, ComfyUI)."""
        return self.per_step(max(0.0, self.run_seconds - self.stall_seconds))

    @property
    def wait_per_step(self) -> float:
        return self.per_step(self.stall_seconds)

    @property
    def bytes_per_step(self) -> int:
        return int(self.bytes_per_forward * self.forwards / self.step_count) if self.step_count else 0

    @property
    def first_load_bytes(self) -> int:
        """What the first forward copied on top of the steady state: the resident blocks coming in."""
        return max(0, self.run_bytes - self.bytes_per_forward * self.forwards)

    @property
    def device_memory_bytes(self) -> int:
        return self.peak_device_bytes + self.other_device_bytes

    def headline(self) -> str:
        pieces = self.pieces
        if self.streamed_blocks == 0:
            return f"all {self.num_blocks} {pieces} in VRAM"
        if self.head_bytes:
            return (f"{self.resident_blocks} of {self.num_blocks} {pieces} in VRAM, {self.streamed_blocks} streamed as "
                    f"tails (their heads, {format_bytes(self.head_bytes)}, in VRAM)")
        return f"{self.resident_blocks} of {self.num_blocks} {pieces} in VRAM, {self.streamed_blocks} streamed"

    def copy_line(self) -> str:
        """What the copies cost per step, with the bytes behind every speed and the cause of every wait."""
        unit = self.step_word
        if self.bytes_per_forward == 0:
            line = f"nothing copied per {unit}"
            if self.first_load_bytes:
                line += f" (the first {unit} brought the blocks in: {format_bytes(self.first_load_bytes)})"
            return line
        line = f"{format_bytes(self.bytes_per_step)} copied per {unit}"
        if self.copy_seconds > 0:
            line += f" in {format_seconds(self.copy_per_step)} ({format_rate(self.copy_bytes_per_s)})"
        if not self.asynchronous:
            return line + f", on top of {format_seconds(self.compute_per_step)} of compute"
        line += f", behind {format_seconds(self.compute_per_step)} of compute"
        if self.stall_fraction >= HIDDEN_STALL_FRACTION:
            line += f"; waited {format_seconds(self.wait_per_step)} per {unit} for {self._wait_cause()}"
        return line

    def _wait_cause(self) -> str:
        if self.demand_copies:
            return (f"copies not prefetched in time ({self.demand_copies} block"
                    f"{'s' if self.demand_copies != 1 else ''} copied only when needed)")
        if self.copy_per_step > self.compute_per_step:
            return "copies: they take longer than the compute they hide behind"
        return "copies to finish"

    def notes(self) -> List[str]:
        """What a person would otherwise read as a contradiction, said once."""
        notes = []
        if self.device_type == "cpu":
            notes.append("CPU loopback (a test mode): no pinning and no copy/compute overlap on the CPU; "
                         "VRAM here is RAM")
        streamed = self.streamed_blocks
        if streamed and self.bytes_per_forward == 0:
            notes.append(f"the {self.slot_count} streaming slots (prefetch_size {self.prefetch_size}) hold all "
                         f"{streamed} streamed block{'s' if streamed != 1 else ''}: they stay in VRAM like resident "
                         f"ones, copied once per run")
        elif 0 < streamed <= self.prefetch_size:
            notes.append(f"prefetch_size {self.prefetch_size} is more than the {streamed} streamed "
                         f"block{'s' if streamed != 1 else ''}: at most {streamed} can be copied ahead")
        return notes

    def memory_line(self, card_bytes: int = 0, ram_bytes: int = 0) -> str:
        """This model's weights in VRAM and RAM, against the card's and the machine's totals where given."""
        pinned = "" if self.device_type == "cpu" else f", {format_bytes(self.pinned_host_bytes)} pinned"
        card = f" of {format_bytes(card_bytes)}" if card_bytes else ""
        ram = f" of {format_bytes(ram_bytes)}" if ram_bytes else ""
        return (f"VRAM {format_bytes(self.device_memory_bytes)}{card} for this model's weights, "
                f"RAM {format_bytes(self.host_ram_bytes or self.host_bytes)}{ram} held{pinned}")

    def figures(self) -> str:
        """The run line: headline, copies, memory and notes in one line."""
        count = f"{self.step_count} {self.step_word}{'s' if self.step_count != 1 else ''}"
        return "; ".join([f"{count}, {self.headline()}", self.copy_line(),
                          *filter(None, [self.disk_figures()]), self.memory_line(), *self.notes()])


def recommend(report: RunReport, resident_block_bytes: Sequence[int]) -> str:
    """What to change, in words, from how much of the run waited on copies.

    ``resident_block_bytes``: the sizes of the resident blocks, in call order. When copies are
    hidden, the compute time not covered by copies could hide more of them: each
    block demoted from resident adds ``bytes / bandwidth`` of copying, so the advice names the
    count that still fits in the spare time and the VRAM that frees.
    """
    streamed = report.num_blocks - report.resident_blocks
    if report.forwards == 0:
        return "no step ran yet: queue a prompt first"
    if report.forwards_without_blocks:
        return (f"{report.forwards_without_blocks} of {report.forwards} model calls ran none of the transformer "
                f"blocks through the offload: this model uses its blocks' weights without calling the blocks, "
                f"so the plan did not run; remove the node for this model")
    if report.bytes_per_forward == 0:
        if streamed == 0:
            return "nothing streamed: the model runs as if fully loaded"
        # The slot ring holds every streamed block: keeping them resident instead takes no more VRAM.
        return (f"the streaming slots hold every streamed block: resident_layers = {report.num_blocks} "
                f"runs the same for no more VRAM")
    if not report.asynchronous:
        return (f"copies took {report.stall_fraction:.0%} of the run; on a GPU they run behind compute, here "
                f"each block kept resident removes its copy")
    if report.disk_blocks and report.run_seconds > 0 and report.disk_stall_seconds / report.run_seconds >= HIDDEN_STALL_FRACTION:
        return (f"stalled {report.disk_stall_seconds / report.run_seconds:.0%} of the run waiting for disk reads: "
                f"fewer blocks on disk helps (free host RAM for host_store = auto, or an fp8/GGUF checkpoint), "
                f"or a faster disk for the cache file")
    if report.pieces == "layers":  # residency_policy weights plans its own residency
        if report.stall_fraction >= HIDDEN_STALL_FRACTION:
            return (f"waiting took {report.stall_fraction:.0%} of the run: residency_policy auto streams whole blocks "
                    f"or tails, whose copies hide behind a whole block's compute (more bytes a step, less waiting)")
        return "copies hidden: weights moves the fewest bytes this VRAM allows; nothing to change"
    if report.stall_fraction >= HIDDEN_STALL_FRACTION:
        return (f"waiting took {report.stall_fraction:.0%} of the run: raise resident_layers "
                f"(or prefetch_size) if VRAM allows")
    if report.resident_blocks == 0 or report.copy_seconds <= 0:
        return "copies fully hidden: nothing to change"
    per_forward_seconds = report.run_seconds / report.forwards
    copy_per_forward = report.copy_seconds / report.forwards
    spare = max(0.0, per_forward_seconds - copy_per_forward) * (1 - HIDDEN_STALL_FRACTION)
    bandwidth = report.copy_bytes_per_s or None
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
