"""The real manager's schedule of a plan, recorded and timed: the check of the timing model (offload/timing/).

:func:`record_schedule` runs the real :class:`~layerwise_offload.offload.manager.LayerwiseOffloadManager` for a few
forwards of a tiny stand-in model (one small weight per block, as many blocks as the real model) with its real
``StreamBackend``, whose ``torch.cuda`` is replaced by a recorder: streams and events log what is queued on them, a
dispatch mode logs every ``copy_`` into the manager's device memory on the stream current when it is queued, the
blocks log their kernels, an after-copy transform (a LoRA on the device) logs itself. Nothing of the schedule is
written down here: change the manager's order and the trace changes with it.

:func:`simulate` times a trace as CUDA runs it: one host thread issues every operation in trace order, each stream
runs its work in order, an event completes when the work queued before it has, ``wait_event`` holds a stream until
then, a host synchronize holds the host. Durations and host costs are the timing model's
(``offload/timing/costs.py``), so where the product's model (``offload/timing/step.py``, computed from the plan)
and this replay differ, the schedule the model assumes is not the manager's.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..offload.timing.costs import COPY_LATENCY_S, GpuSpec, ModelCosts
from ..offload.timing.step import Prediction, Timeline, prediction

__all__ = ["Trace", "record_schedule", "clear_recordings", "simulate", "predict"]

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
    from ..offload.device.backend import StreamBackend

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
        memory = self.manager.engine.device_memory
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


class _Session:
    """One stand-in model and its manager, replanned for each schedule recorded (packing the host store once per
    block count). ``replan`` and ``after_copy`` are the manager's own ways to change a plan; the forwards that
    follow arm it afresh, as after any replan."""

    def __init__(self, num_blocks: int):
        from ..offload.host.environment import HostEnvironment
        from ..offload.manager import LayerwiseOffloadManager

        self.device = device = _RecordingDevice()
        self.model = _Model(num_blocks, device)
        manager = LayerwiseOffloadManager(list(self.model.blocks), "cpu", pin_memory=True, environment=HostEnvironment(
            pinner=_AnyPinner(), available_host_bytes=lambda: 2 ** 40), backend=_recording_backend(device))
        manager.engine.copier.bounce_bytes = 4096
        manager.attach(self.model)
        self.manager = manager

        def lora(index, weights):
            device.log.append(("kernel", device.current.name, "transform", index))
        self.lora = lora

    def record(self, resident_count: int, policy: str, prefetch: int, transform: bool, forwards: int):
        device, manager = self.device, self.manager
        manager.after_copy = self.lora if transform else None
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



# ----------------------------------------------------------------------------------------------- timing a trace

def simulate(trace: Trace, costs: ModelCosts, gpu: GpuSpec, sync_each_step: bool = True) -> Prediction:
    """Time ``trace`` on ``gpu`` (see the module docstring) and return its last forward's step."""
    if trace.num_blocks != costs.num_blocks:
        raise ValueError(f"the trace has {trace.num_blocks} blocks, the costs {costs.num_blocks}")
    block_s = costs.block_seconds(gpu)
    outside_s = costs.outside_flops / gpu.dit_flops_per_s / 2  # two outside kernels per forward
    lora = costs.lora_bytes
    # A streamed block's copy in the steady state moves its tail (streamed tails); the arming copies residents whole.
    copied, streamed_copy = costs.block_bytes, costs.streamed_copy_bytes
    line = Timeline([], {}, [], [], [], [])
    host = 0.0
    ready: Dict[str, float] = {}
    events: Dict[int, float] = {}
    spans: List[Dict[int, Tuple[float, float]]] = []  # per forward: block -> its kernels' span

    def run(stream: str, seconds: float) -> Tuple[float, float]:
        start = max(ready.get(stream, 0.0), host)
        ready[stream] = start + seconds
        line.busy.setdefault(stream, []).append((start, start + seconds))
        return start, start + seconds

    def spend(seconds: float) -> None:
        nonlocal host
        line.host_busy.append((host, host + seconds))
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
            line.copies[-1] += 1
            if block is not None:
                line.copy_spans[-1].append((block, *span))
        elif kind == "kernel":
            _, stream, what, block = op
            if what == "block":
                spend(costs.launch_s_per_block)
                spans[-1][block] = run(stream, block_s[block])
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
            line.copies.append(0)
            line.copy_spans.append([])
            spans.append({})
        elif kind == "step_end":
            if sync_each_step:
                host = max(host, ready.get("compute", 0.0))
            line.step_ends.append(ready.get("compute", 0.0))
        else:
            raise ValueError(f"unknown operation {op!r} in the trace")
    if len(line.step_ends) < 2:
        raise ValueError("the trace needs at least two forwards")
    line.block_spans = [[forward[i] for i in range(trace.num_blocks)] for forward in spans]
    return prediction(line, costs, gpu, trace.resident)


def predict(costs: ModelCosts, gpu: GpuSpec, resident_count: int, policy: str = "leading", prefetch: int = 1,
            sync_each_step: bool = True, tails: Optional[Sequence[int]] = None) -> Prediction:
    """The manager's recorded schedule for this plan (once per block count and plan), timed on ``gpu``: what
    ``offload.timing.step.predict`` computes from the plan, by replay."""
    if tails:
        costs = dataclasses.replace(costs, tail_bytes=tuple(tails))
    trace = record_schedule(costs.num_blocks, resident_count, policy, prefetch, costs.lora_bytes is not None)
    return simulate(trace, costs, gpu, sync_each_step)
