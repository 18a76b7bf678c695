"""The GPU run's tables and instruments (bench/gpu_run.sh, bench/gpu_steps.py): CSV files that get each row as it
is measured, a ballast that leaves every mode the same physical VRAM, a device-level memory poller and the bound.

Why each piece:
- ``Table`` appends and flushes one row at a time, so a step cut by its time cap (or the device call's limit)
  keeps every row it measured; the header is written when the file is created, so even a step that dies before
  its first row leaves a file a reader can parse.
- ``Ballast`` takes device memory with a plain allocation until ``budget`` bytes are free. ComfyUI 0.14.1's
  ``--reserve-vram`` reaches neither ``ModelPatcherDynamic.get_free_memory`` nor comfy-aimdo, so a flag would
  give one mode the whole GPU; memory that is really taken is seen alike by ComfyUI's planner, aimdo's
  ``cuMemGetInfo`` poll and this pack's auto plan.
- ``DevicePeak`` polls ``torch.cuda.mem_get_info`` (cudaMemGetInfo: no stream sync) on a thread:
  ``max_memory_allocated`` counts only PyTorch's caching allocator and misses aimdo's VBAR pages and
  ``cudaMalloc`` done elsewhere.
"""

from __future__ import annotations

import csv
import os
import threading
import time
from pathlib import Path
from typing import Dict, Iterable, Optional

import torch

__all__ = ["TABLES", "Table", "Ballast", "DevicePeak", "bound_ms", "ratio"]

TABLES: Dict[str, tuple] = {
    # One measured quantity per row: the preflight is a handful of numbers, not a grid.
    "preflight": ("comfyui", "name", "value", "unit", "note"),
    # Per block of a model shape, from the full-load run: compute on the device and the copy of its bytes.
    "blocks": ("comfyui", "preset", "block", "kind", "nbytes", "compute_ms", "copy_ms", "copy_over_compute",
               "note"),
    # One sampling run per row, every mode of every step: the deciding table. speedup_vs_comfy is always this
    # pack's gain over ComfyUI's own offloading at the same budget: on a pack row ComfyUI's step time over the
    # row's; on a 0.14.1 comfy_dynamic row (measured after the pack, in its own process) the row's over the pack's.
    "steps": ("comfyui", "step", "preset", "mode", "weights", "budget", "budget_bytes", "ballast_bytes",
              "num_blocks", "resident", "prefetch", "policy", "steps", "forwards_per_step", "step_ms",
              "step_ms_spread", "streamed_bytes_per_step", "stall_ms_per_step", "stall_pct", "compute_ms",
              "gbps", "bound_ms", "ratio_to_bound", "speedup_vs_comfy", "device_peak_bytes",
              "weights_device_bytes", "bitwise_equal_full", "seconds", "error"),
}


class Table:
    """``<folder>/<name>.csv`` with ``TABLES[name]``'s header; :meth:`add` appends one row and flushes it."""

    def __init__(self, folder: Path, name: str):
        if name not in TABLES:
            raise ValueError(f"[layerwise-offload] unknown table {name!r}; known: {', '.join(TABLES)}")
        self.columns = TABLES[name]
        self.path = Path(folder) / f"{name}.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists() or self.path.stat().st_size == 0:
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(self.columns)

    def add(self, **fields) -> Dict[str, object]:
        unknown = sorted(set(fields) - set(self.columns))
        if unknown:
            raise ValueError(f"[layerwise-offload] {self.path.name} has no columns {unknown}")
        row = {c: _cell(fields.get(c, "")) for c in self.columns}
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)
            f.flush()
            os.fsync(f.fileno())
        return row

    def rows(self) -> Iterable[Dict[str, str]]:
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))


def _cell(value):
    if isinstance(value, float):  # byte counts stay exact; times keep what the clock resolves
        return int(value) if value.is_integer() and abs(value) < 2**53 else f"{value:.7g}"
    return value


def bound_ms(compute_ms, streamed_bytes, gbps) -> object:
    """The step's lower bound: compute, or the wire time of what must be streamed, whichever is longer."""
    if compute_ms in ("", None):
        return ""
    wire = streamed_bytes / (gbps * 1e9) * 1e3 if gbps and streamed_bytes else 0.0
    return max(float(compute_ms), wire)


def ratio(a, b) -> object:
    return a / b if a not in ("", None) and b not in ("", None) and b else ""


class Ballast:
    """Holds device memory so that ``budget`` bytes stay free. ``budget`` None, or the CPU: nothing is taken."""

    def __init__(self, device: torch.device, budget: Optional[int]):
        self.device = torch.device(device)
        self.budget = None if budget is None else int(budget)
        self.nbytes = 0
        self.free_after = ""
        self._tensor: Optional[torch.Tensor] = None

    def __enter__(self) -> "Ballast":
        if self.device.type == "cuda" and self.budget is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            self.nbytes = max(0, free - self.budget) // (2 << 20) * (2 << 20)
            if self.nbytes:
                self._tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self.free_after = torch.cuda.mem_get_info(self.device)[0]
        return self

    def __exit__(self, *exc) -> None:
        self._tensor = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class DevicePeak:
    """Peak device memory in use (the whole device, any allocator) over a ``with`` block, above its start."""

    def __init__(self, device: torch.device, every_s: float = 0.002):
        self.device = torch.device(device)
        self.every_s = every_s
        self.peak_bytes: object = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._used0 = 0
        self._max = 0

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _poll(self) -> None:
        torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            self._max = max(self._max, self._used())
            time.sleep(self.every_s)

    def __enter__(self) -> "DevicePeak":
        if self.device.type == "cuda":
            self._used0 = self._max = self._used()
            self._thread = threading.Thread(target=self._poll, name="lwo-device-peak", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._max = max(self._max, self._used())
            self.peak_bytes = self._max - self._used0
