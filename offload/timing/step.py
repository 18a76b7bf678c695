"""The timeline of one sampling step under a plan, computed from the plan: which blocks stay, the ring of
``prefetch + 1`` slots, each block's copy and compute time.

The manager's schedule, as the model knows it (bench/timing_replay.py records the real manager's and checks this
against it):

- The host issues every block's kernels in call order on the compute stream. Before a streamed block's kernels the
  compute stream waits for that block's bytes; then, still before them, the host queues the copy of the streamed
  block ``prefetch`` places further on (wrapping into the next step: the last streamed blocks of a step copy the
  next step's first ones). That copy goes into the slot the previous streamed block left, so the copy stream
  waits for that block's kernels to end first.
- One copy engine: copies run one at a time, in the order queued. An after-copy transform (a LoRA on the device)
  runs on a stream of its own once its copy is in, and the block waits for it instead.
- With no more streamed blocks than ``prefetch`` each one keeps its slot: nothing is copied in steady state.
- The host pays a fixed time per streamed block's copy and per block launch, runs ahead of the GPU otherwise, and
  with ``sync_each_step`` waits for the compute stream at each step's end (the sampler reads the latent back).

A step is timed in steady state: three forwards from an armed plan, the step between the ends of the last two.
Arming (the residents' first copies) is not timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import choose_resident_blocks
from .costs import COPY_LATENCY_S, GpuSpec, ModelCosts, bound_seconds

__all__ = ["Prediction", "Timeline", "predict", "prediction", "timeline"]

FORWARDS = 3


@dataclass(frozen=True)
class Prediction:
    """One step in steady state, in seconds (``ratio`` = step / bound)."""

    step_s: float
    bound_s: float
    compute_s: float  # the compute stream's work in one step (blocks + outside)
    copy_s: float  # the streamed bytes / H2D rate
    copy_idle_s: float  # the copy engine idle within the step (0 when nothing streams)
    compute_stall_s: float  # the compute stream idle within the step (waiting on copies or on the host)
    host_s: float  # the host's busy time in the step
    copies: int  # copies queued in the step
    # The last forward's timeline, in seconds from the end of the forward before's last block (the origin a GPU
    # run's per-block CUDA events share, bench/gpu_harness.py): each block's kernels (start, end), and each copy into
    # a block's memory queued in that forward or the one before (block, start, end; those before the origin
    # negative): a block's copy may be queued a forward ahead (the wrap-around prefetch).
    block_spans: Tuple[Tuple[float, float], ...] = ()
    copy_spans: Tuple[Tuple[int, float, float], ...] = ()

    @property
    def ratio(self) -> float:
        return self.step_s / self.bound_s if self.bound_s > 0 else 1.0


@dataclass
class Timeline:
    """What the streams and the host did, forward by forward, for :func:`prediction`."""

    step_ends: List[float]  # per forward: the compute stream's end of it
    busy: Dict[str, List[Tuple[float, float]]]  # per stream: its work's spans
    host_busy: List[Tuple[float, float]]
    copies: List[int]  # per forward: copies queued in it
    block_spans: List[List[Tuple[float, float]]]  # per forward: each block's kernels
    copy_spans: List[List[Tuple[int, float, float]]]  # per forward: (block, start, end) of each copy queued


def timeline(costs: ModelCosts, gpu: GpuSpec, resident: Sequence[bool], prefetch: int,
             sync_each_step: bool = True, forwards: int = FORWARDS) -> Timeline:
    """Every copy and kernel of ``forwards`` forwards of the plan ``resident`` (per block) at ``prefetch``."""
    n = costs.num_blocks
    block_s = costs.block_seconds(gpu)
    outside_s = costs.outside_flops / gpu.dit_flops_per_s / 2  # embedders before the blocks, final layer after
    lora = costs.lora_bytes
    streamed = [i for i in range(n) if not resident[i]]
    m = len(streamed)
    copy_s = {i: COPY_LATENCY_S + costs.streamed_copy_bytes[i] / gpu.h2d_bytes_per_s for i in streamed}
    lora_s = {i: (lora[i] if lora is not None else 0.0) / gpu.hbm_bytes_per_s for i in streamed}
    out = Timeline([], {"compute": [], "copy": [], "transform": []}, [], [], [], [])
    host, compute, engine, side = 0.0, 0.0, 0.0, 0.0
    ready: Dict[int, float] = {}  # a streamed block's bytes on the device (its transform done)
    freed: Dict[int, float] = {}  # a streamed block's kernels done: its slot may be overwritten

    def spend(seconds: float) -> None:
        nonlocal host
        out.host_busy.append((host, host + seconds))
        host += seconds

    def copy(block: int, after: float) -> None:
        nonlocal engine, side
        spend(costs.host_s_per_streamed_block)
        start = max(engine, host, after)
        engine = start + copy_s[block]
        out.busy["copy"].append((start, engine))
        out.copies[-1] += 1
        out.copy_spans[-1].append((block, start, engine))
        ready[block] = engine
        if lora is not None:
            begin = max(side, host, engine)
            side = begin + lora_s[block]
            out.busy["transform"].append((begin, side))
            ready[block] = side

    def run(seconds: float) -> Tuple[float, float]:
        nonlocal compute
        start = max(compute, host)
        compute = start + seconds
        out.busy["compute"].append((start, compute))
        return start, compute

    for forward in range(forwards):
        out.copies.append(0)
        out.copy_spans.append([])
        if forward == 0:  # the arming copies the first streamed blocks into free slots
            for block in streamed[:prefetch]:
                copy(block, 0.0)
        spans: List[Tuple[float, float]] = []
        run(outside_s)
        position = 0
        for i in range(n):
            if not resident[i]:
                compute = max(compute, ready[i])
                if m > prefetch:
                    previous = streamed[(position - 1) % m]
                    copy(streamed[(position + prefetch) % m], freed.get(previous, 0.0))
                position += 1
            spend(costs.launch_s_per_block)
            spans.append(run(block_s[i]))
            if not resident[i]:
                freed[i] = compute
        run(outside_s)
        if sync_each_step:
            host = max(host, compute)
        out.step_ends.append(compute)
        out.block_spans.append(spans)
    return out


def _busy_within(intervals: Sequence[Tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def predict(costs: ModelCosts, gpu: GpuSpec, resident_count: int, policy: str = "leading", prefetch: int = 1,
            sync_each_step: bool = True, tails: Optional[Sequence[int]] = None) -> Prediction:
    """The steady-state step of this plan on ``gpu``; ``tails``: per block, the bytes it streams (streamed tails:
    the schedule is the same, each copy moves its tail)."""
    if tails:
        costs = ModelCosts(costs.block_bytes, costs.block_flops, costs.outside_flops, costs.cast_bytes,
                           costs.lora_bytes, tuple(tails), costs.host_s_per_streamed_block, costs.launch_s_per_block)
    resident = choose_resident_blocks(costs.num_blocks, resident_count, policy)
    return prediction(timeline(costs, gpu, resident, prefetch, sync_each_step), costs, gpu, resident)


def prediction(line: Timeline, costs: ModelCosts, gpu: GpuSpec, resident: Sequence[bool]) -> Prediction:
    """The last step of ``line`` (the timeline of the plan ``resident``) as a :class:`Prediction`."""
    start, end = line.step_ends[-2], line.step_ends[-1]
    step = end - start
    origin = line.block_spans[-2][-1][1]  # the forward before's last block ends
    return Prediction(
        step_s=step, bound_s=bound_seconds(costs, gpu, resident), compute_s=costs.compute_seconds(gpu),
        copy_s=costs.streamed_bytes(resident) / gpu.h2d_bytes_per_s,
        copy_idle_s=(step - _busy_within(line.busy.get("copy", ()), start, end)) if not all(resident) else 0.0,
        compute_stall_s=step - _busy_within(line.busy.get("compute", ()), start, end),
        host_s=_busy_within(line.host_busy, start, end), copies=line.copies[-1],
        block_spans=tuple((a - origin, b - origin) for a, b in line.block_spans[-1]),
        copy_spans=tuple((b, s - origin, e - origin) for b, s, e in line.copy_spans[-2] + line.copy_spans[-1]))
