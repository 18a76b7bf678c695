"""What one benchmark run is: its settings, its result, and the columns of its tables (see comfy_bench.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

COLUMNS = [
    "preset", "device", "dtype", "mode", "budget", "budget_bytes", "num_blocks", "resident", "prefetch", "policy",
    "footprint_bytes", "fits_budgets", "steps", "forwards_per_step", "step_ms", "step_ms_spread",
    "weights_device_bytes", "peak_alloc_bytes", "streamed_bytes_per_forward", "h2d_bytes_per_step",
    "stall_ms_per_step", "copy_gbps", "h2d_gbps", "bound_ms", "step_over_bound", "bitwise_equal", "error",
]

SUMMARY_COLUMNS = [
    "budget", "budget_bytes", "comfy_step_ms", "comfy_h2d_bytes_per_step", "comfy_weights_device_bytes",
    "comfy_bound_ms", "layerwise_config", "layerwise_step_ms", "layerwise_h2d_bytes_per_step",
    "layerwise_footprint_bytes", "layerwise_stall_ms_per_step", "layerwise_bound_ms", "speedup_vs_comfy",
    "auto_resident", "auto_step_ms", "full_step_ms",
]

MODES = ("full", "comfy_lowvram", "layerwise", "layerwise_auto")
CPU_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_CPU_LOOPBACK"


@dataclass
class BenchConfig:
    preset: str = "tiny"
    device: str = "auto"  # cpu | cuda | auto
    dtype: Optional[str] = None  # bf16 | fp16 | fp32; None: the preset's
    blocks: Optional[Tuple[int, ...]] = None  # block counts per block list; None: the preset's
    steps: int = 6
    seed: int = 0
    budgets: Sequence[str] = ("0.3", "0.5", "0.7", "0.9")
    residents: Optional[Sequence[int]] = None  # None: auto (quartiles + what fits each budget)
    prefetch: Sequence[int] = (1, 2, 4)
    policies: Sequence[str] = ("leading", "strided")
    out: Optional[Path] = None
    plot: bool = True
    threads: Optional[int] = None  # CPU only: torch threads during the runs (None: 1 on the CPU)
    deadline_s: Optional[float] = None  # stop starting layerwise runs after this many seconds
    quiet: bool = False
    inference_mode: bool = True  # sample under torch.inference_mode(), as ComfyUI's executor does
    formats: Sequence[str] = ()  # weight formats to compare (bench_formats.py); empty: the side-by-side run


@dataclass
class BenchResult:
    config: BenchConfig
    rows: List[Dict[str, object]]
    summary: List[Dict[str, object]]
    meta: Dict[str, object]
    block_nbytes: List[int]
    non_block_bytes: int
    budgets: List[Tuple[str, int]]
    files: Dict[str, str] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
