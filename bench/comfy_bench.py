"""Side by side inside the real ComfyUI (in-process): ComfyUI's full load, its own partial loading and this pack's
node at the same VRAM budgets B for weights; ``--formats``: weight formats side by side (bench_formats.py).

    python -P bench/comfy_bench.py --preset tiny --device cpu --steps 10 --budgets 0.6,0.75,0.9 --out bench/results
    python -P bench/comfy_bench.py --preset flux,wan21_14b,qwen_image --device cuda --deadline-s 90 --out DIR
    python -P bench/comfy_bench.py --preset tiny_wan --formats bf16,fp8_mixed,gguf_q4_0 --residents 0,2

B (``--budgets``) is the non-block weights + f x the blocks' bytes, or a size (12GiB); activations come on top.
Every mode samples the same latent and noise (Euler, ``comfy.sample.sample``, so ``load_models_gpu`` places the
weights each time, under ``torch.inference_mode()`` as ComfyUI's executor does) on a preset (dit_presets.py):
``full`` (everything resident: the reference of every ``bitwise_equal``), ``comfy_lowvram`` (ComfyUI's partial
loading, handed B through ``LoadedModel.model_load``: measure.comfy_weight_budget says why; it keeps the largest
modules and casts the rest every forward), ``layerwise`` (the node at each resident count x prefetch x policy;
``fits_budgets``: the B its ``model_size()`` fits) and ``layerwise_auto`` (resident_layers=-1, handed B likewise).

Per run: ``step_ms`` is the median of the steps after the first (loading, warm-up); ``weights_device_bytes`` what
is held for weights at the end (lowvram: + ComfyUI's cast buffer; layerwise: non-block weights + the manager's
buffers and slots); ``streamed_bytes_per_forward`` the streamed blocks (lowvram: the modules left lowvram);
``h2d_bytes_per_step`` what was counted moving (the manager's counters; ComfyUI's casts); ``h2d_gbps`` a pinned copy
of one block's size; ``bound_ms`` = max(full-load step, h2d bytes / h2d_gbps). A run that raises is a row with
``error``. Files: ``comfy_bench_<preset>_<device>.csv``, ``_summary.csv`` (per B: ComfyUI against the fastest
fitting layerwise configuration), ``_meta.json``, ``_plot.png``. On the CPU (the CPU loopback) the times mean
nothing: the run checks the accounting and bitwise equality; real numbers come from bench/gpu_run.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402

from .measure import CPU_LOOPBACK_ENV  # noqa: E402,F401  (the tests read it from here)
from .measure import (CastCounter, StepClock, bitwise_equal, comfy_weight_budget,  # noqa: E402
                      comfyui_version, copy_seconds, cpu_loopback, gib, largest_fitting_resident,
                      lowvram_module_bytes, parse_budget, size_text, streamed_bytes, write_csv)
from ..devtools import comfy_env  # noqa: E402
from ..offload import choose_resident_blocks  # noqa: E402

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
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


@dataclass
class BenchConfig:
    preset: str = "tiny"
    device: str = "auto"  # cpu | cuda | auto
    dtype: Optional[str] = None  # bf16 | fp16 | fp32; None: the preset's
    blocks: Optional[Tuple[int, ...]] = None  # block counts per block list; None: the preset's
    steps: int = 6
    seed: int = 0
    budgets: Sequence[str] = ("0.3", "0.5", "0.7", "0.9")
    residents: Optional[Sequence[int]] = None  # None: 0, quartiles, all, and what fits each budget
    prefetch: Sequence[int] = (1, 2, 4)
    policies: Sequence[str] = ("leading", "strided")
    out: Optional[Path] = None
    plot: bool = True
    threads: Optional[int] = None  # CPU only: torch threads during the runs (None: 1 on the CPU)
    deadline_s: Optional[float] = None  # stop starting layerwise runs after this many seconds
    quiet: bool = False
    inference_mode: bool = True  # sample under torch.inference_mode(), as ComfyUI's executor does
    formats: Sequence[str] = ()  # weight formats to compare (bench_formats.py); empty: the side-by-side run

    @property
    def cpu(self) -> bool:
        return self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())


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


# ----------------------------------------------------------------------------------------------- the harness
class Harness:
    """One preset's model inside ComfyUI, and the modes run on it (the GPU run's harness is a subclass)."""

    def __init__(self, config: BenchConfig, load: Optional[Callable[[], object]] = None):
        self.config = config
        self._load = load  # a loader's model instead of the preset built with random weights (bench_formats.py)
        self.log = (lambda *a: None) if config.quiet else (lambda *a: print("[comfy-bench]", *a, flush=True))

    def setup(self):
        cfg = self.config
        device = "cpu" if cfg.cpu else cfg.device.replace("auto", "cuda")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA device")
        if cfg.steps < 3:
            raise ValueError("--steps must be >= 3 (step 1 is warm-up; the median needs intervals after it)")
        self.env = comfy_env.import_comfyui(cpu=(device == "cpu"), import_nodes=False)
        import comfy.model_management as mm

        self.mm = mm
        self.device = mm.get_torch_device()
        if (self.device.type == "cpu") != (device == "cpu"):
            raise RuntimeError(f"ComfyUI runs on {self.device}, but --device {device} was asked for (ComfyUI was "
                               f"imported earlier in this process for the other device)")
        self.cuda = self.device.type == "cuda"

        from . import dit_presets
        from ..nodes.discovery import discover_blocks  # imports ComfyUI: only after import_comfyui

        self.presets = dit_presets
        if cfg.preset not in dit_presets.PRESETS:
            raise ValueError(f"unknown preset {cfg.preset!r}; known: {', '.join(dit_presets.PRESETS)}")
        self.preset = dit_presets.PRESETS[cfg.preset]
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype else self.preset.dtype
        if self.device.type == "cpu" and cfg.dtype is None:
            self.dtype = torch.float32

        started = time.perf_counter()
        self.patcher = self._load() if self._load is not None else dit_presets.build(
            self.preset, seed=cfg.seed, dtype=self.dtype, blocks=cfg.blocks)
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
        probe_bytes = max(max(self.block_nbytes), 1 << 20)  # a pinned copy of one block's size
        self.h2d_gbps = probe_bytes / copy_seconds(probe_bytes, self.device, repeats=8) / 1e9
        self.log(f"model {gib(self.model_bytes)} GiB: blocks {gib(self.block_total)} GiB "
                 f"({len(self.block_nbytes)} x {gib(min(self.block_nbytes))}..{gib(max(self.block_nbytes))}), "
                 f"non-block {gib(self.non_block)} GiB; h2d {self.h2d_gbps:.2f} GB/s; budgets "
                 + ", ".join(f"{label}={gib(b)} GiB" for label, b in self.budgets))
        self.forwards = 0  # diffusion-model forwards (one per apply_model), in every mode

        def count_forward(module, args):
            self.forwards += 1
        self._forward_hook = self.diffusion_model.register_forward_pre_hook(count_forward)

    def _offload(self, resident, prefetch, policy):
        from ..nodes.controller import offload_model
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
        with torch.inference_mode() if self.config.inference_mode else contextlib.nullcontext():
            out = self.presets.sample(patcher, self.preset, seed=self.config.seed, steps=self.config.steps,
                                      callback=clock)
        return out, clock.step_seconds(), torch.cuda.max_memory_allocated() if self.cuda else ""

    def _row(self, mode: str, seconds=(), **fields) -> Dict[str, object]:
        row = {c: "" for c in COLUMNS}
        row.update(preset=self.config.preset, device=self.device.type, dtype=str(self.dtype).replace("torch.", ""),
                   mode=mode, num_blocks=len(self.block_nbytes), steps=self.config.steps, h2d_gbps=self.h2d_gbps)
        if seconds:
            row.update(step_ms=statistics.median(seconds) * 1e3, step_ms_spread=(max(seconds) - min(seconds)) * 1e3)
        row.update(fields)
        if seconds:  # the bound: a perfect overlap of copies and compute
            wire_s = row["h2d_bytes_per_step"] / (self.h2d_gbps * 1e9) if self.h2d_gbps > 0 else 0.0
            bound = max(self.full_step_s, wire_s)
            row.update(bound_ms=bound * 1e3, step_over_bound=row["step_ms"] / (bound * 1e3) if bound > 0 else "")
        return row

    def guarded(self, run: Callable[[], Dict[str, object]], mode: str, **fields) -> Dict[str, object]:
        """One run; an exception becomes a row with ``error`` set (the sweep goes on) and is logged."""
        try:
            row = run()
        except Exception as error:  # noqa: BLE001 - a failing configuration is a result, not the end
            import traceback
            traceback.print_exc()
            row = self._row(mode, **fields, bitwise_equal=False, error=f"{type(error).__name__}: {error}"[:300])
            self.mm.unload_all_models()
        self.log(row_line(row))
        return row

    def run_full(self):
        self._fresh()
        snap = {}
        out, seconds, peak = self._sample(self.patcher, lambda: snap.update(forwards=self.forwards))
        self.full_step_s = statistics.median(seconds)
        self.reference = out
        return self._row("full", seconds, budget="all", budget_bytes=self.model_bytes, resident=len(self.block_nbytes),
                         forwards_per_step=(self.forwards - snap["forwards"]) / (self.config.steps - 1),
                         weights_device_bytes=self.patcher.loaded_size(), peak_alloc_bytes=peak,
                         streamed_bytes_per_forward=0, h2d_bytes_per_step=0, bitwise_equal=True)

    def run_comfy(self, label: str = "", budget: Optional[int] = None):
        """ComfyUI's own partial loading at ``budget``; None: deciding from the memory that is really free (the GPU
        run's ballast holds the rest)."""
        self._fresh()
        patcher = self.patcher.clone()
        counter, snap = CastCounter(), {}
        with comfy_weight_budget(patcher, budget) if budget else contextlib.nullcontext(), counter.installed():
            out, seconds, peak = self._sample(patcher, lambda: snap.update(forwards=self.forwards, bytes=counter.bytes))
        intervals = self.config.steps - 1
        row = self._row("comfy_lowvram", seconds, forwards_per_step=(self.forwards - snap["forwards"]) / intervals,
                        weights_device_bytes=patcher.loaded_size()
                        + int(getattr(patcher.model, "model_offload_buffer_memory", 0) or 0),
                        peak_alloc_bytes=peak, streamed_bytes_per_forward=lowvram_module_bytes(patcher.model),
                        h2d_bytes_per_step=(counter.bytes - snap["bytes"]) / intervals,
                        bitwise_equal=bitwise_equal(out, self.reference),
                        **(dict(budget=label, budget_bytes=budget) if budget else {}))
        self._unload(patcher)
        return row

    def run_layerwise(self, resident: int, prefetch: int, policy: str, budget: Optional[Tuple[str, int]] = None):
        """This pack's node. ``budget``: also hand ComfyUI's weight budget to it, as ComfyUI's loader would; the
        node caps its residents to fit (auto residency)."""
        self._fresh()
        patcher = self._offload(resident, prefetch, policy)
        controller = patcher.attachments["layerwise_offload"]
        stats = controller.manager.stats
        snap = {}
        with comfy_weight_budget(patcher, budget[1]) if budget else contextlib.nullcontext():
            out, seconds, peak = self._sample(patcher, lambda: snap.update(forwards=self.forwards, stats=stats()))
        after, before = stats(), snap["stats"]
        footprint = patcher.model_size()  # after the run: the plan that ran (auto and budget caps resolved)
        intervals = self.config.steps - 1
        moved = after.bytes_copied - before.bytes_copied
        copy_s = after.copy_seconds - before.copy_seconds
        if after.device_bytes:  # armed: the plan that ran
            streamed = sum(n for n, tier in zip(self.block_nbytes, after.block_tiers) if tier != "resident")
            resident = after.resident_blocks
        else:
            streamed = streamed_bytes(self.block_nbytes, resident, policy)
        row = self._row("layerwise_auto" if budget else "layerwise", seconds, resident=resident, prefetch=prefetch,
                        policy=policy, footprint_bytes=footprint,
                        fits_budgets=";".join(label for label, b in self.budgets if footprint <= b),
                        forwards_per_step=(self.forwards - snap["forwards"]) / intervals,
                        # The manager's own peak spans its whole life (every run of this model): what it holds
                        # armed, at the end of the run, is the per-run figure.
                        weights_device_bytes=controller.non_block_bytes() + after.device_bytes,
                        peak_alloc_bytes=peak, streamed_bytes_per_forward=streamed,
                        h2d_bytes_per_step=moved / intervals,
                        stall_ms_per_step=(after.stall_seconds - before.stall_seconds) / intervals * 1e3,
                        copy_gbps=(moved / copy_s / 1e9) if copy_s > 0 else "",
                        bitwise_equal=bitwise_equal(out, self.reference),
                        **(dict(budget=budget[0], budget_bytes=budget[1]) if budget else {}))
        self._unload(patcher)
        return row

    # ..................................................................... the sweep
    def layerwise_configs(self) -> List[Tuple[int, int, str]]:
        """The sweep, deduplicated (runs with the same residents and slots are one run). With ``residents`` auto,
        what fits each budget best comes first, so a ``--deadline-s`` cut drops the filler, not the comparison."""
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
        configs, seen = [], set()
        for r, p, policy in first + [(r, p, policy) for r in sorted(residents) for p in cfg.prefetch
                                     for policy in cfg.policies]:
            key = (choose_resident_blocks(n, r, policy), p if r < n else None)  # same residents and slots
            if key not in seen:
                seen.add(key)
                configs.append((r, p, policy))
        return configs

    def run(self) -> BenchResult:
        cfg = self.config
        started = time.perf_counter()
        rows = [self.run_full()]  # the reference: if it fails there is nothing to compare with
        skipped: List[str] = []
        self.log(row_line(rows[-1]))
        for label, budget in self.budgets:
            rows.append(self.guarded(lambda: self.run_comfy(label, budget), "comfy_lowvram",
                                     budget=label, budget_bytes=budget))
        # Layerwise last: its host store keeps the block weights as views of (pinned) host memory afterwards.
        for label, budget in self.budgets:
            rows.append(self.guarded(lambda: self.run_layerwise(-1, 1, "leading", budget=(label, budget)),
                                     "layerwise_auto", budget=label, budget_bytes=budget, prefetch=1, policy="leading"))
        for resident, prefetch, policy in self.layerwise_configs():
            if cfg.deadline_s is not None and time.perf_counter() - started > cfg.deadline_s:
                skipped.append(f"layerwise r={resident} p={prefetch} {policy}: past --deadline-s")
                continue
            rows.append(self.guarded(lambda: self.run_layerwise(resident, prefetch, policy), "layerwise",
                                     resident=resident, prefetch=prefetch, policy=policy))
        self.mm.unload_all_models()
        return BenchResult(cfg, rows, self.summarize(rows), self.meta(time.perf_counter() - started),
                           self.block_nbytes, self.non_block, self.budgets, skipped=skipped)

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
            if best is None:
                entry.update(layerwise_config="none fits")
            else:
                entry.update(layerwise_config=f"r={best['resident']} p={best['prefetch']} {best['policy']}",
                             layerwise_step_ms=best["step_ms"], layerwise_h2d_bytes_per_step=best["h2d_bytes_per_step"],
                             layerwise_footprint_bytes=best["footprint_bytes"],
                             layerwise_stall_ms_per_step=best["stall_ms_per_step"], layerwise_bound_ms=best["bound_ms"])
                if comfy is not None:
                    entry["speedup_vs_comfy"] = comfy["step_ms"] / best["step_ms"]
            out.append(entry)
        return out

    def meta(self, seconds: float) -> Dict[str, object]:
        cpu_model = platform.processor() or platform.machine()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.lower().startswith("model name")),
                             cpu_model)
        meta = {
            "preset": self.config.preset, "preset_notes": self.preset.notes, "device": str(self.device),
            "dtype": str(self.dtype), "blocks": list(self.discovered.attributes),
            "num_blocks": len(self.block_nbytes), "block_nbytes": self.block_nbytes,
            "non_block_bytes": self.non_block, "model_bytes": self.model_bytes,
            "budgets": {label: b for label, b in self.budgets}, "steps": self.config.steps,
            "h2d_gbps": self.h2d_gbps, "torch": torch.__version__, "python": platform.python_version(),
            "comfyui": comfyui_version(), "comfyui_path": str(self.env.path), "machine": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model, "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads(), "seconds": round(seconds, 1),
        }
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            meta.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
        return meta


# ----------------------------------------------------------------------------------------------- the report
def row_line(row) -> str:
    what = row["mode"]
    if what == "comfy_lowvram":
        what += f" B={row['budget']}"
    elif what.startswith("layerwise"):
        what += f" r={row['resident']} p={row['prefetch']} {row['policy']}"
    if row.get("error"):
        return f"{what}: FAILED {row['error']}"
    if row["mode"] == "layerwise_auto":
        what += f" B={row['budget']}"
    return (f"{what}: {row['step_ms']:.2f} ms/step, {row['h2d_bytes_per_step'] / 2**20:.1f} MiB h2d/step, "
            f"bitwise {'equal' if row['bitwise_equal'] else 'DIFFERENT'}")


def write_outputs(result: BenchResult, out: Path) -> Dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"comfy_bench_{result.config.preset}_{result.meta['device'].split(':')[0]}"
    files = {"csv": write_csv(f"{stem}.csv", result.rows, COLUMNS),
             "summary": write_csv(f"{stem}_summary.csv", result.summary, SUMMARY_COLUMNS), "meta": f"{stem}_meta.json"}
    Path(files["meta"]).write_text(json.dumps({**result.meta, "skipped": result.skipped}, indent=2))
    if result.config.plot:
        try:
            files["png"] = plot(result, Path(f"{stem}_plot.png"))
        except ImportError:
            print("[comfy-bench] matplotlib is not installed: no PNG (pip install matplotlib)")
    return files


def plot(result: BenchResult, path: Path) -> str:
    """Step time against resident count per (prefetch, policy), the bound, full load, ComfyUI at each budget."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta, sizes = result.rows, result.meta, result.block_nbytes
    full = next(r for r in rows if r["mode"] == "full")
    ours = [r for r in rows if r["mode"] == "layerwise" and not r["error"]]
    n = len(sizes)
    fig, ax = plt.subplots(figsize=(12, 5.5))
    groups: Dict[Tuple[int, str], List[dict]] = {}
    for r in ours:
        groups.setdefault((r["prefetch"], r["policy"]), []).append(r)
    all_resident = [r for r in ours if r["resident"] == n]
    for (p, policy), members in sorted(groups.items()):
        members = sorted(members + [m for m in all_resident if m not in members], key=lambda r: r["resident"])
        ax.plot([m["resident"] for m in members], [m["step_ms"] for m in members], marker="o", ms=4, lw=1.2,
                ls="-" if policy == "leading" else "--", label=f"layerwise prefetch {p}, {policy}")
    h2d = meta["h2d_gbps"] * 1e9
    fwd = statistics.median([r["forwards_per_step"] for r in ours] or [1])
    bound = [max(full["step_ms"], streamed_bytes(sizes, r, "leading") * fwd / h2d * 1e3) for r in range(n + 1)]
    ax.plot(range(n + 1), bound, color="black", lw=1, ls=":", label=f"bound max(full, bytes / {h2d / 1e9:.1f} GB/s)")
    ax.axhline(full["step_ms"], color="grey", lw=0.8, label="full load (all resident)")
    for index, (label, budget) in enumerate(result.budgets):
        comfy = next((r for r in rows if r["mode"] == "comfy_lowvram" and r["budget"] == label and not r["error"]),
                     None)
        if comfy is None:
            continue
        x, left = 0.0, budget - result.non_block_bytes  # how many leading blocks B's weight bytes would hold
        for size in sizes:
            if left <= 0:
                break
            x, left = x + min(1.0, left / size), left - size
        ax.scatter([x], [comfy["step_ms"]], marker="X", s=90, color="crimson", zorder=5)
        ax.annotate(f"ComfyUI lowvram B={label}\n({size_text(budget)})", (x, comfy["step_ms"]),
                    textcoords="offset points", xytext=(6, 6 + 14 * (index % 3)), fontsize=7, color="crimson")
        fit = largest_fitting_resident(sizes, result.non_block_bytes, budget, 1, "leading")
        if fit is not None:
            ax.axvline(fit, color="crimson", lw=0.5, ls=":")
    autos = [r for r in rows if r["mode"] == "layerwise_auto" and not r["error"]]
    if autos:
        ax.scatter([r["resident"] for r in autos], [r["step_ms"] for r in autos], marker="*", s=110,
                   color="darkgreen", zorder=6, label="layerwise auto (-1) under ComfyUI's budget B")
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
    return str(path)


def print_result(result: BenchResult) -> None:
    """Per budget, ComfyUI's own offloading against the fastest layerwise configuration that fits it (every run was
    logged as it ran; the CSV holds them all)."""
    meta = result.meta
    print(f"\n{meta['preset']} on {meta.get('gpu', meta['device'])}: {meta['num_blocks']} blocks "
          f"({gib(sum(result.block_nbytes))} GiB), non-block {gib(result.non_block_bytes)} GiB, {meta['dtype']}, "
          f"{meta['steps']} steps; h2d {meta['h2d_gbps']:.2f} GB/s; ComfyUI {meta['comfyui']}, torch {meta['torch']}")
    ms = lambda v: "-" if v == "" else f"{v:.2f} ms/step"  # noqa: E731
    mib = lambda v: "-" if v == "" else f"{v / 2**20:.1f} MiB"  # noqa: E731
    for s in result.summary:
        print(f"  B={s['budget']} ({size_text(s['budget_bytes'])}): ComfyUI lowvram {ms(s['comfy_step_ms'])}, "
              f"{mib(s['comfy_h2d_bytes_per_step'])} h2d/step; layerwise {s['layerwise_config']} "
              f"{ms(s['layerwise_step_ms'])}, {mib(s['layerwise_h2d_bytes_per_step'])} h2d/step, footprint "
              f"{mib(s['layerwise_footprint_bytes'])}; auto r={s['auto_resident']} {ms(s['auto_step_ms'])}; "
              f"full load {ms(s['full_step_ms'])}")
    for note in result.skipped:
        print(f"skipped: {note}")
    for kind, path in result.files.items():
        print(f"wrote {kind}: {path}")


# ----------------------------------------------------------------------------------------------- entry points
def run_bench(config: BenchConfig) -> BenchResult:
    """Run every mode, write the CSVs / meta / plot under ``config.out`` (if given), return the result. On the CPU
    the node passes the model through unless the CPU loopback is asked for: it is set for this run only."""
    harness = Harness(config)
    with cpu_loopback(config.cpu, config.threads):
        try:
            harness.setup()
            result = harness.run()
        finally:
            harness.teardown()
    if config.out is not None:
        result.files = write_outputs(result, Path(config.out))
    return result


def run_formats_bench(config: BenchConfig):
    """The weight-format comparison (bench_formats.py), bf16 unless ``--dtype`` says otherwise; writes its CSV /
    Markdown under ``config.out``. Returns (rows, skipped lines, files). Outside ``torch.inference_mode()``: under
    it ComfyUI's own ``QuantizedTensor`` weights fail before the first step, without this pack (``Cannot set
    version_counter for inference tensor``, from ``module_size`` / ``Parameter.__new__``)."""
    from . import bench_formats
    config = dataclasses.replace(config, dtype=config.dtype or "bf16", budgets=(), plot=False, inference_mode=False)
    log = (lambda *a: None) if config.quiet else (lambda *a: print("[comfy-bench]", *a, flush=True))
    with cpu_loopback(config.cpu, config.threads):
        rows, skipped = bench_formats.run_formats(config, log)
    files = {} if config.out is None else bench_formats.write_format_outputs(rows, skipped, config,
                                                                             "cpu" if config.cpu else "cuda")
    return rows, skipped, files


def parse_args(argv=None) -> BenchConfig:
    from .bench_formats import parse_formats
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny",
                        help="flux | wan21_14b | qwen_image | tiny_wan | tiny (default tiny); several: flux,wan21_14b")
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
    parser.add_argument("--formats", default="", help="compare weight formats instead (bench_formats.py; Wan "
                        "presets): bf16,fp8_mixed,gguf_q4_0 or all (+ gguf_f16, gguf_q8_0, gguf_q5_0); with "
                        "--residents for the node's runs")
    parser.add_argument("--quiet", action="store_true")
    a = parser.parse_args(argv)
    ints = lambda text: [int(part) for part in text.split(",") if part.strip()]  # noqa: E731
    return BenchConfig(
        preset=a.preset, device=a.device, dtype=a.dtype, blocks=tuple(ints(a.blocks)) if a.blocks else None,
        steps=a.steps, seed=a.seed, budgets=[b.strip() for b in a.budgets.split(",") if b.strip()],
        residents=None if a.residents == "auto" else ints(a.residents), prefetch=ints(a.prefetch),
        policies=[p.strip() for p in a.policies.split(",") if p.strip()],
        out=Path(a.out) if a.out else None, plot=not a.no_plot, threads=a.threads, deadline_s=a.deadline_s,
        quiet=a.quiet, inference_mode=not a.no_inference_mode, formats=parse_formats(a.formats),
    )


def main(argv=None) -> int:
    """Runs each preset of ``--preset a,b,c`` in turn (one ComfyUI import); a failing preset does not stop the rest."""
    config = parse_args(argv)
    status = 0
    for preset in [p.strip() for p in config.preset.split(",") if p.strip()]:
        if config.formats:
            from .bench_formats import markdown, wan14b_table
            rows, skipped, _ = run_formats_bench(dataclasses.replace(config, preset=preset))
            print(markdown(rows, skipped) + "\n" + wan14b_table(config.formats), flush=True)
            status = status or int(any(r["error"] or not r["bitwise_equal"] for r in rows))
            continue
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
