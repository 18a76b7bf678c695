"""The GPU run's harness: bench_modes.Harness's model, sampling and byte accounting, measured at physically equal
VRAM (a ``Ballast`` per run), with device-level peaks and one CSV row appended per run (bench/gpu_steps.py)."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .bench_measure import CastCounter, bitwise_equal, lowvram_module_bytes, our_footprint
from .bench_modes import Harness
from .gpu_rows import Ballast, DevicePeak, bound_ms, ratio

HEADROOM = 3 << 29  # 1.5 GiB: ComfyUI keeps minimum_inference_memory + its reserved VRAM free beyond its estimate


def _version() -> str:
    try:
        import comfyui_version
        return comfyui_version.__version__
    except ImportError:
        return "unknown"


class BlockClock:
    """Per-block compute time of the forwards it sees: CUDA events around each block (the clock on the CPU)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], cuda: bool):
        self.cuda = cuda
        self.marks: Dict[int, List[tuple]] = {i: [] for i in range(len(blocks))}
        self._open: Dict[int, object] = {}
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self._start(i)))
            self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._end(i)))

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, i):
        self._open[i] = self._mark()

    def _end(self, i):
        self.marks[i].append((self._open.pop(i), self._mark()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def median_ms(self, i: int) -> object:
        pairs = self.marks[i][1:] or self.marks[i]  # the first call pays for first-touch and autotuning
        if not pairs:
            return ""
        if self.cuda:
            pairs[-1][1].synchronize()
            return sorted(a.elapsed_time(b) for a, b in pairs)[len(pairs) // 2]
        return sorted((b - a) * 1e3 for a, b in pairs)[len(pairs) // 2]


class GpuHarness(Harness):
    def __init__(self, config, tables, step: str, gbps: float = 0.0, load: Optional[Callable[[], object]] = None):
        super().__init__(config)
        self.tables = tables
        self.step = step
        self._gbps = gbps
        self._load = load
        self.references: Dict[str, torch.Tensor] = {}
        self.computes: Dict[str, float] = {}
        self.comfy_ms: Dict[str, float] = {}
        self.auto_ms: Dict[str, float] = {}  # this pack at auto per budget: the 0.14.1 dynamic rows compare with it
        self.act_reserve = 0
        self.compute_ms: object = ""

    def build_patcher(self):
        return self._load() if self._load is not None else super().build_patcher()

    def setup(self):
        super().setup()
        self.comfyui = _version()
        self.gbps = self._gbps or self.h2d_gbps  # registered-memory GB/s from the preflight, else pinned here

    # ..................................................................... one measured run
    def _measure(self, mode: str, run: Callable[[], dict], label="", budget: Optional[int] = None,
                 weights: Optional[str] = None, **fields) -> dict:
        self._fresh()
        started = time.perf_counter()
        with Ballast(self.device, budget) as ballast, DevicePeak(self.device) as peak:
            hrow = self.guarded(run, mode, **fields)
        step_ms = hrow["step_ms"]
        streamed = hrow["h2d_bytes_per_step"]
        stall = hrow["stall_ms_per_step"]
        bound = bound_ms(self.compute_ms if mode not in ("full", "full_lora") else step_ms,
                         streamed or 0, self.gbps)
        speedup = ratio(self.comfy_ms.get(label, ""), step_ms) if mode.startswith("layerwise") else ""
        return self.tables["steps"].add(
            comfyui=self.comfyui, step=self.step, preset=self.config.preset, mode=mode,
            weights=weights or str(self.dtype).replace("torch.", ""), budget=label,
            budget_bytes=budget if budget is not None else "", ballast_bytes=ballast.nbytes,
            num_blocks=len(self.block_nbytes), resident=hrow["resident"], prefetch=hrow["prefetch"],
            policy=hrow["policy"], steps=self.config.steps, forwards_per_step=hrow["forwards_per_step"],
            step_ms=step_ms, step_ms_spread=hrow["step_ms_spread"], streamed_bytes_per_step=streamed,
            stall_ms_per_step=stall, stall_pct=ratio(stall, step_ms) and 100 * ratio(stall, step_ms),
            compute_ms=self.compute_ms if mode not in ("full", "full_lora") else step_ms, gbps=self.gbps,
            bound_ms=bound, ratio_to_bound=ratio(step_ms, bound), speedup_vs_comfy=speedup,
            device_peak_bytes=peak.peak_bytes, weights_device_bytes=hrow["weights_device_bytes"],
            bitwise_equal_full=hrow["bitwise_equal"], seconds=time.perf_counter() - started, error=hrow["error"])

    # ..................................................................... the modes
    def full(self, mode: str = "full", weights: Optional[str] = None, per_block: bool = False, state=None) -> dict:
        clock = BlockClock(self.discovered.blocks, self.cuda) if per_block else None
        try:
            row = self._measure(mode, self.run_full, label="all", weights=weights)
        finally:
            if clock is not None:
                clock.remove()
        if row["error"]:
            raise RuntimeError(f"[layerwise-offload] the full load failed, nothing to compare with: {row['error']}")
        self.compute_ms = float(row["step_ms"])
        self.references[mode], self.computes[mode] = self.reference, self.compute_ms
        if self.cuda and row["device_peak_bytes"] != "":
            self.act_reserve = max(0, int(row["device_peak_bytes"]) - self.model_bytes)
        if clock is not None:
            self._block_rows(clock)
        if state is not None:
            name = f"{self.comfyui}_{self.config.preset}"
            torch.save(self.reference.cpu(), state.folder / f"{name}.pt")
            state.save(name, dict(compute_ms=self.compute_ms, act_reserve=self.act_reserve, gbps=self.gbps,
                                  non_block=self.non_block, block_total=self.block_total,
                                  model_bytes=self.model_bytes, num_blocks=len(self.block_nbytes),
                                  reference=str(state.folder / f"{name}.pt")))
        return row

    def _block_rows(self, clock: BlockClock) -> None:
        from .gpu_steps import copy_seconds
        copy_ms = {}
        for nbytes in sorted(set(self.block_nbytes)):
            try:
                copy_ms[nbytes] = copy_seconds(nbytes, self.device, "registered", repeats=3) * 1e3
            except Exception as error:  # noqa: BLE001 - a refused registration is a result
                copy_ms[nbytes] = ""
                self.log(f"copy of {nbytes} registered bytes failed: {error}")
        for i, block in enumerate(self.discovered.blocks):
            compute = clock.median_ms(i)
            self.tables["blocks"].add(comfyui=self.comfyui, preset=self.config.preset, block=i,
                                      kind=type(block).__name__, nbytes=self.block_nbytes[i], compute_ms=compute,
                                      copy_ms=copy_ms[self.block_nbytes[i]],
                                      copy_over_compute=ratio(copy_ms[self.block_nbytes[i]], compute),
                                      note="" if self.cuda else "dry run: CPU loopback")

    def budgets_for(self, fractions: str) -> List[Tuple[str, int]]:
        extra = self.act_reserve + (HEADROOM if self.cuda else 0)
        return [(f"{float(f):g}", int(self.non_block + float(f) * self.block_total + extra))
                for f in fractions.split(",") if f.strip()]

    def sweep_configs(self, budget: int) -> List[Tuple[int, int]]:
        n = len(self.block_nbytes)
        extra = self.act_reserve + (HEADROOM if self.cuda else 0)
        out = []
        for resident, prefetch in ((0, 1), (n // 4, 1), (n // 2, 1), (n // 2, 2)):
            fits = our_footprint(self.block_nbytes, self.non_block, resident, prefetch, "leading") + extra <= budget
            if (fits or not self.cuda) and (resident, prefetch) not in out:
                out.append((resident, prefetch))
        return out

    def comfy_lowvram(self, label: str, budget: int) -> dict:
        row = self._measure("comfy_lowvram", self.run_comfy_free, label, budget)
        if not row["error"]:
            self.comfy_ms[label] = float(row["step_ms"])
        return row

    def layerwise(self, resident: int, prefetch: int, policy: str, label: str, budget: int,
                  mode: str = "layerwise", ballast: bool = True, weights: Optional[str] = None) -> dict:
        row = self._measure(mode, lambda: self.run_layerwise(resident, prefetch, policy), label,
                            budget if ballast else None, weights=weights, resident=resident, prefetch=prefetch,
                            policy=policy)
        if mode == "layerwise_auto" and not row["error"]:
            self.auto_ms[label] = float(row["step_ms"])
        return row

    def run_comfy_free(self) -> dict:
        """ComfyUI's own loading, deciding from the memory that is really free (the ballast holds the rest)."""
        self._fresh()
        patcher = self.patcher.clone()
        counter, snap = CastCounter(), {}
        with counter.installed():
            out, seconds, peak = self._sample(patcher, lambda: snap.update(forwards=self.forwards, bytes=counter.bytes))
        intervals = self.config.steps - 1
        row = self._base_row("comfy_lowvram")
        self._timing(row, seconds)
        row.update(forwards_per_step=(self.forwards - snap["forwards"]) / intervals,
                   weights_device_bytes=patcher.loaded_size()
                   + int(getattr(patcher.model, "model_offload_buffer_memory", 0) or 0),
                   peak_alloc_bytes=peak, streamed_bytes_per_forward=lowvram_module_bytes(patcher.model),
                   h2d_bytes_per_step=(counter.bytes - snap["bytes"]) / intervals,
                   bitwise_equal=bitwise_equal(out, self.reference))
        self._bound(row)
        self._unload(patcher)
        return row

    def with_lora(self, patcher, rank: int = 16):
        """A rank-``rank`` LoRA over every 2-D block weight, loaded the way ComfyUI's LoraLoader loads one."""
        import comfy.sd
        generator = torch.Generator().manual_seed(7)
        lora = {}
        for key, tensor in patcher.model.state_dict().items():
            if ".blocks." in key and key.endswith(".weight") and tensor.ndim == 2:
                stem = key[:-len(".weight")]
                lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
                lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
        if not lora:
            raise RuntimeError("[layerwise-offload] no block weights found to put a LoRA on")
        return comfy.sd.load_lora_for_models(patcher, None, lora, 0.8, 0)[0]
