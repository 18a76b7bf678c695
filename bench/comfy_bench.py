"""Side-by-side benchmark inside the real ComfyUI (in-process): full load, ComfyUI's own partial loading,
and this pack's layerwise offload, at the same VRAM budgets.

    python -P bench/comfy_bench.py --preset flux --device cuda --out bench/results/gpu
    python -P bench/comfy_bench.py --preset flux,wan21_14b,qwen_image --device cuda --deadline-s 90 --out DIR
    python -P bench/comfy_bench.py --preset tiny --device cpu --steps 10 --budgets 0.6,0.75,0.9 --out bench/results
    (the last one is the committed CPU proxy; bench/gpu_run.sh is the one-call GPU run)

Budgets (``--budgets``, default 0.3,0.5,0.7,0.9): a fraction f means the non-block weights plus f times the blocks'
bytes; a size (12GiB, 800MiB) is taken as is. B is a budget for WEIGHTS on the device (what ComfyUI's
``lowvram_model_memory`` means); activations come on top in every mode.

Model: a DiT built from ComfyUI's own classes (``bench/dit_presets.py``) with random weights, real-size blocks
but fewer of them, bf16 on a GPU (float32 for the ``tiny`` CPU preset).

Modes (all sample the same latent with the same noise, Euler, ``--steps`` steps, through ``comfy.sample.sample``,
the function the KSampler node calls, so ComfyUI's ``load_models_gpu`` places the weights every time):

``full``           (a) everything resident: ComfyUI's own full load.
``comfy_lowvram``  (b) ComfyUI's partial loading ("lowvram") at each budget B: ``load_models_gpu`` runs as usual
                   but hands ``LoadedModel.model_load`` the weight budget B instead of the number its free-memory
                   heuristic computed (see :func:`comfy_weight_budget` for why this hook and not a faked
                   ``get_free_memory``). ``ModelPatcher.partially_load`` -> ``load()`` then picks what stays on the
                   device (largest modules first) and marks the rest lowvram, which ``comfy.ops`` casts to the
                   device on every forward. On the CPU ComfyUI never does this on its own; the same hook drives it
                   there too (weights are "cast" onto the device they already live on, so nothing moves).
``layerwise``      (c) this pack's node (``offload_model``) for each resident count x prefetch x policy of the
                   sweep. Its footprint (``model_size()``: non-block weights + resident blocks + prefetch slots)
                   is compared with each budget: the ``fits_budgets`` column, and the per-budget summary picks the
                   fastest configuration that fits. On the CPU it runs the CPU loopback
                   (LAYERWISE_OFFLOAD_CPU_LOOPBACK=1, set only while the benchmark runs).
``layerwise_auto`` the node with resident_layers=-1 (auto) at each budget B, with B handed to it the same way as to
                   ComfyUI's lowvram (the node caps its residents to ComfyUI's budget). Skipped, with a note, when the
                   node does not accept -1.

Every run samples under ``torch.inference_mode()`` like ComfyUI's executor (``--no-inference-mode`` to turn it off).
A run that raises becomes a row with ``error`` set; the sweep goes on.

Measured per run (one sampling of ``--steps`` steps; step 1 absorbs loading, arming and warm-up, so the step time
is the median of the ``steps - 1`` intervals between the sampler's per-step callbacks, CUDA events on a GPU,
``perf_counter`` on the CPU):

- ``step_ms``: median step time (``step_ms_spread``: max - min of the intervals). ``forwards_per_step``:
  diffusion-model forwards per step (cfg 1 runs one; cfg > 1 runs cond and uncond, batched into one forward when
  memory allows).
- ``weights_device_bytes``: weight bytes ComfyUI / the manager hold on the device (full: ``loaded_size()``;
  comfy_lowvram: ``loaded_size()`` + the cast buffer ComfyUI reserved; layerwise: non-block weights + the
  manager's resident buffers and slots). ``peak_alloc_bytes``: ``torch.cuda.max_memory_allocated`` over the run
  (weights + activations; GPU only).
- ``streamed_bytes_per_forward``: layerwise: the streamed blocks' bytes; comfy_lowvram: the bytes of the modules
  ComfyUI left lowvram (cast every forward). ``h2d_bytes_per_step``: bytes actually copied host-to-device per step
  (layerwise: the manager's counters; comfy_lowvram: counted in ``comfy.ops.cast_bias_weight`` for lowvram
  modules), so it equals ``streamed_bytes_per_forward * forwards_per_step``.
- ``stall_ms_per_step``: time compute waited for copies (the manager's stats; on the CPU loopback every copy is
  a stall). ``copy_gbps``: the manager's achieved copy rate.
- ``h2d_gbps``: host-to-device bandwidth measured in the same run: a pinned host -> device copy of one
  block-sized buffer (a plain ``copy_`` on the CPU). ``bound_ms`` = max(full-load step time,
  h2d_bytes_per_step / h2d_gbps): what a perfect overlap of copies and compute would give.
- ``bitwise_equal``: the output latent is bit-for-bit the full-load output.

Outputs: a printed table, ``<out>/comfy_bench_<preset>_<device>.csv`` (every run), ``..._summary.csv`` (one row per
budget: ComfyUI's point against the fastest fitting layerwise configuration), ``..._meta.json`` (versions,
sizes) and ``..._plot.png`` (step time against resident count, with the bound and ComfyUI's point at each budget;
needs matplotlib, skipped with a message otherwise).

On the CPU the absolute times mean nothing (no PCIe, two cores shared with other work): the CPU run checks the
harness and the accounting. Real numbers come from a GPU (``bench/gpu_run.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_NAME = "layerwise_offload"


def _comfy_env():
    """devtools/comfy_env.py, loaded by path (it has no relative imports), with the pack registered."""
    module = sys.modules.get(f"{PACK_NAME}.devtools.comfy_env")
    if module is None:
        spec = importlib.util.spec_from_file_location("_lwo_bench_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    module.register_pack()
    return module


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


# ----------------------------------------------------------------------------------------------- small helpers
def _size(nbytes) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _gib(nbytes) -> str:
    return "" if nbytes is None or nbytes == "" else f"{nbytes / 2**30:.3f}"


def tensor_nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.nelement() * t.element_size()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included), not numeric equality."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


def parse_budget(text: str, non_block: int, block_total: int) -> Tuple[str, int]:
    """'0.5' -> non-block weights + half the blocks' bytes; '12GiB' / '800MiB' / '10GB' -> that many bytes."""
    t = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(GiB|MiB|GB|MB)", t, re.IGNORECASE)
    if m:
        scale = {"gib": 2**30, "mib": 2**20, "gb": 10**9, "mb": 10**6}[m.group(2).lower()]
        return t, int(float(m.group(1)) * scale)
    try:
        fraction = float(t)
    except ValueError:
        raise ValueError(f"budget {text!r}: give a fraction of the blocks' bytes (0.5) or a size (12GiB, 800MiB)")
    if not 0 <= fraction <= 1:
        raise ValueError(f"budget fraction {text!r} must be within 0..1 (a fraction of the blocks' total bytes)")
    return f"{fraction:g}", int(non_block + fraction * block_total)


def our_footprint(block_nbytes: Sequence[int], non_block: int, resident: int, prefetch: int, policy: str) -> int:
    """What the node reports as ``model_size()``: non-block weights + resident blocks + (prefetch+1) slots."""
    from layerwise_offload.offload import choose_resident_blocks
    keep = choose_resident_blocks(len(block_nbytes), resident, policy)
    resident_bytes = sum(b for b, k in zip(block_nbytes, keep) if k)
    streamed = [b for b, k in zip(block_nbytes, keep) if not k]
    slots = min(prefetch + 1, len(streamed))
    return non_block + resident_bytes + (slots * max(streamed) if streamed else 0)


def streamed_bytes(block_nbytes: Sequence[int], resident: int, policy: str) -> int:
    from layerwise_offload.offload import choose_resident_blocks
    keep = choose_resident_blocks(len(block_nbytes), resident, policy)
    return sum(b for b, k in zip(block_nbytes, keep) if not k)


def equivalent_blocks(block_nbytes: Sequence[int], nbytes: float) -> float:
    """How many leading blocks ``nbytes`` would hold (fractional): where ComfyUI's point goes on a resident axis."""
    x = 0.0
    for size in block_nbytes:
        if nbytes <= 0:
            break
        x += min(1.0, nbytes / size)
        nbytes -= size
    return x


def largest_fitting_resident(block_nbytes, non_block, budget, prefetch, policy) -> Optional[int]:
    fitting = [r for r in range(len(block_nbytes) + 1)
               if our_footprint(block_nbytes, non_block, r, prefetch, policy) <= budget]
    return max(fitting) if fitting else None


# ----------------------------------------------------------------------------------------------- ComfyUI hooks
@contextlib.contextmanager
def comfy_weight_budget(patcher, budget: int):
    """Make ComfyUI load ``patcher`` with a weight budget of ``budget`` bytes, through its own lowvram path.

    ``load_models_gpu`` turns free VRAM into a weight budget (``lowvram_model_memory``) and hands it to
    ``LoadedModel.model_load``, which calls ``patcher.partially_load(device, budget)`` -> ``load()``. We replace
    only that number, for this patcher only, and keep every other step of ComfyUI's loading and sampling.

    Why not fake ``comfy.model_management.get_free_memory``: (1) the weight budget ComfyUI derives from free memory
    subtracts its activation estimate (``memory_required`` of the latent shape + 0.8 GiB + reserved VRAM), which
    differs per model and resolution, so "the same budget B" for both modes would be fuzzy; (2) ``calc_cond_batch``
    also reads ``get_free_memory`` to decide whether cond and uncond run as one batch, so a faked small value would
    change the number of forwards per step and the work done, not just the placement; (3) on the CPU
    ``load_models_gpu`` never computes a budget at all (the device is "DISABLED"), while ``model_load`` still runs.
    The number passed is budget minus what is already loaded, as ``load_models_gpu`` does (``... - loaded_memory``);
    ComfyUI's own "nothing more" value 0.1 when that is not positive (0 would mean "load everything").
    """
    import comfy.model_management as mm

    original = mm.LoadedModel.model_load

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        if self.model is patcher:
            lowvram_model_memory = max(budget - self.model.loaded_size(), 0.1)
        return original(self, lowvram_model_memory, force_patch_weights=force_patch_weights)

    mm.LoadedModel.model_load = model_load
    try:
        yield
    finally:
        mm.LoadedModel.model_load = original


class CastCounter:
    """Counts the bytes ComfyUI casts per forward for lowvram modules (``comfy.ops.cast_bias_weight``).

    A module is lowvram when ``ModelPatcher.load`` gave it ``prev_comfy_cast_weights`` (it did not fit the
    budget), or when its weight is not on the device the input is on. Every ``comfy.ops`` layer looks the
    function up in ``comfy.ops`` at call time, so patching the module attribute sees every cast.
    """

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    @contextlib.contextmanager
    def installed(self):
        import comfy.ops

        original = comfy.ops.cast_bias_weight

        def counting(s, input=None, dtype=None, device=None, *args, **kwargs):
            target = device if device is not None else (input.device if input is not None else None)
            weight = getattr(s, "weight", None)
            lowvram = hasattr(s, "prev_comfy_cast_weights") or (
                weight is not None and target is not None and weight.device != torch.device(target))
            if lowvram:
                self.bytes += tensor_nbytes(weight) + tensor_nbytes(getattr(s, "bias", None))
                self.calls += 1
            return original(s, input, dtype, device, *args, **kwargs)

        comfy.ops.cast_bias_weight = counting
        try:
            yield self
        finally:
            comfy.ops.cast_bias_weight = original


def lowvram_module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the modules ComfyUI's last ``load()`` left lowvram (cast to the device every forward)."""
    total = 0
    for module in model.modules():
        if hasattr(module, "prev_comfy_cast_weights"):
            total += sum(tensor_nbytes(p) for p in module.parameters(recurse=False))
    return total


# ----------------------------------------------------------------------------------------------- timing
class StepClock:
    """The sampler's per-step callback: marks the end of every step (a CUDA event or the clock).

    At the first callback it synchronises the GPU and calls ``on_first`` (counter snapshots), then starts
    timing: step 1 (loading, arming, first-touch) is never in the measurement.
    """

    def __init__(self, cuda: bool, on_first: Callable[[], None]):
        self.cuda = cuda
        self.on_first = on_first
        self.marks: list = []

    def __call__(self, step, x0, x, total_steps):
        if not self.marks:
            if self.cuda:
                torch.cuda.synchronize()
            self.on_first()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_seconds(self) -> List[float]:
        if len(self.marks) < 2:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def measure_h2d_gbps(nbytes: int, device: torch.device, repeats: int = 8) -> float:
    """Host-to-device GB/s of one ``nbytes`` copy: pinned host -> device on a GPU, a plain copy_ on the CPU."""
    nbytes = max(int(nbytes), 1 << 20)
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        del src, dst
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - begin)
    return nbytes / statistics.median(times) / 1e9


# ----------------------------------------------------------------------------------------------- the harness
class Harness:
    def __init__(self, config: BenchConfig):
        self.config = config
        self.log = (lambda *a: None) if config.quiet else (lambda *a: print("[comfy-bench]", *a, flush=True))

    # ..................................................................... setup
    def setup(self):
        cfg = self.config
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        if cfg.steps < 3:
            raise ValueError("--steps must be >= 3 (step 1 is warm-up; the median needs intervals after it)")
        env_module = _comfy_env()
        self.env = env_module.import_comfyui(cpu=(device == "cpu"), import_nodes=False)
        import comfy.model_management as mm

        self.mm = mm
        self.device = mm.get_torch_device()
        if (self.device.type == "cpu") != (device == "cpu"):
            raise RuntimeError(f"ComfyUI runs on {self.device}, but --device {device} was asked for (ComfyUI was "
                               f"imported earlier in this process for the other device)")
        self.cuda = self.device.type == "cuda"

        from layerwise_offload.bench import dit_presets
        from layerwise_offload.nodes.discovery import discover_blocks

        self.presets = dit_presets
        if cfg.preset not in dit_presets.PRESETS:
            raise ValueError(f"unknown preset {cfg.preset!r}; known: {', '.join(dit_presets.PRESETS)}")
        self.preset = dit_presets.PRESETS[cfg.preset]
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype else self.preset.dtype
        if self.device.type == "cpu" and self.dtype != torch.float32 and cfg.dtype is None:
            self.dtype = torch.float32

        started = time.perf_counter()
        self.patcher = dit_presets.build(self.preset, seed=cfg.seed, dtype=self.dtype, blocks=cfg.blocks)
        self.diffusion_model = self.patcher.get_model_object("diffusion_model")
        self.discovered = discover_blocks(self.diffusion_model)
        self.log(f"built {cfg.preset} ({type(self.diffusion_model).__name__}, {len(self.discovered)} blocks in "
                 f"{'+'.join(self.discovered.attributes)}, {self.dtype}) in {time.perf_counter() - started:.1f} s")

        # Sizes as the manager sees them (its host-store layout: aligned, one buffer per block).
        probe = self._offload(0, 1, "leading")
        controller = probe.attachments["layerwise_offload"]
        self.block_nbytes = list(controller.manager.block_nbytes())
        self.non_block = controller.non_block_bytes()
        del probe, controller
        gc.collect()
        self.block_total = sum(self.block_nbytes)
        self.model_bytes = self.mm.module_size(self.patcher.model)
        self.budgets = [parse_budget(b, self.non_block, self.block_total) for b in cfg.budgets]
        self.h2d_gbps = measure_h2d_gbps(max(self.block_nbytes), self.device)
        self.log(f"model {_gib(self.model_bytes)} GiB: blocks {_gib(self.block_total)} GiB "
                 f"({len(self.block_nbytes)} x {_gib(min(self.block_nbytes))}..{_gib(max(self.block_nbytes))}), "
                 f"non-block {_gib(self.non_block)} GiB; h2d {self.h2d_gbps:.2f} GB/s; budgets "
                 + ", ".join(f"{label}={_gib(b)} GiB" for label, b in self.budgets))
        # Counts diffusion-model forwards (one per apply_model) in every mode.
        self.forwards = 0

        def count_forward(module, args):
            self.forwards += 1
        self._forward_hook = self.diffusion_model.register_forward_pre_hook(count_forward)

    def _offload(self, resident, prefetch, policy):
        from layerwise_offload.nodes.offload_node import offload_model
        return offload_model(self.patcher, resident, prefetch, policy, True)

    def teardown(self):
        hook = getattr(self, "_forward_hook", None)
        if hook is not None:
            hook.remove()
        if hasattr(self, "mm"):
            self.mm.unload_all_models()
            self.mm.soft_empty_cache()

    # ..................................................................... one run
    def _fresh(self):
        self.mm.unload_all_models()
        gc.collect()
        self.mm.soft_empty_cache()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def _unload(self, patcher) -> None:
        """Unload while ``patcher`` is alive. If a loaded clone is garbage-collected first, ComfyUI's LoadedModel
        switches to the clone's parent (``_switch_parent``) and unloads THAT (a plain ModelPatcher), so the
        offload's device buffers would never be released, and the next run would start with them held."""
        self.mm.unload_all_models()
        del patcher

    def _sample(self, patcher, on_first: Callable[[], None] = lambda: None):
        clock = StepClock(self.cuda, on_first)
        # ComfyUI's executor runs every prompt under torch.inference_mode() (execution.py); so do we, unless told.
        mode = torch.inference_mode() if self.config.inference_mode else contextlib.nullcontext()
        with mode:
            out = self.presets.sample(patcher, self.preset, seed=self.config.seed, steps=self.config.steps,
                                      callback=clock)
        seconds = clock.step_seconds()
        peak = torch.cuda.max_memory_allocated() if self.cuda else ""
        return out, seconds, peak

    def _base_row(self, mode: str) -> Dict[str, object]:
        row = {c: "" for c in COLUMNS}
        row.update(preset=self.config.preset, device=self.device.type, dtype=str(self.dtype).replace("torch.", ""),
                   mode=mode, num_blocks=len(self.block_nbytes), steps=self.config.steps, h2d_gbps=self.h2d_gbps)
        return row

    @staticmethod
    def _timing(row, seconds):
        median = statistics.median(seconds)
        row["step_ms"] = median * 1e3
        row["step_ms_spread"] = (max(seconds) - min(seconds)) * 1e3

    def guarded(self, run: Callable[[], Dict[str, object]], mode: str, **fields) -> Dict[str, object]:
        """One run; an exception becomes a row with ``error`` set (the sweep goes on) and is logged."""
        try:
            row = run()
        except Exception as error:  # noqa: BLE001 - a failing configuration is a result, not the end
            import traceback
            traceback.print_exc()
            row = self._base_row(mode)
            row.update(fields)
            row.update(bitwise_equal=False, error=f"{type(error).__name__}: {error}"[:300])
            self.mm.unload_all_models()
        self.log(_row_line(row))
        return row

    def run_full(self):
        self._fresh()
        snap = {}
        out, seconds, peak = self._sample(self.patcher, lambda: snap.update(forwards=self.forwards))
        row = self._base_row("full")
        self._timing(row, seconds)
        row.update(budget="all", budget_bytes=self.model_bytes, resident=len(self.block_nbytes),
                   forwards_per_step=(self.forwards - snap["forwards"]) / (self.config.steps - 1),
                   weights_device_bytes=self.patcher.loaded_size(), peak_alloc_bytes=peak,
                   streamed_bytes_per_forward=0, h2d_bytes_per_step=0, bitwise_equal=True)
        self.reference = out
        self.full_step_s = row["step_ms"] / 1e3
        self._bound(row)
        return row

    def run_comfy(self, label: str, budget: int):
        self._fresh()
        patcher = self.patcher.clone()
        counter = CastCounter()
        snap = {}

        def first():
            snap.update(forwards=self.forwards, bytes=counter.bytes)

        with comfy_weight_budget(patcher, budget), counter.installed():
            out, seconds, peak = self._sample(patcher, first)
        intervals = self.config.steps - 1
        row = self._base_row("comfy_lowvram")
        self._timing(row, seconds)
        row.update(budget=label, budget_bytes=budget,
                   forwards_per_step=(self.forwards - snap["forwards"]) / intervals,
                   weights_device_bytes=patcher.loaded_size() + int(patcher.model.model_offload_buffer_memory or 0),
                   peak_alloc_bytes=peak, streamed_bytes_per_forward=lowvram_module_bytes(patcher.model),
                   h2d_bytes_per_step=(counter.bytes - snap["bytes"]) / intervals,
                   bitwise_equal=bitwise_equal(out, self.reference))
        self._bound(row)
        self._unload(patcher)
        return row

    def auto_residency_supported(self) -> bool:
        """Whether the node takes resident_layers=-1 (automatic residency from free VRAM)."""
        try:
            probe = self._offload(-1, 1, "leading")
        except ValueError:
            return False
        del probe
        gc.collect()
        return True

    def run_layerwise(self, resident: int, prefetch: int, policy: str, budget: Optional[Tuple[str, int]] = None):
        """This pack's node. ``budget``: also hand ComfyUI's weight budget to it, as ComfyUI's loader would
        (``comfy_weight_budget``); the node caps its residents to fit (used for auto residency)."""
        self._fresh()
        patcher = self._offload(resident, prefetch, policy)
        controller = patcher.attachments["layerwise_offload"]
        manager = controller.manager
        snap = {}

        def first():
            snap.update(forwards=self.forwards, stats=manager.stats(synchronize=True))

        with comfy_weight_budget(patcher, budget[1]) if budget else contextlib.nullcontext():
            out, seconds, peak = self._sample(patcher, first)
        after = manager.stats(synchronize=True)
        before = snap["stats"]
        footprint = patcher.model_size()  # after the run: the plan that ran (auto and budget caps resolved)
        intervals = self.config.steps - 1
        moved = after.bytes_copied - before.bytes_copied
        copy_s = after.copy_seconds - before.copy_seconds
        if manager.schedule is not None:  # armed: the plan that ran
            streamed = sum(self.block_nbytes[i] for i in manager.schedule.streamed_blocks)
            resident = len(manager.schedule.resident_blocks)
        else:
            streamed = streamed_bytes(self.block_nbytes, resident, policy)
        row = self._base_row("layerwise_auto" if budget else "layerwise")
        self._timing(row, seconds)
        row.update(resident=resident, prefetch=prefetch, policy=policy, footprint_bytes=footprint,
                   fits_budgets=";".join(label for label, b in self.budgets if footprint <= b),
                   forwards_per_step=(self.forwards - snap["forwards"]) / intervals,
                   # The manager's own peak counter spans its whole life (it is shared by every run of this
                   # model), so the per-run figure is what it holds while armed, at the end of the run.
                   weights_device_bytes=controller.non_block_bytes() + after.device_bytes,
                   peak_alloc_bytes=peak,
                   streamed_bytes_per_forward=streamed,
                   h2d_bytes_per_step=moved / intervals,
                   stall_ms_per_step=(after.stall_seconds - before.stall_seconds) / intervals * 1e3,
                   copy_gbps=(moved / copy_s / 1e9) if copy_s > 0 else "",
                   bitwise_equal=bitwise_equal(out, self.reference))
        if budget:
            row.update(budget=budget[0], budget_bytes=budget[1])
        self._bound(row)
        del controller, manager
        self._unload(patcher)
        return row

    def _bound(self, row):
        wire_s = row["h2d_bytes_per_step"] / (self.h2d_gbps * 1e9) if self.h2d_gbps > 0 else 0.0
        bound = max(self.full_step_s, wire_s)
        row["bound_ms"] = bound * 1e3
        row["step_over_bound"] = row["step_ms"] / row["bound_ms"] if bound > 0 else ""

    # ..................................................................... the sweep
    def layerwise_configs(self) -> List[Tuple[int, int, str]]:
        """The sweep, deduplicated (runs with the same residents and slots are one run). With ``residents``
        auto, the configurations that fit each budget best come first, so a ``--deadline-s`` cut drops the
        sweep's filler, not the per-budget comparison."""
        from layerwise_offload.offload import choose_resident_blocks
        cfg = self.config
        n = len(self.block_nbytes)
        first: List[Tuple[int, int, str]] = []
        if cfg.residents is None:
            residents = {0, round(n / 4), round(n / 2), round(3 * n / 4), n}
            for p in cfg.prefetch:
                for policy in cfg.policies:
                    for _, budget in self.budgets:
                        fit = largest_fitting_resident(self.block_nbytes, self.non_block, budget, p, policy)
                        if fit is not None:
                            residents.add(fit)
                            first.append((fit, p, policy))
        else:
            residents = set(cfg.residents)
        bad = [r for r in residents if not 0 <= r <= n]
        if bad:
            raise ValueError(f"resident counts {sorted(bad)} are outside 0..{n} (the model has {n} blocks)")
        sweep = [(r, p, policy) for r in sorted(residents) for p in cfg.prefetch for policy in cfg.policies]
        configs, seen = [], set()
        for r, p, policy in first + sweep:
            key = (choose_resident_blocks(n, r, policy), p if r < n else None)  # same residents and slots
            if key not in seen:
                seen.add(key)
                configs.append((r, p, policy))
        return configs

    def run(self) -> BenchResult:
        cfg = self.config
        started = time.perf_counter()
        rows: List[Dict[str, object]] = []
        skipped: List[str] = []
        rows.append(self.run_full())  # the reference: if it fails there is nothing to compare with
        self.log(_row_line(rows[-1]))
        for label, budget in self.budgets:
            rows.append(self.guarded(lambda: self.run_comfy(label, budget), "comfy_lowvram",
                                     budget=label, budget_bytes=budget))
        # Layerwise last: its host store keeps the block weights as views of (pinned) host memory afterwards.
        if self.auto_residency_supported():
            for label, budget in self.budgets:
                rows.append(self.guarded(lambda: self.run_layerwise(-1, 1, "leading", budget=(label, budget)),
                                         "layerwise_auto", budget=label, budget_bytes=budget, prefetch=1,
                                         policy="leading"))
        else:
            skipped.append("auto residency (resident_layers=-1): nodes/offload_node.py does not accept it")
        for resident, prefetch, policy in self.layerwise_configs():
            if cfg.deadline_s is not None and time.perf_counter() - started > cfg.deadline_s:
                skipped.append(f"layerwise r={resident} p={prefetch} {policy}: past --deadline-s")
                continue
            rows.append(self.guarded(lambda: self.run_layerwise(resident, prefetch, policy), "layerwise",
                                     resident=resident, prefetch=prefetch, policy=policy))
        self.mm.unload_all_models()
        summary = self.summarize(rows)
        meta = self.meta(time.perf_counter() - started)
        return BenchResult(cfg, rows, summary, meta, self.block_nbytes, self.non_block, self.budgets,
                           skipped=skipped)

    def summarize(self, rows) -> List[Dict[str, object]]:
        full = next(r for r in rows if r["mode"] == "full")
        ok = [r for r in rows if not r["error"]]
        out = []
        for label, budget in self.budgets:
            entry = {c: "" for c in SUMMARY_COLUMNS}
            entry.update(budget=label, budget_bytes=budget, full_step_ms=full["step_ms"])
            comfy = next((r for r in ok if r["mode"] == "comfy_lowvram" and r["budget"] == label), None)
            if comfy is not None:
                entry.update(comfy_step_ms=comfy["step_ms"], comfy_h2d_bytes_per_step=comfy["h2d_bytes_per_step"],
                             comfy_weights_device_bytes=comfy["weights_device_bytes"], comfy_bound_ms=comfy["bound_ms"])
            auto = next((r for r in ok if r["mode"] == "layerwise_auto" and r["budget"] == label), None)
            if auto is not None:
                entry.update(auto_resident=auto["resident"], auto_step_ms=auto["step_ms"])
            fitting = [r for r in ok if r["mode"] == "layerwise" and r["footprint_bytes"] <= budget]
            best = min(fitting, key=lambda r: r["step_ms"]) if fitting else None
            if best is not None:
                entry.update(layerwise_config=f"r={best['resident']} p={best['prefetch']} {best['policy']}",
                             layerwise_step_ms=best["step_ms"], layerwise_h2d_bytes_per_step=best["h2d_bytes_per_step"],
                             layerwise_footprint_bytes=best["footprint_bytes"],
                             layerwise_stall_ms_per_step=best["stall_ms_per_step"],
                             layerwise_bound_ms=best["bound_ms"])
                if comfy is not None:
                    entry["speedup_vs_comfy"] = comfy["step_ms"] / best["step_ms"]
            else:
                entry.update(layerwise_config="none fits")
            out.append(entry)
        return out

    def meta(self, seconds: float) -> Dict[str, object]:
        try:
            import comfyui_version
            comfy_version = comfyui_version.__version__
        except Exception:  # noqa: BLE001 - older checkouts have no such file
            comfy_version = "unknown"
        meta = {
            "preset": self.config.preset, "preset_notes": self.preset.notes, "device": str(self.device),
            "dtype": str(self.dtype), "blocks": list(self.discovered.attributes),
            "num_blocks": len(self.block_nbytes), "block_nbytes": self.block_nbytes,
            "non_block_bytes": self.non_block, "model_bytes": self.model_bytes,
            "budgets": {label: b for label, b in self.budgets}, "steps": self.config.steps,
            "h2d_gbps": self.h2d_gbps, "torch": torch.__version__, "python": platform.python_version(),
            "comfyui": comfy_version, "comfyui_path": str(self.env.path), "machine": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "cpu_model": _cpu_model(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads(), "seconds": round(seconds, 1),
        }
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            meta.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
        return meta


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def _env(name: str, value: Optional[str]):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def _cpu_threads(device: str, threads: Optional[int]):
    """One torch thread on the CPU by default: two cores shared with other work make multi-threaded
    timings swing by 10x; GPU runs keep torch's setting."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_bench(config: BenchConfig) -> BenchResult:
    """Run every mode, write the CSVs / meta / plot under ``config.out`` (if given), return the result."""
    harness = Harness(config)
    # On the CPU the node passes the model through unless the CPU loopback is asked for; set it for this run only.
    cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    with _cpu_threads(config.device, config.threads), _env(CPU_LOOPBACK_ENV, "1" if cpu else None):
        try:
            harness.setup()
            result = harness.run()
        finally:
            harness.teardown()
    if config.out is not None:
        result.files = write_outputs(result, Path(config.out))
    return result


# ----------------------------------------------------------------------------------------------- output
def _row_line(row) -> str:
    what = row["mode"]
    if row["mode"] == "comfy_lowvram":
        what += f" B={row['budget']}"
    elif row["mode"].startswith("layerwise"):
        what += f" r={row['resident']} p={row['prefetch']} {row['policy']}"
    if row.get("error"):
        return f"{what}: FAILED {row['error']}"
    if row["mode"] == "layerwise_auto":
        what += f" B={row['budget']}"
    return (f"{what}: {row['step_ms']:.2f} ms/step, {row['h2d_bytes_per_step'] / 2**20:.1f} MiB h2d/step, "
            f"bitwise {'equal' if row['bitwise_equal'] else 'DIFFERENT'}")


def _fmt(value, column: str) -> str:
    if value == "" or value is None:
        return "-"
    if column.endswith("_bytes") or column.endswith("_bytes_per_step") or column.endswith("_per_forward"):
        return f"{value / 2**30:.3f}G" if value >= 2**30 else f"{value / 2**20:.1f}M"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


TABLE_COLUMNS = ["mode", "budget", "resident", "prefetch", "policy", "fits_budgets", "forwards_per_step", "step_ms",
                 "weights_device_bytes", "peak_alloc_bytes", "h2d_bytes_per_step", "stall_ms_per_step", "bound_ms",
                 "step_over_bound", "bitwise_equal", "error"]
SUMMARY_TABLE_COLUMNS = ["budget", "budget_bytes", "comfy_step_ms", "comfy_h2d_bytes_per_step", "layerwise_config",
                         "layerwise_step_ms", "layerwise_h2d_bytes_per_step", "layerwise_footprint_bytes",
                         "layerwise_bound_ms", "speedup_vs_comfy", "auto_resident", "auto_step_ms", "full_step_ms"]


def format_table(rows, columns) -> str:
    cells = [[c for c in columns]] + [[_fmt(r.get(c, ""), c) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write_csv(path: Path, rows, columns):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]) for c in columns})


def write_outputs(result: BenchResult, out: Path) -> Dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"comfy_bench_{result.config.preset}_{result.meta['device'].split(':')[0]}"
    files = {"csv": str(out / f"{stem}.csv"), "summary": str(out / f"{stem}_summary.csv"),
             "meta": str(out / f"{stem}_meta.json")}
    _write_csv(Path(files["csv"]), result.rows, COLUMNS)
    _write_csv(Path(files["summary"]), result.summary, SUMMARY_COLUMNS)
    with open(files["meta"], "w") as f:
        json.dump({**result.meta, "skipped": result.skipped}, f, indent=2)
    if result.config.plot:
        png = out / f"{stem}_plot.png"
        message = plot(result, png)
        if message is None:
            files["png"] = str(png)
        else:
            print(f"[comfy-bench] {message}")
    return files


def plot(result: BenchResult, path: Path) -> Optional[str]:
    """Step time against resident count per (prefetch, policy), the bound, full load, ComfyUI at each budget."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    rows = result.rows
    full = next(r for r in rows if r["mode"] == "full")
    ours = [r for r in rows if r["mode"] == "layerwise" and not r["error"]]
    n = len(result.block_nbytes)
    fig, ax = plt.subplots(figsize=(12, 5.5))
    groups: Dict[Tuple[int, str], List[dict]] = {}
    for r in ours:
        groups.setdefault((r["prefetch"], r["policy"]), []).append(r)
    all_resident = [r for r in ours if r["resident"] == n]
    for (p, policy), members in sorted(groups.items()):
        members = sorted(members + [m for m in all_resident if m not in members], key=lambda r: r["resident"])
        ax.plot([m["resident"] for m in members], [m["step_ms"] for m in members],
                marker="o", ms=4, lw=1.2, ls="-" if policy == "leading" else "--",
                label=f"layerwise prefetch {p}, {policy}")
    xs = list(range(n + 1))
    h2d = result.meta["h2d_gbps"] * 1e9
    fwd = [r["forwards_per_step"] for r in ours] or [1]
    fwd = statistics.median(fwd)
    bound = [max(full["step_ms"], streamed_bytes(result.block_nbytes, r, "leading") * fwd / h2d * 1e3) for r in xs]
    ax.plot(xs, bound, color="black", lw=1, ls=":", label=f"bound max(full, bytes / {h2d / 1e9:.1f} GB/s)")
    ax.axhline(full["step_ms"], color="grey", lw=0.8, label="full load (all resident)")
    for index, (label, budget) in enumerate(result.budgets):
        comfy = next((r for r in rows if r["mode"] == "comfy_lowvram" and r["budget"] == label
                      and not r["error"]), None)
        if comfy is None:
            continue
        x = equivalent_blocks(result.block_nbytes, budget - result.non_block_bytes)
        ax.scatter([x], [comfy["step_ms"]], marker="X", s=90, color="crimson", zorder=5)
        ax.annotate(f"ComfyUI lowvram B={label}\n({_size(budget)})", (x, comfy["step_ms"]),
                    textcoords="offset points", xytext=(6, 6 + 14 * (index % 3)), fontsize=7, color="crimson")
        fit = largest_fitting_resident(result.block_nbytes, result.non_block_bytes, budget, 1, "leading")
        if fit is not None:
            ax.axvline(fit, color="crimson", lw=0.5, ls=":")
    autos = [r for r in rows if r["mode"] == "layerwise_auto" and not r["error"]]
    if autos:
        ax.scatter([r["resident"] for r in autos], [r["step_ms"] for r in autos], marker="*", s=110,
                   color="darkgreen", zorder=6, label="layerwise auto (-1) under ComfyUI's budget B")
    meta = result.meta
    ax.set_xlabel("resident blocks. ComfyUI's X at B: the leading blocks B minus non-block weights would hold; "
                  "dotted: most residents layerwise prefetch 1 fits in B", fontsize=8)
    ax.set_ylabel("median step time (ms)")
    cpu_note = " (CPU proxy: absolute times are meaningless)" if "gpu" not in meta else ""
    ax.set_title(f"{meta['preset']}: {meta['num_blocks']} blocks, {meta['dtype'].replace('torch.', '')} on "
                 f"{meta.get('gpu', meta['device'])}; ComfyUI {meta['comfyui']}, torch {meta['torch']}{cpu_note}",
                 fontsize=9)
    ax.set_xlim(-0.5, n + 0.5)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def print_result(result: BenchResult) -> None:
    meta = result.meta
    print(f"\n{meta['preset']} on {meta.get('gpu', meta['device'])}: {meta['num_blocks']} blocks "
          f"({_gib(sum(result.block_nbytes))} GiB), non-block {_gib(result.non_block_bytes)} GiB, {meta['dtype']}, "
          f"{meta['steps']} steps; h2d {meta['h2d_gbps']:.2f} GB/s; ComfyUI {meta['comfyui']}, torch {meta['torch']}")
    print(format_table(result.rows, TABLE_COLUMNS))
    print("\nper budget (layerwise: the fastest configuration whose footprint fits B):")
    print(format_table(result.summary, SUMMARY_TABLE_COLUMNS))
    for note in result.skipped:
        print(f"skipped: {note}")
    for kind, path in result.files.items():
        print(f"wrote {kind}: {path}")


# ----------------------------------------------------------------------------------------------- CLI
def _ints(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv=None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny",
                        help="flux | wan21_14b | qwen_image | tiny (default tiny); several: flux,wan21_14b")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the preset's "
                        "(bf16; fp32 for tiny and on the CPU)")
    parser.add_argument("--blocks", default=None, help="block counts per block list, e.g. 4,8 for flux "
                        "(double,single); default: the preset's")
    parser.add_argument("--steps", type=int, default=6, help="sampling steps per run (>= 3; step 1 is warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="0.3,0.5,0.7,0.9",
                        help="VRAM budgets for weights: fractions of the blocks' bytes (added to the non-block "
                             "weights) or sizes like 12GiB; comma-separated")
    parser.add_argument("--residents", default="auto",
                        help="resident counts for the layerwise sweep, comma-separated, or 'auto' (0, quartiles, "
                             "all, and the largest count that fits each budget)")
    parser.add_argument("--prefetch", default="1,2,4")
    parser.add_argument("--policies", default="leading,strided")
    parser.add_argument("--out", default=None, help="folder for the CSVs, meta JSON and PNG")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (default 1)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no layerwise run after this many seconds (keeps a GPU call inside its limit)")
    parser.add_argument("--no-inference-mode", action="store_true",
                        help="sample outside torch.inference_mode() (ComfyUI's executor uses it; default: use it)")
    parser.add_argument("--quiet", action="store_true")
    a = parser.parse_args(argv)
    blocks = tuple(_ints(a.blocks)) if a.blocks else None
    return BenchConfig(
        preset=a.preset, device=a.device, dtype=a.dtype, blocks=blocks, steps=a.steps, seed=a.seed,
        budgets=[b.strip() for b in a.budgets.split(",") if b.strip()],
        residents=None if a.residents == "auto" else _ints(a.residents), prefetch=_ints(a.prefetch),
        policies=[p.strip() for p in a.policies.split(",") if p.strip()],
        out=Path(a.out) if a.out else None, plot=not a.no_plot, threads=a.threads, deadline_s=a.deadline_s,
        quiet=a.quiet, inference_mode=not a.no_inference_mode,
    )


def main(argv=None) -> int:
    """Runs each preset of ``--preset a,b,c`` in turn (one ComfyUI import); a failing preset does not stop the rest."""
    _comfy_env()  # registers the pack so `layerwise_offload.bench...` imports work when run as a script
    config = parse_args(argv)
    status = 0
    for preset in [p.strip() for p in config.preset.split(",") if p.strip()]:
        try:
            result = run_bench(dataclasses.replace(config, preset=preset))
        except Exception:  # noqa: BLE001 - report and go on with the next preset
            import traceback
            traceback.print_exc()
            print(f"[comfy-bench] preset {preset} failed", file=sys.stderr, flush=True)
            status = 2
            continue
        print_result(result)
        bad = [r for r in result.rows if not r["bitwise_equal"]]
        if bad:
            print(f"[comfy-bench] {preset}: {len(bad)} run(s) differ bitwise from the full load", file=sys.stderr)
            status = status or 1
        gc.collect()
    return status


if __name__ == "__main__":
    sys.exit(main())
