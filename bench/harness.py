"""The side-by-side harness the ComfyUI benchmarks share (comfy_bench.py, its ``--formats`` mode in bench_formats.py,
and gpu_harness.py's GPU harness, a subclass): one preset's model inside the real ComfyUI, and the modes run on it
(``full``, ``comfy_lowvram``, ``layerwise``, ``layerwise_auto``; comfy_bench.py's docstring says what each measures),
with its config, its rows and their columns."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .measure import (CastCounter, StepClock, bitwise_equal, comfy_weight_budget, comfyui_version, copy_seconds,
                      largest_fitting_resident, lowvram_module_bytes, parse_budget, streamed_bytes)
from ..devtools import comfy_env
from ..offload import choose_resident_blocks, format_bytes, format_rate

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

        from ..devtools import dit_presets
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
        self.log(f"model {format_bytes(self.model_bytes)}: blocks {format_bytes(self.block_total)} "
                 f"({len(self.block_nbytes)} x {format_bytes(min(self.block_nbytes))}.."
                 f"{format_bytes(max(self.block_nbytes))}), non-block {format_bytes(self.non_block)}; "
                 f"h2d {format_rate(self.h2d_gbps * 1e9)}; budgets "
                 + ", ".join(f"{label}={format_bytes(b)}" for label, b in self.budgets))
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
    return (f"{what}: {row['step_ms']:.2f} ms/step, {format_bytes(row['h2d_bytes_per_step'])} h2d/step, "
            f"bitwise {'equal' if row['bitwise_equal'] else 'DIFFERENT'}")
