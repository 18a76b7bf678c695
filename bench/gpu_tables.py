"""What the GPU run writes and what it measures with: its CSV tables (one row on disk the moment it is measured), the
step-time bound, the VRAM ballast that makes runs physically equal in free memory, the device-level peak poller, and
the state one step hands the next. Used by ``bench/gpu_steps.py`` and its ``gpu_harness.py`` and
``gpu_dynamic.py``; nothing here imports ComfyUI.
"""

from __future__ import annotations

import csv
import json
import os
import threading
import time
from pathlib import Path
from typing import Dict, Iterable, Optional

import torch

TABLES: Dict[str, tuple] = {
    # One measured quantity per row: the preflight is a handful of numbers, not a grid.
    "preflight": ("comfyui", "name", "value", "unit", "note"),
    # Per block of a model shape, from the full-load run: compute on the device and the copy of its bytes.
    "blocks": ("comfyui", "preset", "block", "kind", "nbytes", "compute_ms", "copy_ms", "copy_over_compute",
               "note"),
    # One sampling run per row, every mode of every step: the deciding table. speedup_vs_comfy is always this
    # pack's gain over ComfyUI's own offloading at the same budget: on a pack row ComfyUI's step time over the
    # row's; on a 0.33.0 comfy_dynamic row (measured after the pack, in its own process) the row's over the pack's.
    # resident_bytes_per_step (comfy_dynamic): bytes of the modules whose VBAR pages were still resident, which
    # moved nothing; streamed_bytes_per_step counts only what was copied.
    "steps": ("comfyui", "step", "preset", "mode", "weights", "budget", "budget_bytes", "ballast_bytes",
              "num_blocks", "resident", "prefetch", "policy", "steps", "forwards_per_step", "step_ms",
              "step_ms_spread", "streamed_bytes_per_step", "stall_ms_per_step", "stall_pct", "compute_ms",
              "gbps", "bound_ms", "ratio_to_bound", "predicted_step_ms", "predicted_ratio_to_bound",
              "speedup_vs_comfy", "device_peak_bytes", "weights_device_bytes", "resident_bytes_per_step",
              "bitwise_equal_full", "seconds", "error", "tails_bytes_per_step"),
    # Per block of a sweep run's last forward, measured (CUDA events on the compute stream) beside the timing
    # model's replay of the same setting; ms from the end of the forward before's last block. measured_start is
    # queued before the manager's wait for the block's copy, so end - start includes any stall.
    "timeline": ("comfyui", "step", "preset", "resident", "policy", "prefetch", "block", "streamed",
                 "measured_start_ms", "measured_end_ms", "predicted_start_ms", "predicted_end_ms",
                 "predicted_copy_end_ms", "note"),
}


class Table:
    """``<folder>/<name>.csv`` with ``TABLES[name]``'s header, written first (a step that dies early still leaves a
    file a reader can parse); :meth:`add` appends and flushes one row, so a step cut by its cap keeps its rows."""

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


def add_step(table: Table, **fields) -> Dict[str, object]:
    """A ``steps`` row with its bound, ratio to the bound and stall share worked out from the measured fields."""
    step_ms, stall = fields.get("step_ms", ""), fields.get("stall_ms_per_step", "")
    bound = bound_ms(fields["compute_ms"], fields.get("streamed_bytes_per_step") or 0, fields["gbps"])
    return table.add(bound_ms=bound, ratio_to_bound=ratio(step_ms, bound),
                     stall_pct=ratio(stall, step_ms) and 100 * ratio(stall, step_ms), **fields)


class Ballast:
    """Holds device memory so that ``budget`` bytes stay free (None, or the CPU: nothing is taken). Not a flag:
    0.14.1's ``--reserve-vram`` reached neither ``ModelPatcherDynamic.get_free_memory`` nor comfy-aimdo, while memory
    really taken is seen alike by ComfyUI's planner, aimdo's ``cuMemGetInfo`` poll and this pack's auto plan."""

    def __init__(self, device: torch.device, budget: Optional[int]):
        self.device = torch.device(device)
        self.budget = None if budget is None else int(budget)
        self.nbytes = 0
        self._tensor: Optional[torch.Tensor] = None

    def __enter__(self) -> "Ballast":
        if self.device.type == "cuda" and self.budget is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            self.nbytes = max(0, free - self.budget) // (2 << 20) * (2 << 20)
            if self.nbytes:
                self._tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return self

    def __exit__(self, *exc) -> None:
        self._tensor = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class DevicePeak:
    """Peak device memory in use (the whole device, any allocator) over a ``with`` block, above its start, polled on
    a thread: ``max_memory_allocated`` misses aimdo's VBAR pages and ``cudaMalloc`` done elsewhere."""

    def __init__(self, device: torch.device, every_s: float = 0.002):
        self.device = torch.device(device)
        self.every_s = every_s
        self.peak_bytes: object = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._used0 = self._max = 0

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


class State:
    """Numbers one process hands the next (the device run's ``<work>/state``): bandwidth, references, budgets."""

    def __init__(self, work: Path):
        self.folder = Path(work) / "state"
        self.folder.mkdir(parents=True, exist_ok=True)

    def save(self, name: str, data: dict) -> None:
        (self.folder / f"{name}.json").write_text(json.dumps(data))

    def load(self, name: str) -> dict:
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}
