"""A timing model of one sampling step: the manager's real copy/compute schedule, given durations.

Whether block copies hide behind compute cannot be measured without a GPU, but it can be predicted: the order in
which the manager queues copies, waits and block kernels on its two streams is fixed by its code, and the time
each of those takes follows from bytes, FLOPs and a GPU's published figures. This module does both halves:

1. **Replay** (:func:`record_schedule`). The real :class:`~.manager.LayerwiseOffloadManager` runs a few forwards of
   a tiny stand-in model (one 64-byte weight per block, as many blocks as the real model) with its real
   :class:`~.device.backend.StreamBackend`, whose ``torch.cuda`` is replaced by a recorder: streams and events log
   what is queued on them (``wait_event``, ``record``, ``synchronize``), a dispatch mode logs every ``copy_`` into
   the manager's device memory on the stream current when it is queued, the blocks log their kernels on whichever
   stream is current when they run, and an after-copy transform (a LoRA applied on the device, if asked for) logs
   itself the same way. Nothing of the schedule is written down here: change the manager's order and the trace
   changes with it.
   (The tests' CUDA stand-in, ``tests/cuda_standin.py``, checks the same order for races and CUDA's rules; here the
   order is kept and timed.)
2. **Simulation** (:func:`simulate`). The trace is replayed as CUDA runs it: one host thread issues every
   operation in trace order (paying a host cost for some), each stream runs its work first in, first out, an
   event completes when the work queued before it on its stream has, ``wait_event`` holds a stream until then,
   and a host synchronize holds the host. The copy stream is the one host-to-device copy engine; the compute
   stream is the SMs. Durations: a copy is ``bytes / H2D rate`` (plus a small fixed latency), a block's kernels
   are ``FLOPs / (achievable matmul rate x DiT efficiency)`` plus its per-forward weight casts (fp8, GGUF
   dequantisation) at HBM speed, a LoRA transform is its HBM traffic at HBM speed on whichever stream the
   backend queues it (its own stream since the LoRA was moved off the copy stream).

Out (:class:`Prediction`): the steady-state step time (between the ends of the last two of three forwards; the
first arms the plan and teaches the call order, the second and third run alike), the bound
``max(compute, streamed bytes / H2D)`` of DESIGN.md section 6, the copy engine's idle time and the compute stream's
stall time within that step.

What the model assumes (it is a model: a GPU run checks it the day one is lent):

- One forward per step (cond and uncond batched, as ComfyUI runs cfg > 1 when memory allows), every block run
  once, in list order. Steady state only: arming (the residents' first copies) is not timed.
- Host memory is page-locked for every streamed block (the pinned path); a copy runs at the pinned H2D rate the
  whole time, whatever else the GPU does, and only one copy runs at a time (one copy engine per direction).
- A block's kernels run at one rate: its FLOPs at the achievable dense bf16 matmul rate times
  :data:`DIT_EFFICIENCY` (attention, norms and element-wise kernels run below the matmul peak). Kernels on a
  stream other than the compute stream (LoRA) take no SM time from it (optimistic where LoRA is heavy).
- The host issues work ahead of the GPU without limit (CUDA's launch queue is not modelled); it pays
  :data:`HOST_S_PER_STREAMED_BLOCK` of manager bookkeeping at each streamed block's copy (per weight format, as
  bench/host_time.py measured it on the project's CPU) and
  :data:`LAUNCH_S_PER_BLOCK` to launch each block's kernels, and with ``sync_each_step`` waits for the compute
  stream at the end of each step (ComfyUI's sampler callback reads the latent back for previews and progress).
- Event queries answer "done" (they only fold timing statistics and retire the residents' bounce ring).

The parts: :mod:`.schedule_replay` records the schedule (1), :mod:`.gpu_costs` holds what things cost (the reference
GPUs, :data:`GPUS`, carry their sources in ``source``); this module times one with the other (2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .gpu_costs import (COPY_LATENCY_S, DIT_EFFICIENCY, GPUS, HOST_S_PER_STREAMED_BLOCK,
                        HOST_S_PER_STREAMED_BLOCK_BY_FORMAT, HOST_S_PER_STREAMED_BLOCK_FP8,
                        HOST_S_PER_STREAMED_BLOCK_GGUF, HOST_S_PER_STREAMED_BLOCK_QUANTIZED, LAUNCH_S_PER_BLOCK,
                        LORA_BYTES_PER_WEIGHT, GpuSpec, ModelCosts, bound_seconds, model_costs)
from .schedule_replay import Trace, clear_recordings, record_schedule

# The model's whole vocabulary, its parts' included: callers (bench/timing_table.py, the tests) read it from here.
__all__ = ["GpuSpec", "GPUS", "DIT_EFFICIENCY", "HOST_S_PER_STREAMED_BLOCK", "HOST_S_PER_STREAMED_BLOCK_FP8",
           "HOST_S_PER_STREAMED_BLOCK_QUANTIZED", "HOST_S_PER_STREAMED_BLOCK_GGUF",
           "HOST_S_PER_STREAMED_BLOCK_BY_FORMAT", "LAUNCH_S_PER_BLOCK", "COPY_LATENCY_S", "LORA_BYTES_PER_WEIGHT",
           "ModelCosts", "Trace", "Prediction", "record_schedule", "simulate", "predict", "bound_seconds",
           "clear_recordings", "SETTINGS", "best_setting", "model_costs"]



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
    copies: int  # copies queued in the step (streamed blocks; chunks count as one block)
    trace: Trace = field(repr=False, compare=False, default=None)
    # The last forward's timeline, in seconds from the end of the forward before's last block (the origin a GPU
    # run's per-block CUDA events share, bench/gpu_steps.py): each block's kernels (start, end), and each copy
    # into a block's memory queued in that forward or the one before (block, start, end; those before the origin
    # negative): a block's copy may be queued a forward ahead (the end-of-forward prefetch).
    block_spans: Tuple[Tuple[float, float], ...] = field(repr=False, compare=False, default=())
    copy_spans: Tuple[Tuple[int, float, float], ...] = field(repr=False, compare=False, default=())

    @property
    def ratio(self) -> float:
        return self.step_s / self.bound_s if self.bound_s > 0 else 1.0


def _busy_within(intervals: Sequence[Tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def simulate(trace: Trace, costs: ModelCosts, gpu: GpuSpec, sync_each_step: bool = True) -> Prediction:
    """Time ``trace`` on ``gpu`` (see the module docstring) and return the last forward's step."""
    if trace.num_blocks != costs.num_blocks:
        raise ValueError(f"the trace has {trace.num_blocks} blocks, the costs {costs.num_blocks}")
    block_s = costs.block_seconds(gpu)
    outside_s = costs.outside_flops / gpu.dit_flops_per_s / 2  # two outside kernels per forward
    lora = costs.lora_bytes
    # A streamed block's copy in the steady state moves its tail (streamed tails); the arming copies residents whole.
    # The arming's head copies are not in the trace: they happen once, before the timed step.
    copied, streamed_copy = costs.block_bytes, costs.streamed_copy_bytes
    host = 0.0
    ready: Dict[str, float] = {}
    busy: Dict[str, List[Tuple[float, float]]] = {}
    events: Dict[int, float] = {}
    step_end: List[float] = []
    host_busy: List[Tuple[float, float]] = []
    copies_per_forward: List[int] = []
    block_spans: List[Dict[int, Tuple[float, float]]] = []  # per forward: block -> its kernels' span
    copy_spans: List[List[Tuple[int, float, float]]] = []  # per forward: (block, start, end) of each copy

    def run(stream: str, seconds: float) -> Tuple[float, float]:
        start = max(ready.get(stream, 0.0), host)
        ready[stream] = start + seconds
        busy.setdefault(stream, []).append((start, start + seconds))
        return start, start + seconds

    def spend(seconds: float) -> None:
        nonlocal host
        host_busy.append((host, host + seconds))
        host += seconds

    for op in trace.ops:
        kind = op[0]
        if kind == "copy":
            _, stream, block, fraction = op
            if block is not None and not trace.resident[block] and fraction >= 1.0:
                spend(costs.host_s_per_streamed_block)
            nbytes = (copied[block] if trace.resident[block] else streamed_copy[block]) * fraction \
                if block is not None else 0.0
            span = run(stream, COPY_LATENCY_S + nbytes / gpu.h2d_bytes_per_s)
            copies_per_forward[-1] += 1
            if block is not None:
                copy_spans[-1].append((block, *span))
        elif kind == "kernel":
            _, stream, what, block = op
            if what == "block":
                spend(costs.launch_s_per_block)
                block_spans[-1][block] = run(stream, block_s[block])
            elif what == "outside":
                run(stream, outside_s)
            elif what == "transform":
                run(stream, (lora[block] if lora is not None else 0.0) / gpu.hbm_bytes_per_s)
            else:
                raise ValueError(f"unknown kernel {what!r} in the trace")
        elif kind == "record":
            events[op[2]] = max(ready.get(op[1], 0.0), host)
        elif kind == "wait":
            if op[2] in events:  # waiting on an event never recorded is a no-op, as in CUDA
                ready[op[1]] = max(ready.get(op[1], 0.0), events[op[2]])
        elif kind == "host_event":
            host = max(host, events.get(op[1], host))
        elif kind == "host_stream":
            host = max(host, ready.get(op[1], 0.0))
        elif kind == "forward":
            copies_per_forward.append(0)
            block_spans.append({})
            copy_spans.append([])
        elif kind == "step_end":
            if sync_each_step:
                host = max(host, ready.get("compute", 0.0))
            step_end.append(ready.get("compute", 0.0))
        else:
            raise ValueError(f"unknown operation {op!r} in the trace")

    if len(step_end) < 2:
        raise ValueError("the trace needs at least two forwards")
    start, end = step_end[-2], step_end[-1]
    step = end - start
    copy_busy = _busy_within(busy.get("copy", []), start, end)
    compute_busy = _busy_within(busy.get("compute", []), start, end)
    streamed = sum(streamed_copy[i] for i in trace.streamed_blocks)
    origin = block_spans[-2][trace.num_blocks - 1][1]  # the forward before's last block ends
    last = block_spans[-1]
    return Prediction(
        step_s=step, bound_s=bound_seconds(costs, gpu, trace.resident), compute_s=costs.compute_seconds(gpu),
        copy_s=streamed / gpu.h2d_bytes_per_s, copy_idle_s=(step - copy_busy) if trace.streamed_blocks else 0.0,
        compute_stall_s=step - compute_busy, host_s=_busy_within(host_busy, start, end),
        copies=copies_per_forward[-1], trace=trace,
        block_spans=tuple((last[i][0] - origin, last[i][1] - origin) for i in range(trace.num_blocks)),
        copy_spans=tuple((b, a - origin, e - origin) for b, a, e in copy_spans[-2] + copy_spans[-1]))


def predict(costs: ModelCosts, gpu: GpuSpec, resident_count: int, policy: str = "leading", prefetch: int = 1,
            sync_each_step: bool = True, tails: Optional[Sequence[int]] = None) -> Prediction:
    """The manager's schedule for this plan (recorded once per block count and plan), timed on ``gpu``; ``tails``:
    per block, the bytes it streams (streamed tails: the schedule is the same, each copy moves its tail)."""
    if tails:
        costs = dataclasses.replace(costs, tail_bytes=tuple(tails))
    trace = record_schedule(costs.num_blocks, resident_count, policy, prefetch, costs.lora_bytes is not None)
    return simulate(trace, costs, gpu, sync_each_step)


# ----------------------------------------------------------------------------------------------- choosing

# The policy x prefetch depths auto chooses from. Deeper rings only for leading: where the residents are the model's
# biggest blocks and come first (Flux's double blocks, 2.4x a single block's bytes), the copy engine idles while
# they compute unless the ring can take the copies of that whole stretch; strided needs no more than 2 (it keeps
# smaller blocks resident instead, and streams more bytes). In the model, Flux.1-dev on an H200 with 18-32 blocks
# resident needs leading 6-16 to come within 1.05x its bound (bench/results/timing_model.md).
SETTINGS: Tuple[Tuple[str, int], ...] = (("leading", 1), ("strided", 1), ("leading", 2), ("strided", 2),
                                         ("leading", 3), ("strided", 3), ("leading", 4), ("strided", 4),
                                         ("leading", 6), ("leading", 8), ("leading", 12), ("leading", 16))


def best_setting(costs: ModelCosts, gpu: GpuSpec, resident_count: int, within: float = 1.05,
                 settings: Sequence[Tuple[str, int]] = SETTINGS):
    """The (policy, prefetch, Prediction) that predicts a step within ``within`` x the bound and holds the fewest
    device bytes (ties: the earlier in ``settings``); None when none does."""
    from .schedule import Schedule, choose_resident_blocks

    best = None
    for policy, prefetch in settings:
        schedule = Schedule(choose_resident_blocks(costs.num_blocks, resident_count, policy))
        nbytes = schedule.device_bytes(costs.block_bytes, prefetch)
        if best is not None and nbytes >= best[0]:
            continue
        prediction = predict(costs, gpu, resident_count, policy, prefetch)
        if prediction.ratio <= within:
            best = (nbytes, policy, prefetch, prediction)
    return None if best is None else best[1:]
