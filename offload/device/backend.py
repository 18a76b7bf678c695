"""How copies reach the compute device: a side stream with events, or synchronously on the CPU.

Both backends answer the same four calls, so the manager runs one code path whether it drives a
GPU or loops back onto the CPU in tests.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

import torch


class CopyHandle:
    """Something the compute side can wait on before it reads a copied block."""

    __slots__ = ("done", "started")

    def __init__(self, done, started=None):
        self.done = done
        self.started = started


class SyncBackend:
    """Copies happen at once on the calling thread; waiting is free.

    Used when the compute device is the host (CPU loopback) or an accelerator without streams.
    The time spent copying is all stall here, because nothing overlaps.
    """

    asynchronous = False

    def __init__(self, device: torch.device, measure_time: bool = True):
        self.device = device
        self.measure_time = measure_time
        self.copy_seconds = 0.0
        self.stall_seconds = 0.0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, then=None) -> Optional[CopyHandle]:
        start = time.perf_counter() if self.measure_time else 0.0
        dst.copy_(src)
        if then is not None:
            then()
        if self.measure_time:
            elapsed = time.perf_counter() - start
            self.copy_seconds += elapsed
            self.stall_seconds += elapsed
        return None

    def wait_for_copy(self, handle: Optional[CopyHandle]) -> None:
        pass

    def mark_compute(self):
        return None

    def order_compute_after(self, handle: Optional[CopyHandle]) -> None:
        pass

    def wait_host(self, handle: Optional[CopyHandle]) -> None:
        pass

    def settle(self, block: bool = True) -> None:
        pass

    def synchronize(self) -> None:
        pass


class StreamBackend:
    """Copies go on a dedicated stream; the compute stream waits on events, never the host."""

    asynchronous = True

    def __init__(self, device: torch.device, measure_time: bool = True, module=None):
        self.device = device
        self.measure_time = measure_time
        # ``module``: what answers for ``torch.cuda`` (tests/cuda_standin.py runs this class on the CPU with it).
        self.module = module if module is not None else torch.get_device_module(device)
        self.copy_stream = self.module.Stream(device=device)
        self.transform_stream = None  # made at the first after-copy transform (a LoRA on the device)
        self.copy_seconds = 0.0
        self.stall_seconds = 0.0
        # (start, end, is_stall) event pairs not yet read; read lazily so the host never blocks per block.
        self._pending: List[Tuple[object, object, bool]] = []

    def _event(self):
        return self.module.Event(enable_timing=self.measure_time)

    # Events per copy: its end (what the compute stream waits on) always; with ``measure_time`` its start (copy
    # time) and the compute stream's arrival at its wait (stall time) too, read lazily by :meth:`settle`.

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after=None, then=None) -> CopyHandle:
        """Queue ``dst.copy_(src)`` on the copy stream after ``after``, then ``then()`` (kernels on the copied
        data: a LoRA applied on the device) on a stream of its own once the copy is done; the returned handle's
        event follows both. The copy stream never waits for ``then``: the next block's copy starts as soon as
        this one's bytes are in, while its LoRA math runs beside it. A slot is only refilled after the compute
        stream read it, and the compute stream waits for this handle, so ``then``'s writes are done by then."""
        started = None
        with self.module.stream(self.copy_stream):
            if after is not None:
                # The slot may still be read by a block queued earlier on the compute stream.
                self.copy_stream.wait_event(after)
            if self.measure_time:
                started = self._event()
                started.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            done = self._event()
            done.record(self.copy_stream)
        if then is not None:
            if self.transform_stream is None:
                self.transform_stream = self.module.Stream(device=self.device)
            with self.module.stream(self.transform_stream):
                self.transform_stream.wait_event(done)
                then()
                done = self._event()
                done.record(self.transform_stream)
        if self.measure_time:
            self._pending.append((started, done, False))
            if len(self._pending) > 4096:  # nobody reads the stats: fold what has finished
                self.settle(block=False)
        return CopyHandle(done, started)

    def wait_for_copy(self, handle: Optional[CopyHandle]) -> None:
        if handle is None:
            return
        compute = self.module.current_stream(self.device)
        if self.measure_time:
            # The compute stream goes on at the later of reaching this wait and the copy's end: it stalled from the
            # one to the other (not at all when the copy ended first). One event here; the copy's own is the other.
            before = self._event()
            before.record(compute)
            compute.wait_event(handle.done)
            self._pending.append((before, handle.done, True))
        else:
            compute.wait_event(handle.done)

    def wait_host(self, handle: Optional[CopyHandle]) -> None:
        """Block the host until the copy behind ``handle`` has finished (its source may then be changed)."""
        if handle is not None:
            handle.done.synchronize()

    def order_compute_after(self, handle: Optional[CopyHandle]) -> None:
        """Make the compute stream wait for ``handle`` (no stall is counted: no block waits to run on it)."""
        if handle is not None:
            self.module.current_stream(self.device).wait_event(handle.done)

    def mark_compute(self):
        event = self.module.Event()
        event.record(self.module.current_stream(self.device))
        return event

    def settle(self, block: bool = True) -> None:
        """Fold finished timing events into the totals; with ``block`` wait for all of them.

        ``elapsed_time`` raises unless both of its events are complete, and the two of a pair are on different
        streams (a stall's start on the compute stream, its end on the copy stream): a copy that ended before
        compute reached its wait leaves the end complete and the start not, while the host runs ahead."""
        keep = []
        for start, end, is_stall in self._pending:
            if block:
                start.synchronize()
                end.synchronize()
            elif not (end.query() and start.query()):
                keep.append((start, end, is_stall))
                continue
            seconds = start.elapsed_time(end) / 1000.0
            if is_stall:
                self.stall_seconds += max(0.0, seconds)
            else:
                self.copy_seconds += seconds
        self._pending = keep

    def synchronize(self) -> None:
        self.copy_stream.synchronize()
        if self.transform_stream is not None:
            self.transform_stream.synchronize()


def normalize_device(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current one), so device comparisons with tensors hold."""
    if device.type == "cpu" or device.index is not None:
        return device
    try:
        return torch.device(device.type, torch.get_device_module(device).current_device())
    except (AttributeError, RuntimeError, AssertionError):
        return device


def make_backend(device: torch.device, measure_time: bool = True):
    if device.type == "cpu":
        return SyncBackend(device, measure_time)
    try:
        module = torch.get_device_module(device)
    except (RuntimeError, AttributeError):
        module = None
    if module is not None and hasattr(module, "Stream") and hasattr(module, "Event") and hasattr(module, "stream"):
        return StreamBackend(device, measure_time)
    return SyncBackend(device, measure_time)
