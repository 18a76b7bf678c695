"""The modes of the side-by-side benchmark (full load, ComfyUI lowvram, layerwise, layerwise auto) and the
sweep over them; one :class:`Harness` per preset. The modes are described in comfy_bench.py's docstring."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .bench_config import COLUMNS, DTYPES, SUMMARY_COLUMNS, BenchConfig, BenchResult
from .bench_measure import (CastCounter, StepClock, gib, bitwise_equal, comfy_weight_budget,
                            largest_fitting_resident, lowvram_module_bytes, measure_h2d_gbps, parse_budget,
                            streamed_bytes)
from .bench_report import row_line
from ..devtools import comfy_env
from ..offload import choose_resident_blocks


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
        env_module = comfy_env
        self.env = env_module.import_comfyui(cpu=(device == "cpu"), import_nodes=False)
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
        if self.device.type == "cpu" and self.dtype != torch.float32 and cfg.dtype is None:
            self.dtype = torch.float32

        started = time.perf_counter()
        self.patcher = self.build_patcher()
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
        self.log(f"model {gib(self.model_bytes)} GiB: blocks {gib(self.block_total)} GiB "
                 f"({len(self.block_nbytes)} x {gib(min(self.block_nbytes))}..{gib(max(self.block_nbytes))}), "
                 f"non-block {gib(self.non_block)} GiB; h2d {self.h2d_gbps:.2f} GB/s; budgets "
                 + ", ".join(f"{label}={gib(b)} GiB" for label, b in self.budgets))
        # Counts diffusion-model forwards (one per apply_model) in every mode.
        self.forwards = 0

        def count_forward(module, args):
            self.forwards += 1
        self._forward_hook = self.diffusion_model.register_forward_pre_hook(count_forward)

    def build_patcher(self):
        """The model under test: the preset with random weights (bench_formats.py loads it from a file instead)."""
        return self.presets.build(self.preset, seed=self.config.seed, dtype=self.dtype, blocks=self.config.blocks)

    def _offload(self, resident, prefetch, policy):
        from ..nodes.offload_node import offload_model
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
        self.log(row_line(row))
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
        if after.device_bytes:  # armed: the plan that ran
            streamed = sum(n for n, tier in zip(self.block_nbytes, after.block_tiers) if tier != "resident")
            resident = after.resident_blocks
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
        self.log(row_line(rows[-1]))
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
