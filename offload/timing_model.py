"""A timing model of one sampling step: the manager's real copy/compute schedule, given durations.

Whether block copies hide behind compute cannot be measured without a GPU, but it can be predicted: the order in
which the manager queues copies, waits and block kernels on its two streams is fixed by its code, and the time
each of those takes follows from bytes, FLOPs and a GPU's published figures. This module does both halves:

1. **Replay** (:func:`record_schedule`). The real :class:`~.manager.LayerwiseOffloadManager` runs a few forwards of
   a tiny stand-in model (one 64-byte weight per block, as many blocks as the real model) with its real
   :class:`~.device_backend.StreamBackend`, whose ``torch.cuda`` is replaced by a recorder: streams and events log
   what is queued on them (``wait_event``, ``record``, ``synchronize``), a dispatch mode logs every ``copy_`` into
   the manager's device memory on the stream current when it is queued, the blocks log their kernels on whichever
   stream is current when they run, and an after-copy transform (a LoRA applied on the device, if asked for) logs
   itself the same way. Nothing of the schedule is written down here: change the manager's order and the trace
   changes with it.
   (The same idea as the vector-clock stand-in of ``tests/unit/test_stream_ordering.py``, which checks the order
   for races; here the order is kept and timed.)
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

The reference GPUs (:data:`GPUS`) carry their sources in ``source``.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GpuSpec", "GPUS", "DIT_EFFICIENCY", "HOST_S_PER_STREAMED_BLOCK", "HOST_S_PER_STREAMED_BLOCK_FP8",
           "HOST_S_PER_STREAMED_BLOCK_QUANTIZED", "HOST_S_PER_STREAMED_BLOCK_GGUF",
           "HOST_S_PER_STREAMED_BLOCK_BY_FORMAT",
           "LAUNCH_S_PER_BLOCK", "COPY_LATENCY_S", "ModelCosts", "Trace", "Prediction", "record_schedule",
           "simulate", "predict", "bound_seconds", "clear_recordings", "SETTINGS",
           "best_setting"]

# ----------------------------------------------------------------------------------------------- figures

DIT_EFFICIENCY = 0.7  # a DiT block's kernels (GEMMs, flash attention, norms, RoPE, gates) vs a big square GEMM
# The manager's Python time per streamed block, by weight format: the worst median of the "after" rows of
# bench/results/host_time.csv (bench/host_time.py on the project's 2-core CPU, ComfyUI 0.3.75 and 0.33.0, three runs;
# the quietest runs are up to 2x faster). Not in it: a GPU's C++ tensor trade per quantized weight (~1.7 us each).
HOST_S_PER_STREAMED_BLOCK = 0.116e-3  # plain bf16 / fp16 weights
HOST_S_PER_STREAMED_BLOCK_FP8 = 0.082e-3  # plain fp8 weights (e4m3fn, unscaled)
HOST_S_PER_STREAMED_BLOCK_QUANTIZED = 0.217e-3  # ComfyUI's QuantizedTensor weights (fp8 scaled)
HOST_S_PER_STREAMED_BLOCK_GGUF = 0.156e-3  # ComfyUI-GGUF's GGMLTensor weights
HOST_S_PER_STREAMED_BLOCK_BY_FORMAT = {"bf16": HOST_S_PER_STREAMED_BLOCK, "fp8": HOST_S_PER_STREAMED_BLOCK_FP8,
                                       "quantized": HOST_S_PER_STREAMED_BLOCK_QUANTIZED,
                                       "gguf": HOST_S_PER_STREAMED_BLOCK_GGUF}
LAUNCH_S_PER_BLOCK = 0.15e-3  # launching one block's ~25-40 kernels from Python, hooks included
COPY_LATENCY_S = 10e-6  # per queued copy: DMA set-up, event records


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the model sees it.

    h2d_bytes_per_s: pinned host-to-device copy rate of one copy engine (measured figures, not the link's raw rate).
    matmul_flops_per_s: achievable dense bf16 matmul rate (fp32 accumulate, as PyTorch runs bf16 GEMMs).
    hbm_bytes_per_s: device memory bandwidth (casts, dequantisation, LoRA math are bound by it).
    """

    name: str
    vram_bytes: int
    h2d_bytes_per_s: float
    matmul_flops_per_s: float
    hbm_bytes_per_s: float
    source: str = ""

    @property
    def dit_flops_per_s(self) -> float:
        return self.matmul_flops_per_s * DIT_EFFICIENCY


GiB = 2 ** 30
GPUS: Dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("RTX 3060 12GB", 12 * GiB, 24e9, 0.9 * 25.5e12, 360e9,
            "GA106, 28 SMs at 1.777 GHz boost: 51 TFLOP/s dense fp16 with fp16 accumulate, half that (25.5) "
            "with fp32 accumulate on GeForce Ampere (GA102 whitepaper's rate per SM); x0.9 achievable. PCIe 4.0 x16, "
            "pinned H2D ~24 GB/s. GDDR6 192-bit 360 GB/s."),
    GpuSpec("RTX 4090 24GB", 24 * GiB, 25e9, 0.9 * 165.2e12, 1008e9,
            "Ada whitepaper: 165.2 TFLOP/s dense bf16/fp16 with fp32 accumulate (330.3 with fp16 accumulate; "
            "82.6 is the non-tensor fp32 rate); x0.9 achievable. PCIe 4.0 x16 pinned H2D ~25 GB/s (DESIGN.md "
            "section 4; 27 GB/s measured, section 6). GDDR6X 1008 GB/s."),
    GpuSpec("RTX 5090 32GB", 32 * GiB, 54e9, 0.9 * 209.5e12, 1792e9,
            "Blackwell GeForce: 419 TFLOP/s dense fp16 tensor (838 sparse), 209.5 with fp32 accumulate; x0.9 "
            "achievable. PCIe 5.0 x16 pinned H2D 53-56 GB/s (DESIGN.md section 4). GDDR7 1792 GB/s."),
    GpuSpec("H200 141GB", 141 * 10 ** 9, 55e9, 790e12, 4.8e12,
            "790 TFLOP/s measured on an 8192^3 bf16 matmul (DESIGN.md section 4; datasheet 989 dense). PCIe 5.0 "
            "x16 pinned H2D ~55 GB/s (DESIGN.md). HBM3e 4.8 TB/s."),
)}


# ----------------------------------------------------------------------------------------------- the recorder

class _Event:
    _count = 0

    def __init__(self, log: list, enable_timing: bool = False):
        _Event._count += 1
        self.id = _Event._count
        self._log = log

    def record(self, stream=None) -> None:
        self._log.append(("record", stream.name, self.id))

    def synchronize(self) -> None:
        self._log.append(("host_event", self.id))

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class _Stream:
    def __init__(self, name: str, log: list):
        self.name = name
        self._log = log

    def wait_event(self, event) -> None:
        self._log.append(("wait", self.name, event.id))

    def synchronize(self) -> None:
        self._log.append(("host_stream", self.name))


class _RecordingDevice:
    """What StreamBackend asks of ``torch.cuda`` (Stream, Event, stream(), current_stream()), logging instead."""

    def __init__(self):
        self.log: List[tuple] = []
        self.compute = _Stream("compute", self.log)
        self.current = self.compute
        self._copy_streams = 0

    def Event(self, enable_timing: bool = False):
        return _Event(self.log, enable_timing)

    def Stream(self, device=None):
        self._copy_streams += 1
        return _Stream("copy" if self._copy_streams == 1 else f"side{self._copy_streams}", self.log)

    @contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self, device=None):
        return self.current


def _recording_backend(device: _RecordingDevice):
    from .device.backend import StreamBackend

    class RecordingBackend(StreamBackend):
        """The real StreamBackend over the recorder (its constructor asks torch for a device module)."""

        def __init__(self):
            self.module = device
            self.device = torch.device("cpu")
            self.measure_time = True
            self.copy_stream = device.Stream()
            self.transform_stream = None
            self.copy_seconds = self.stall_seconds = 0.0
            self._pending = []

    return RecordingBackend()


class _CopyLog(TorchDispatchMode):
    """Logs every ``copy_`` into the manager's device memory (a resident's own buffer, or a slot: the block is the
    slot's owner), on the stream current when it was queued: on the copy stream it is the copy engine's work, on
    the compute stream it would hold the compute stream (the model times it wherever the manager puts it)."""

    def __init__(self, device: _RecordingDevice, manager):
        super().__init__()
        self.device = device
        self.manager = manager

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.copy_.default:
            dst = args[0]
            found, index = self._block_of(dst)
            if found:
                nbytes = dst.numel() * dst.element_size()
                whole = self.manager.store.layouts[index].nbytes if index is not None else nbytes
                self.device.log.append(("copy", self.device.current.name, index, nbytes / max(whole, 1)))
        return out

    def _block_of(self, dst: torch.Tensor) -> Tuple[bool, Optional[int]]:
        """(whether ``dst`` is in the manager's device memory, the block it belongs to)."""
        memory = self.manager.device_memory
        pointer = dst.untyped_storage().data_ptr()
        for index, buffer in memory.residents.items():
            if buffer.untyped_storage().data_ptr() == pointer:
                return True, index
        for slot, buffer in enumerate(memory.slots):
            if buffer.untyped_storage().data_ptr() == pointer:
                return True, memory.slot_owner[slot]
        return False, None


class _Block(nn.Module):
    """A stand-in block: one tiny weight (so the manager stores, copies and releases it), and a kernel it logs."""

    def __init__(self, index: int, device: _RecordingDevice):
        super().__init__()
        self.index = index
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self._device = device

    def forward(self, x):
        self._device.log.append(("kernel", self._device.current.name, "block", self.index))
        return x + self.weight.sum()  # reads the weight: a released block would fail here


class _Model(nn.Module):
    """Runs the embedders (outside compute), every block in list order, the final layer, and the sampler's
    read-back of the step's result (a host synchronize of the compute stream)."""

    def __init__(self, num_blocks: int, device: _RecordingDevice):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(i, device) for i in range(num_blocks))
        self._device = device

    def forward(self, x):
        log = self._device.log
        log.append(("kernel", self._device.current.name, "outside", None))
        for block in self.blocks:
            x = block(x)
        log.append(("kernel", self._device.current.name, "outside", None))
        return x


class _AnyPinner:
    """Grants every page-lock (the model assumes a pinned store)."""

    def register(self, tensor) -> bool:
        return True

    def unregister(self, tensor) -> None:
        pass


# ----------------------------------------------------------------------------------------------- the trace

@dataclass(frozen=True)
class Trace:
    """The operations of ``forwards`` forwards, in the order the host issued them.

    Each op is a tuple: ``("copy", stream, block, fraction of the block)``, ``("kernel", stream, "block" |
    "outside" | "transform", block)``, ``("record", stream, event)``, ``("wait", stream, event)``,
    ``("host_event", event)``, ``("host_stream", stream)``, ``("forward", k)`` (forward k begins) and
    ``("step_end", k)`` (forward k's results are read back by the sampler).
    """

    num_blocks: int
    resident: Tuple[bool, ...]
    policy: str
    prefetch: int
    transform: bool
    ops: Tuple[tuple, ...]
    forwards: int

    @property
    def streamed_blocks(self) -> Tuple[int, ...]:
        return tuple(i for i, keep in enumerate(self.resident) if not keep)

    def forward_ops(self, k: int) -> Tuple[tuple, ...]:
        """The ops issued from forward ``k``'s start to the next one's."""
        starts = [i for i, op in enumerate(self.ops) if op[0] == "forward"] + [len(self.ops)]
        return self.ops[starts[k]:starts[k + 1]]


class _Session:
    """One stand-in model and its manager, replanned for each schedule recorded (packing the host store once per
    block count). ``replan`` and ``set_after_copy`` are the manager's own ways to change a plan; the forwards that
    follow arm it afresh, as after any replan."""

    def __init__(self, num_blocks: int):
        from .host.side import HostEnvironment
        from .manager import LayerwiseOffloadManager

        self.device = device = _RecordingDevice()
        self.model = _Model(num_blocks, device)
        manager = LayerwiseOffloadManager(list(self.model.blocks), "cpu", pin_memory=True, environment=HostEnvironment(
            pinner=_AnyPinner(), available_host_bytes=lambda: 2 ** 40), backend=_recording_backend(device))
        manager.copier.bounce_bytes = 4096
        manager.attach(self.model)
        self.manager = manager

        def lora(index, weights):
            device.log.append(("kernel", device.current.name, "transform", index))
        self.lora = lora

    def record(self, resident_count: int, policy: str, prefetch: int, transform: bool, forwards: int):
        device, manager = self.device, self.manager
        manager.set_after_copy(self.lora if transform else None)
        manager.replan(resident_layers=resident_count, prefetch_size=prefetch, policy=policy)
        device.log.clear()
        x = torch.zeros(1)
        with torch.no_grad(), _CopyLog(device, manager):
            for k in range(forwards):
                device.log.append(("forward", k))
                self.model(x)
                device.log.append(("step_end", k))
        ops = tuple(device.log)
        device.log.clear()
        return manager.schedule.resident, ops

    def close(self) -> None:
        self.manager.detach()


_SESSIONS: Dict[int, _Session] = {}


def _record(num_blocks: int, resident_count: int, policy: str, prefetch: int, transform: bool, forwards: int,
            fresh: bool) -> Trace:
    session = None if fresh else _SESSIONS.pop(num_blocks, None)
    if session is None:
        session = _Session(num_blocks)
    try:
        resident, ops = session.record(resident_count, policy, prefetch, transform, forwards)
    except BaseException:
        session.close()
        raise
    if fresh:
        session.close()
    else:
        _SESSIONS[num_blocks] = session
    return Trace(num_blocks, resident, policy, prefetch, transform, ops, forwards)


@functools.lru_cache(maxsize=4096)
def record_schedule(num_blocks: int, resident_count: int, policy: str = "leading", prefetch: int = 1,
                    transform: bool = False, forwards: int = 3, fresh: bool = False) -> Trace:
    """Run the real manager for ``forwards`` forwards of a ``num_blocks``-block stand-in and return what it
    queued (see the module docstring). ``transform``: with an after-copy transform (a LoRA on the device).
    ``fresh``: a new manager rather than the one kept for this block count (replanned; the same steady state).
    Cached: ``record_schedule.cache_clear()`` after changing the manager's code at run time (tests do)."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if forwards < 2:
        raise ValueError(f"a step is timed between two forwards' ends: forwards must be >= 2, got {forwards}")
    return _record(num_blocks, resident_count, policy, prefetch, transform, forwards, fresh)


def clear_recordings() -> None:
    """Forget every recorded schedule and the stand-in managers (after the manager's code changed at run time)."""
    record_schedule.cache_clear()
    while _SESSIONS:
        _SESSIONS.popitem()[1].close()


# ----------------------------------------------------------------------------------------------- costs

@dataclass(frozen=True)
class ModelCosts:
    """What one model costs per block, whatever the GPU.

    block_bytes: bytes each block copies (its stored size: bf16, fp8 or GGUF bytes).
    block_flops: FLOPs of one forward of each block at the workflow's shape (cond and uncond batched).
    outside_flops: FLOPs of the forward outside the blocks (embedders, final layer).
    cast_bytes: per block, device-memory bytes its per-forward weight casts or dequantisation move (0 for bf16).
    lora_bytes: per block, device-memory bytes of the LoRA math an after-copy transform does (None: no LoRA).
    host_s_per_streamed_block, launch_s_per_block: host costs (see the module docstring).
    """

    block_bytes: Tuple[int, ...]
    block_flops: Tuple[float, ...]
    outside_flops: float = 0.0
    cast_bytes: Optional[Tuple[int, ...]] = None
    lora_bytes: Optional[Tuple[int, ...]] = None
    host_s_per_streamed_block: float = HOST_S_PER_STREAMED_BLOCK
    launch_s_per_block: float = LAUNCH_S_PER_BLOCK

    def __post_init__(self):
        if len(self.block_bytes) != len(self.block_flops):
            raise ValueError(f"block_bytes has {len(self.block_bytes)} blocks, block_flops {len(self.block_flops)}")
        for name in ("cast_bytes", "lora_bytes"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.block_bytes):
                raise ValueError(f"{name} has {len(value)} blocks, block_bytes {len(self.block_bytes)}")

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)

    def block_seconds(self, gpu: GpuSpec) -> List[float]:
        cast = self.cast_bytes or (0,) * self.num_blocks
        return [f / gpu.dit_flops_per_s + c / gpu.hbm_bytes_per_s for f, c in zip(self.block_flops, cast)]

    def compute_seconds(self, gpu: GpuSpec) -> float:
        return sum(self.block_seconds(gpu)) + self.outside_flops / gpu.dit_flops_per_s


def bound_seconds(costs: ModelCosts, gpu: GpuSpec, resident: Sequence[bool]) -> float:
    """DESIGN.md section 6: ``max(compute, streamed bytes / H2D)`` for one step."""
    streamed = sum(b for b, keep in zip(costs.block_bytes, resident) if not keep)
    return max(costs.compute_seconds(gpu), streamed / gpu.h2d_bytes_per_s)


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
            nbytes = costs.block_bytes[block] * fraction if block is not None else 0.0
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
    streamed = sum(costs.block_bytes[i] for i in trace.streamed_blocks)
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
            sync_each_step: bool = True) -> Prediction:
    """The manager's schedule for this plan (recorded once per block count and plan), timed on ``gpu``."""
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
