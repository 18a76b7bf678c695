"""The steps of the one-call GPU run (bench/gpu_run.sh; docs/gpu_run.md has the plan), one process each; every row
goes to a CSV as it is measured.

    python -P bench/gpu_steps.py preflight  --out DIR --work W
    python -P bench/gpu_steps.py sidebyside --out DIR --work W --preset flux [--lowvram] [--sweep]
    python -P bench/gpu_steps.py lora|fp8   --out DIR --work W        (fp8: ComfyUI 0.33.0 with comfy-kitchen)
    python -P bench/gpu_steps.py dynamic    --out DIR --work W --preset flux   (ComfyUI 0.33.0's dynamic VRAM)
    ... --dry-run: the same code on the CPU loopback at the tiny presets (no ballast, no registration timing)

``sidebyside``: the full load (the reference; per-block compute from CUDA events, per-block copies of registered
memory), then at each budget B (fractions f: non-block weights + f x the blocks + the full load's activation peak
+ 1.5 GiB, held free by a ``Ballast``) ComfyUI's own offloading (``--lowvram``) and this pack at its defaults, then
(``--sweep``) every resident count 0..N in steps (:func:`sweep_counts`), with the whole device and the node's
defaults for policy and prefetch, each beside the timing model's prediction for the setting that ran (the replay of
offload/timing/ fed this GPU's measured per-block compute and copy rate) and with its per-block CUDA-event
timeline (``timeline.csv``). ``<work>/state/`` hands the reference and budgets to the 0.33.0 ``dynamic`` process,
which starts comfy-aimdo in ComfyUI's order (its state is global: a process of its own) and counts the bytes dynamic
VRAM really moves (:class:`VbarCastCounter`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

AIMDO_BEFORE_TORCH = None
if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())
    if sys.argv[1:2] == ["dynamic"]:
        # ComfyUI's main.py loads aimdo's library before anything imports torch; so does the dynamic step.
        import comfy_aimdo.control
        try:
            AIMDO_BEFORE_TORCH = "torch" not in sys.modules and bool(
                comfy_aimdo.control.init(simple_vram_headroom=None, nvml_pressure=True))
        except TypeError:  # comfy-aimdo 0.4.9's protocol
            AIMDO_BEFORE_TORCH = "torch" not in sys.modules and bool(comfy_aimdo.control.init())
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ""

import torch  # noqa: E402

from .harness import BenchConfig, Harness  # noqa: E402
from .measure import (CPU_LOOPBACK_ENV, StepClock, bitwise_equal, block_lora, comfyui_version,  # noqa: E402
                      copy_seconds, elapsed, mark, page_aligned_host, tensor_nbytes, with_lora)
from .gpu_tables import TABLES, Ballast, DevicePeak, State, Table, add_step, bound_ms, ratio  # noqa: E402,F401
from ..devtools import comfy_env  # noqa: E402

DRY_PRESETS = {"flux": "tiny", "wan21_14b": "tiny_wan"}  # what a dry run builds in a preset's place
AUTO_POLICY = "auto"  # the node's residency_policy default (nodes/offload_node.py; not imported: ComfyUI comes later)
WEIGHTS_POLICY = "weights"  # the node's weight-by-weight plan (the fewest bytes a step at a budget)
HEADROOM = 3 << 29  # 1.5 GiB: ComfyUI keeps minimum_inference_memory + reserved VRAM free on top of its estimate


def log(*parts) -> None:
    print("[gpu_steps]", *parts, flush=True)


# ----------------------------------------------------------------------------------------------- preflight
def resident_copy(nbytes: int, device: torch.device) -> dict:
    """A resident's copy as arming does it: pageable host memory through the page-locked bounce ring, queued on a
    copy stream; GB/s to the copy's end, the seconds the host was held, and register + unregister s per GiB."""
    # Looks inside: the preflight times the manager's own copy machinery, which has no public handle.
    from ..offload.device.backend import StreamBackend
    from ..offload.device.resident_copy import bounce_for
    from ..offload.memory.pinning import CudaHostRegisterPinner
    src = page_aligned_host(nbytes)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    backend = StreamBackend(device, measure_time=False)
    pinner = CudaHostRegisterPinner()
    started = time.perf_counter()
    granted = pinner.register(src)
    if granted:
        pinner.unregister(src)
    register_s = (time.perf_counter() - started) * (1 << 30) / nbytes if granted else ""
    bounce = bounce_for(pinner)
    if bounce is None:
        raise RuntimeError("the bounce ring could not be page-locked")
    try:
        torch.cuda.synchronize()
        started = time.perf_counter()
        handle = bounce.copy(backend, dst, src)
        host_s = time.perf_counter() - started
        handle.done.synchronize()
        total_s = time.perf_counter() - started
    finally:
        bounce.close()
    if not torch.equal(dst[:: 1 << 20].cpu(), src[:: 1 << 20]):
        raise RuntimeError("the bounce copy did not arrive whole")
    return {"gbps": nbytes / total_s / 1e9, "host_s": host_s, "register_s": register_s}


def preflight(args, tables, state) -> int:
    from . import bench_engine
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    cuda = device.type == "cuda"

    def add(name, value, unit="", note=""):
        tables["preflight"].add(comfyui="none", name=name, value=value, unit=unit, note=note)

    def failed(error):
        return f"{type(error).__name__}: {error}"[:200]

    add("torch", torch.__version__, note=f"cuda {torch.version.cuda}")
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        add("gpu", torch.cuda.get_device_name(device), note=f"{total} B")
    nbytes = (1 << 30) if cuda else (16 << 20)
    gbps = {}
    for kind in ("registered", "pinned", "pageable"):
        try:
            gbps[kind] = nbytes / copy_seconds(nbytes, device, kind) / 1e9
            add(f"h2d_gbps_{kind}", gbps[kind], "GB/s",
                f"{nbytes} B, median of 5" + ("" if cuda else ", CPU: host copy"))
        except Exception as error:  # noqa: BLE001 - a refused kind is a result
            add(f"h2d_gbps_{kind}", "", "GB/s", failed(error))
    state.save("preflight", {"gbps": gbps.get("registered") or gbps.get("pinned") or 0.0})
    if not cuda:
        add("h2d_gbps_resident_bounce", "", "GB/s", "dry run: needs CUDA")
        add("stale_cuda_error_after_refusal", "", "cudaError", "dry run: needs CUDA")
    else:
        try:
            resident = resident_copy(nbytes, device)
            add("h2d_gbps_resident_bounce", resident["gbps"], "GB/s", f"{nbytes} B pageable through the 2 x 32 MiB "
                f"page-locked ring (offload/device/resident_copy.py), host blocked {resident['host_s']:.3f} s")
            add("register_s_per_gib", resident["register_s"], "s", "cudaHostRegister + Unregister of 1 GiB: what a "
                "change of the streamed set pays per GiB of blocks whose membership changed")
        except Exception as error:  # noqa: BLE001 - a refused ring is a result
            add("h2d_gbps_resident_bounce", "", "GB/s", failed(error))
        # A refused registration (the same pages twice) must leave no error behind for the next kernel launch.
        from ..offload.memory.pinning import CudaHostRegisterPinner, _runtime_last_error  # looks inside, as above
        pinner, buf = CudaHostRegisterPinner(), page_aligned_host(1 << 20)
        first, second = pinner.register(buf), pinner.register(buf)
        reader = _runtime_last_error()  # torch's cudart bindings have no cudaGetLastError
        left = int(reader()) if reader is not None else "n/a: libcudart not reachable"
        try:
            torch.ones(4, device=device).add_(1).sum().item()
            launch = "ok"
        except Exception as error:  # noqa: BLE001
            launch = failed(error)[:150]
        if first:
            pinner.unregister(buf)
        add("stale_cuda_error_after_refusal", left, "cudaError",
            f"register {first}, again {second}; next kernel {launch}")
    hooks = bench_engine.bench_hooks(device, num_blocks=48, repeats=7 if cuda else 3, inner=20 if cuda else 2)
    for key in ("manager_overhead_us_per_block", "noop_hook_overhead_us_per_block", "manager_logic_us_per_block",
                "bare_us_per_block"):
        add(f"hooks_{key}", hooks[key], "us", "48 tiny blocks, all resident (bench/bench_engine.py)")
    return 0


# ----------------------------------------------------------------------------------------------- the GPU harness
def sweep_counts(num_blocks: int, runs: int = 7) -> List[int]:
    """Resident counts 0..N in even steps (at most ``runs``, N always), ends first and then the middles of what is
    left, so a step cut by its cap still spans the whole range."""
    step = max(1, -(-num_blocks // max(1, runs - 1)))
    counts = sorted(set(range(0, num_blocks, step)) | {num_blocks})
    order, spans = [counts[0]] + ([counts[-1]] if len(counts) > 1 else []), [(0, len(counts) - 1)]
    while spans:
        a, b = spans.pop(0)
        if b - a >= 2:
            m = (a + b) // 2
            order.append(counts[m])
            spans += [(a, m), (m, b)]
    return order


def predict_setting(block_nbytes: Sequence[int], block_ms: Sequence[float], compute_ms: float, gbps: float,
                    resident: int, policy: str, prefetch: int, tails: Optional[Sequence[int]] = None):
    """The timing model's step (offload/timing/step.py) for this setting, timed with
    what this GPU measured: each block's compute from the full load's CUDA events, the rest of the full step as the
    work outside the blocks, the copy rate of registered memory. None without those figures. The host regime is the
    bench's: it synchronises once, at the end of step 1 (StepClock), and runs ahead of the GPU after that."""
    from ..offload.timing import costs as tm
    from ..offload.timing.step import predict
    if not block_ms or "" in block_ms or not gbps or compute_ms in ("", None):
        return None
    block_s = [float(ms) / 1e3 for ms in block_ms]
    gpu = tm.GpuSpec("this GPU (measured)", 0, h2d_bytes_per_s=gbps * 1e9,
                     matmul_flops_per_s=1.0 / tm.DIT_EFFICIENCY, hbm_bytes_per_s=float("inf"),
                     source="the full load's per-block CUDA events and the preflight's registered copy rate")
    costs = tm.ModelCosts(tuple(int(n) for n in block_nbytes), tuple(block_s),  # 1 "FLOP" a second here
                          outside_flops=max(0.0, float(compute_ms) / 1e3 - sum(block_s)))
    return predict(costs, gpu, int(resident), policy, int(prefetch), sync_each_step=False, tails=tails)


class BlockClock:
    """Per-block compute time of the forwards it sees: CUDA events around each block (the clock on the CPU)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], cuda: bool):
        self.marks: Dict[int, List[tuple]] = {i: [] for i in range(len(blocks))}
        self._open: Dict[int, object] = {}
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self._open.update({i: mark(cuda)})))
            self._handles.append(block.register_forward_hook(
                lambda m, a, o, i=i: self.marks[i].append((self._open.pop(i), mark(cuda)))))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def median_ms(self, i: int) -> object:
        pairs = self.marks[i][1:] or self.marks[i]  # the first call pays for first-touch and autotuning
        return sorted(elapsed(a, b) * 1e3 for a, b in pairs)[len(pairs) // 2] if pairs else ""

    def last_forward_ms(self) -> List[Tuple[float, float]]:
        """Each block's (start, end) in its last call, in ms from the end of the last block's call before; [] when
        the blocks ran fewer than twice."""
        n = len(self.marks)
        if n == 0 or any(len(self.marks[i]) < 1 for i in range(n)) or len(self.marks[n - 1]) < 2:
            return []
        origin = self.marks[n - 1][-2][1]
        return [(elapsed(origin, self.marks[i][-1][0]) * 1e3, elapsed(origin, self.marks[i][-1][1]) * 1e3)
                for i in range(n)]


class GpuHarness(Harness):
    """comfy_bench's harness measured at physically equal VRAM (a ``Ballast`` per run), with device-level peaks
    and one ``steps`` row appended per run."""

    def __init__(self, config, tables, step: str, gbps: float = 0.0, load: Optional[Callable[[], object]] = None):
        super().__init__(config, load)
        self.tables = tables
        self.step = step
        self._gbps = gbps
        self.references: Dict[str, torch.Tensor] = {}
        self.computes: Dict[str, float] = {}
        self.comfy_ms: Dict[str, float] = {}
        self.auto_ms: Dict[str, float] = {}  # this pack at auto per budget: the 0.33.0 dynamic rows compare with it
        self.act_reserve = 0
        self.compute_ms: object = ""
        self.block_ms: List[object] = []  # each block's compute in the full load (CUDA events): the model's input
        self.explained = False  # a mismatch with the full load was explained in this step
        self._controller = None  # the last run's controller, until its setting is read

    def _offload(self, resident, prefetch, policy):
        patcher = super()._offload(resident, prefetch, policy)
        self._controller = patcher.attachments.get("layerwise_offload")
        return patcher

    def _setting_that_ran(self) -> Dict[str, object]:
        """The policy and prefetch the node chose (residency_policy auto), read from its controller, then let go."""
        controller, self._controller = self._controller, None
        if controller is None:
            return {}
        # A weights plan's tails are per weight unit: the timing model's replay here is per block, so none is given.
        tails = None if controller.discovered.streams_weights else controller.manager.block_tails(controller.plan())
        plan = controller.plan()
        return dict(policy=plan.policy, prefetch=plan.prefetch_size, tails=tails)

    def setup(self):
        super().setup()
        self.comfyui = comfyui_version()
        self.gbps = self._gbps or self.h2d_gbps  # registered-memory GB/s from the preflight, else pinned here

    def _measure(self, mode: str, run: Callable[[], dict], label="", budget: Optional[int] = None,
                 weights: Optional[str] = None, clock: Optional[BlockClock] = None, **fields) -> dict:
        self._fresh()
        started = time.perf_counter()
        with Ballast(self.device, budget) as ballast, DevicePeak(self.device) as peak:
            hrow = self.guarded(run, mode, **fields)
        step_ms = hrow["step_ms"]
        prediction = None
        try:  # what is read beside the run never takes the row (or the step's other rows) with it
            if mode.startswith("layerwise") or mode == "sweep":
                hrow.update(self._setting_that_ran())
            if mode in ("layerwise_auto", "layerwise", "sweep") and not hrow["error"] and hrow["resident"] != "":
                prediction = predict_setting(self.block_nbytes, self.block_ms, self.compute_ms, self.gbps,
                                             hrow["resident"], hrow["policy"], hrow["prefetch"], hrow.get("tails"))
            if clock is not None and prediction is not None:
                self._timeline_rows(clock, prediction, hrow)
        except Exception as error:  # noqa: BLE001 - logged in the row
            import traceback
            traceback.print_exc()
            hrow["error"] = (hrow["error"] + "; " if hrow["error"] else "") + f"beside the run: {error}"[:200]
        return add_step(
            self.tables["steps"], comfyui=self.comfyui, step=self.step, preset=self.config.preset, mode=mode,
            weights=weights or str(self.dtype).replace("torch.", ""), budget=label,
            budget_bytes=budget if budget is not None else "", ballast_bytes=ballast.nbytes,
            num_blocks=len(self.block_nbytes), resident=hrow["resident"], prefetch=hrow["prefetch"],
            policy=hrow["policy"], steps=self.config.steps, forwards_per_step=hrow["forwards_per_step"],
            step_ms=step_ms, step_ms_spread=hrow["step_ms_spread"], streamed_bytes_per_step=hrow["h2d_bytes_per_step"],
            stall_ms_per_step=hrow["stall_ms_per_step"],
            compute_ms=self.compute_ms if mode not in ("full", "full_lora") else step_ms, gbps=self.gbps,
            predicted_step_ms=prediction.step_s * 1e3 if prediction else "",
            predicted_ratio_to_bound=prediction.ratio if prediction else "",
            speedup_vs_comfy=ratio(self.comfy_ms.get(label, ""), step_ms) if mode.startswith("layerwise") else "",
            device_peak_bytes=peak.peak_bytes, weights_device_bytes=hrow["weights_device_bytes"],
            bitwise_equal_full=hrow["bitwise_equal"], seconds=time.perf_counter() - started, error=hrow["error"],
            tails_bytes_per_step=sum(hrow["tails"]) if hrow.get("tails") else "")

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
        if clock is not None:
            self.block_ms = [clock.median_ms(i) for i in range(len(self.discovered.blocks))]
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
        copy_ms = {}
        for nbytes in sorted(set(self.block_nbytes)):
            try:
                copy_ms[nbytes] = copy_seconds(nbytes, self.device, "registered", repeats=3) * 1e3
            except Exception as error:  # noqa: BLE001 - a refused registration is a result
                copy_ms[nbytes] = ""
                self.log(f"copy of {nbytes} registered bytes failed: {error}")
        for i, block in enumerate(self.discovered.blocks):
            compute, copy = clock.median_ms(i), copy_ms[self.block_nbytes[i]]
            self.tables["blocks"].add(comfyui=self.comfyui, preset=self.config.preset, block=i,
                                      kind=type(block).__name__, nbytes=self.block_nbytes[i], compute_ms=compute,
                                      copy_ms=copy, copy_over_compute=ratio(copy, compute),
                                      note="" if self.cuda else "dry run: CPU loopback")

    def _timeline_rows(self, clock: BlockClock, prediction, hrow) -> None:
        from ..offload import choose_resident_blocks
        measured = clock.last_forward_ms()
        if not measured:
            return
        resident = choose_resident_blocks(len(self.block_nbytes), int(hrow["resident"]), hrow["policy"])
        for i, ((start, end), (p_start, p_end)) in enumerate(zip(measured, prediction.block_spans)):
            waited = [e for b, _, e in prediction.copy_spans if b == i and e <= p_start + 1e-9]  # the copy it used
            self.tables["timeline"].add(
                comfyui=self.comfyui, step=self.step, preset=self.config.preset, resident=hrow["resident"],
                policy=hrow["policy"], prefetch=hrow["prefetch"], block=i, streamed=int(not resident[i]),
                measured_start_ms=start, measured_end_ms=end, predicted_start_ms=p_start * 1e3,
                predicted_end_ms=p_end * 1e3, predicted_copy_end_ms=max(waited) * 1e3 if waited else "",
                note="" if self.cuda else "dry run: CPU clock")

    def budgets_for(self, fractions: str) -> List[Tuple[str, int]]:
        extra = self.act_reserve + (HEADROOM if self.cuda else 0)
        return [(f"{float(f):g}", int(self.non_block + float(f) * self.block_total + extra))
                for f in fractions.split(",") if f.strip()]

    def comfy_lowvram(self, label: str, budget: int) -> dict:
        row = self._measure("comfy_lowvram", self.run_comfy, label, budget)  # its planner sees the ballast
        if not row["error"]:
            self.comfy_ms[label] = float(row["step_ms"])
        return row

    def layerwise(self, resident: int, prefetch: int, policy: str, label: str, budget: Optional[int],
                  mode: str = "layerwise", ballast: bool = True, weights: Optional[str] = None,
                  timeline: bool = False) -> dict:
        clock = BlockClock(self.discovered.blocks, self.cuda) if timeline else None
        try:
            row = self._measure(mode, lambda: self.run_layerwise(resident, prefetch, policy), label,
                                budget if ballast else None, weights=weights, clock=clock, resident=resident,
                                prefetch=prefetch, policy=policy)
        finally:
            if clock is not None:
                clock.remove()
        if mode == "layerwise_auto" and not row["error"]:
            self.auto_ms[label] = float(row["step_ms"])
        if not row["error"] and row["bitwise_equal_full"] is False and not self.explained:
            self.explained = True  # once a step: it reruns both models
            try:
                self.explain_mismatch(resident, prefetch, policy, budget if ballast else None)
            except Exception as error:  # noqa: BLE001 - an explanation that fails is logged, not fatal
                log(f"explaining the mismatch failed: {type(error).__name__}: {error}")
        return row

    def explain_mismatch(self, resident: int, prefetch: int, policy: str, budget: Optional[int]) -> None:
        """One step of the full load and of this setting, every leaf module's first call recorded: the first module
        whose input is bitwise the same and whose output is not is where the two differ. A row in preflight.csv
        names it, with its weight's alignment and strides in both runs."""
        def record(patcher, into):
            model = patcher.get_model_object("diffusion_model")
            handles = []
            for name, module in model.named_modules():
                if next(module.children(), None) is not None:
                    continue

                def hook(module, args, output, name=name):
                    if name in into or not args or not isinstance(args[0], torch.Tensor):
                        return
                    weight = getattr(module, "weight", None)
                    shape = "" if weight is None else (
                        f"{type(weight).__name__} {tuple(weight.shape)} stride {tuple(weight.stride())} "
                        f"at {weight.data_ptr() % 4096} mod 4096, {weight.device}")
                    into[name] = (args[0].detach().clone(), output.detach().clone()
                                  if isinstance(output, torch.Tensor) else None, type(module).__name__, shape)
                handles.append(module.register_forward_hook(hook))
            return handles

        full, mine = {}, {}
        self._fresh()
        handles = record(self.patcher, full)
        try:
            with torch.inference_mode():
                self.presets.sample(self.patcher, self.preset, seed=self.config.seed, steps=1)
        finally:
            for handle in handles:
                handle.remove()
        self._fresh()
        with Ballast(self.device, budget):
            patcher = self._offload(resident, prefetch, policy)
            handles = record(patcher, mine)
            try:
                with torch.inference_mode():
                    self.presets.sample(patcher, self.preset, seed=self.config.seed, steps=1)
            finally:
                for handle in handles:
                    handle.remove()
                self._unload(patcher)
        note = "no leaf module differs on its first call"
        for name, (inp, out, kind, weight) in full.items():
            other = mine.get(name)
            if other is None or out is None or other[1] is None:
                continue
            if torch.equal(inp, other[0]) and not torch.equal(out, other[1]):
                diff = (out.float() - other[1].float()).abs().max().item()
                note = (f"{name} ({kind}): same input, output differs by {diff:.3g}; full load weight {weight}; "
                        f"this pack's {other[3]}")
                break
        log(f"first difference: {note}")
        self.tables["preflight"].add(comfyui=self.comfyui, name=f"first_difference_{self.step}", value="",
                                     unit="", note=note[:600])


# ----------------------------------------------------------------------------------------------- the ComfyUI steps
def make_harness(args, state, tables, inference_mode: bool = True, blocks=None, load=None) -> GpuHarness:
    config = BenchConfig(preset=args.preset, device="cpu" if args.dry_run else "cuda", steps=args.steps,
                         blocks=blocks, budgets=(), plot=False, inference_mode=inference_mode)
    h = GpuHarness(config, tables, step=args.step_name, gbps=state.load("preflight").get("gbps", 0.0), load=load)
    h.setup()
    return h


def sidebyside(args, tables, state) -> int:
    h = make_harness(args, state, tables)
    try:
        h.full(per_block=True, state=state)
        budgets = h.budgets_for(args.budgets)
        for label, budget in budgets:
            if args.lowvram:
                h.comfy_lowvram(label, budget)
            h.layerwise(-1, 1, AUTO_POLICY, label, budget, mode="layerwise_auto")  # the node's defaults
            if args.weights:  # the fewest bytes a step at this budget, and what it costs against auto and ComfyUI
                h.layerwise(-1, 1, WEIGHTS_POLICY, label, budget, mode="layerwise_weights")
        if args.sweep:  # the whole device: every count fits, whatever the budgets allow
            for resident in sweep_counts(len(h.block_nbytes)):
                h.layerwise(resident, 1, AUTO_POLICY, "device", None, mode="sweep", ballast=False, timeline=True)
        state.save(f"{h.comfyui}_{h.config.preset}_auto", h.auto_ms)
    finally:
        h.teardown()
    return 0


def lora(args, tables, state) -> int:
    h = make_harness(args, state, tables, blocks=None if args.dry_run else (4,))
    try:
        base = h.patcher
        h.full()
        h.patcher = with_lora(base, block_lora(base, rank=16))
        h.full(mode="full_lora")
        if torch.equal(h.references["full"], h.references["full_lora"]):
            raise RuntimeError("[layerwise-offload] the LoRA changed nothing: the LoRA rows would compare nothing")
        h.layerwise(0, 1, "leading", "", 0, mode="layerwise_lora", ballast=False)
        h.patcher, h.reference, h.compute_ms = base, h.references["full"], h.computes["full"]
        h.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False)
    finally:
        h.teardown()
    return 0


def fp8(args, tables, state) -> int:
    """bf16 and ComfyUI's fp8 mixed precision (QuantizedTensor; comfy-kitchen's kernels on 0.33.0): bytes streamed
    and step time, each against its own full load. Outside inference_mode: QuantizedTensor weights fail under it."""
    import tempfile
    from ..devtools.quantized_models import save_fp8_mixed
    blocks = None if args.dry_run else (4,)
    h = make_harness(args, state, tables, inference_mode=False, blocks=blocks)
    with tempfile.TemporaryDirectory(prefix="lwo_fp8_", dir=args.work) as tmp:
        try:
            sd = {k: v.detach().to("cpu", copy=True) for k, v in h.diffusion_model.state_dict().items()}
            h.full()
            h.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False)
        finally:
            h.teardown()
        path = save_fp8_mixed(sd, Path(tmp) / "fp8_mixed.safetensors", "gpu run fp8")
        del sd, h
        gc.collect()
        import comfy.sd
        q = make_harness(args, state, tables, inference_mode=False, blocks=blocks,
                         load=lambda: comfy.sd.load_diffusion_model(path))
        try:
            q.full(weights="fp8_mixed")
            q.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False, weights="fp8_mixed")
        finally:
            q.teardown()
    return 0


# ----------------------------------------------------------------------------------------------- dynamic VRAM
def aimdo_init(control) -> None:
    """main.py's first half (0.33.0): load aimdo's library before anything initialises CUDA, with main.py's
    arguments where this aimdo takes them (no --reserve-vram; NVML pressure unless --disable-nvml-pressure)."""
    try:
        started = control.init(simple_vram_headroom=None, nvml_pressure=True)
    except TypeError:  # comfy-aimdo 0.4.9's protocol, as main.py falls back to
        started = control.init()
    if not started:
        raise RuntimeError("comfy_aimdo.control.init() failed: aimdo's library does not load here")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ""  # cuda_malloc.py: aimdo and cudaMallocAsync exclude each other


def aimdo_init_device(control, index: int) -> None:
    """main.py's second half: aimdo takes the device (False, and every dynamic row fails, without init() first)."""
    try:
        taken = control.init_devices([(index, 0)])  # (device, --vram-headroom 0 GiB)
    except TypeError:
        taken = control.init_devices([index])
    if not taken:
        raise RuntimeError(f"comfy_aimdo.control.init_devices([{index}]) failed after init()")


def start_dynamic_vram(control, index: int) -> str:
    """aimdo started as ComfyUI 0.33.0 starts it. ``control`` is ``comfy_aimdo.control`` (a parameter: the order is
    checked without a GPU, tests/comfy/test_gpu_plan.py)."""
    aimdo_init(control)
    aimdo_init_device(control, index)
    return f"init() and init_devices([{index}]) ok"


def _import_dynamic(dry_run: bool):
    """ComfyUI 0.33.0 started as its main.py starts it on NVIDIA, where dynamic VRAM is the default: aimdo's
    library loaded (``init()``) before CUDA, then given the device, ``ModelPatcherDynamic`` made the
    ``CoreModelPatcher`` and ``comfy.memory_management.aimdo_enabled`` turned on."""
    comfy_dir = comfy_env.comfyui_path()
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    if not hasattr(comfy.cli_args, "enables_dynamic_vram"):
        raise RuntimeError(f"[layerwise-offload] the ComfyUI at {comfy_dir} has no default dynamic VRAM: the dynamic "
                           "step measures 0.33.0's (COMFYUI_PATH)")
    import comfy_aimdo.control
    aimdo_init(comfy_aimdo.control)  # before comfy.model_management, whose import initialises CUDA
    started = "init() ok; init_devices() needs a GPU (dry run)"
    env = comfy_env.import_comfyui(cpu=dry_run, import_nodes=False)
    gc.freeze()  # as main() does for the other steps: the collections between runs then skip what the import made
    if not dry_run:
        import comfy.memory_management
        index = env.model_management.get_torch_device().index or 0
        aimdo_init_device(comfy_aimdo.control, index)
        started = f"init() and init_devices([{index}]) ok"
        env.model_patcher.CoreModelPatcher = env.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    return env, started


@contextlib.contextmanager
def _node_scope():
    """execution.py's per-node scope (0.33.0): after the node, the cast buffers, the prefetch queues and the VBAR
    watermark limits reset."""
    import comfy.memory_management
    try:
        yield
    finally:
        if comfy.memory_management.aimdo_enabled:
            import comfy.model_management
            import comfy.model_prefetch
            import comfy_aimdo.model_vbar
            comfy.model_management.reset_cast_buffers()
            comfy.model_prefetch.cleanup_prefetch_queues()
            comfy_aimdo.model_vbar.vbars_reset_watermark_limits()


class VbarCastCounter:
    """The bytes ComfyUI 0.33's dynamic VRAM really moves. A module with VBAR pages (``_v``) is readied by
    ``comfy.ops.cast_modules_with_vbar`` (per module at its cast, or a block's modules at once where a model
    prefetches blocks): where aimdo's fault returns the signature the module was last cast with, its pages are still
    resident and nothing moves (``_prefetch["resident"]``); otherwise its weight and bias (aligned, as the copy
    moves them) and any LowVramPatch are copied. Those are counted in ``bytes``, the resident ones in
    ``resident_bytes``. Modules without VBAR pages are cast the classic way and counted as ``measure.CastCounter``
    counts them (a module on another device, or left lowvram). Both functions are looked up in ``comfy.ops`` at call
    time, so replacing them there sees every cast."""

    def __init__(self):
        self.bytes = 0
        self.resident_bytes = 0

    @staticmethod
    def _module_bytes(module) -> int:
        try:
            from comfy.memory_management import vram_aligned_size as aligned  # 0.33: the size the copy moves
        except ImportError:  # a ComfyUI without VBARs (0.3.75): what a test's stand-in moved
            aligned = None
        tensors = [module.weight, getattr(module, "bias", None)]
        if aligned is not None:
            return int(aligned(tensors))
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @contextlib.contextmanager
    def installed(self):
        import comfy.ops

        vbar_cast = getattr(comfy.ops, "cast_modules_with_vbar", None)
        classic_cast = comfy.ops.cast_bias_weight

        def counting_vbar(comfy_modules, *args, **kwargs):
            out = vbar_cast(comfy_modules, *args, **kwargs)
            for module in comfy_modules:
                if (getattr(module, "_prefetch", None) or {}).get("resident"):
                    self.resident_bytes += self._module_bytes(module)
                    continue
                self.bytes += self._module_bytes(module)
                for key in ("weight", "bias"):
                    patch = getattr(module, key + "_lowvram_function", None)
                    if patch is not None:
                        self.bytes += int(patch.memory_required())
            return out

        def counting_classic(s, input=None, dtype=None, device=None, *args, **kwargs):
            if not hasattr(s, "_v"):  # a VBAR module is counted by counting_vbar, whatever its weight's device
                target = device if device is not None else (input.device if input is not None else None)
                weight = getattr(s, "weight", None)
                if hasattr(s, "prev_comfy_cast_weights") or (
                        weight is not None and target is not None and weight.device != torch.device(target)):
                    self.bytes += tensor_nbytes(weight) + tensor_nbytes(getattr(s, "bias", None))
            return classic_cast(s, input, dtype, device, *args, **kwargs)

        comfy.ops.cast_bias_weight = counting_classic
        if vbar_cast is not None:
            comfy.ops.cast_modules_with_vbar = counting_vbar
        try:
            yield self
        finally:
            comfy.ops.cast_bias_weight = classic_cast
            if vbar_cast is not None:
                comfy.ops.cast_modules_with_vbar = vbar_cast


def dynamic(args, tables, state) -> int:
    """ComfyUI 0.33.0's dynamic VRAM at the budgets and against the reference the 0.33.0 side-by-side step left."""
    log(f"comfy-aimdo init() before torch was imported: {AIMDO_BEFORE_TORCH}")
    env, started = _import_dynamic(args.dry_run)
    log(f"comfy-aimdo: {started}")
    mm = env.model_management
    from ..devtools import dit_presets
    version = comfyui_version()
    saved = state.load(f"{version}_{args.preset}")
    if not saved:
        raise RuntimeError(f"[layerwise-offload] no {version}_{args.preset} in {state.folder}: the {version} "
                           "side-by-side step gives the reference and budgets; run it first")
    reference = torch.load(saved["reference"])
    auto_ms = state.load(f"{version}_{args.preset}_auto")  # this pack at auto, same budgets, same reference
    cuda = not args.dry_run
    device = mm.get_torch_device()
    dtype = torch.float32 if args.dry_run else None  # the side-by-side harness builds fp32 on the CPU too
    patcher = dit_presets.build(args.preset, dtype=dtype, patcher_class=env.model_patcher.CoreModelPatcher)
    kind = type(patcher).__name__
    extra = saved["act_reserve"] + (HEADROOM if cuda else 0)
    budgets = [("all", None)] + [(f"{float(f):g}", int(saved["non_block"] + float(f) * saved["block_total"] + extra))
                                 for f in args.budgets.split(",") if f.strip()]
    forwards = [0]

    def count_forwards(model):
        return model.get_model_object("diffusion_model").register_forward_pre_hook(
            lambda m, a: forwards.__setitem__(0, forwards[0] + 1))

    def row(mode: str, label: str, budget, run_patcher, moved: Callable[[], Tuple[int, int]], scope) -> None:
        """One sampling run at ``budget``: ``moved()`` reads (bytes streamed, bytes left resident) so far."""
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache()
        begun, error, seconds, snap = time.perf_counter(), "", [], {}
        clock = StepClock(cuda, on_first=lambda: snap.update(zip("fbr", (forwards[0], *moved()))))
        out = None
        with Ballast(device, budget) as ballast, DevicePeak(device) as peak:
            try:
                with _node_scope(), scope(), torch.inference_mode():
                    out = dit_presets.sample(run_patcher, args.preset, steps=args.steps, callback=clock)
                seconds = clock.step_seconds()
            except Exception as exc:  # noqa: BLE001 - a failing budget is a result
                import traceback
                traceback.print_exc()
                error = f"{type(exc).__name__}: {exc}"[:300]
        step_ms = 1e3 * sorted(seconds)[len(seconds) // 2] if seconds else ""
        intervals = max(1, args.steps - 1)
        streamed, resident = moved()
        add_step(
            tables["steps"], comfyui=version, step=args.step_name, preset=args.preset, mode=mode,
            weights=str(dtype or dit_presets.PRESETS[args.preset].dtype).replace("torch.", ""), budget=label,
            budget_bytes="" if budget is None else budget, ballast_bytes=ballast.nbytes,
            num_blocks=saved["num_blocks"], steps=args.steps,
            forwards_per_step=(forwards[0] - snap["f"]) / intervals if seconds else "",
            step_ms=step_ms, step_ms_spread=(max(seconds) - min(seconds)) * 1e3 if seconds else "",
            streamed_bytes_per_step=(streamed - snap["b"]) / intervals if seconds else "",
            resident_bytes_per_step=(resident - snap["r"]) / intervals if seconds else "",
            compute_ms=saved["compute_ms"], gbps=saved["gbps"],
            speedup_vs_comfy=ratio(step_ms, auto_ms.get(label)) if mode == "comfy_dynamic" else "",
            device_peak_bytes=peak.peak_bytes, weights_device_bytes=run_patcher.loaded_size(),
            bitwise_equal_full=bitwise_equal(out, reference) if out is not None else False,
            seconds=time.perf_counter() - begun, error=error or ("" if cuda else f"dry run: {kind} on the CPU"))
        log(f"{args.preset} {mode} budget {label}: {step_ms} ms/step {error}")

    hook = count_forwards(patcher)
    try:
        for label, budget in budgets:
            counter = VbarCastCounter()
            row("comfy_dynamic", label, budget, patcher, lambda: (counter.bytes, counter.resident_bytes),
                counter.installed)
        if args.takeover:
            takeover(args, patcher, budgets[-1], env, dtype, row, count_forwards)
    finally:
        hook.remove()
        mm.unload_all_models()
    return 0


def takeover(args, patcher, budget, env, dtype, row, count_forwards) -> None:
    """The node on the dynamic patcher, with comfy-aimdo started: it takes the model over as an ordinary model
    (``get_non_dynamic_delegate``, which reloads it through ``cached_patcher_init`` as a core loader's model is), and
    every device byte it allocates goes through aimdo's allocator hooks. The row's speed-up is over dynamic VRAM at
    the same budget."""
    from ..devtools import dit_presets
    from ..nodes.controller import offload_model
    if args.dry_run:
        os.environ[CPU_LOOPBACK_ENV] = "1"

    def reload(disable_dynamic=False):  # the preset is seeded: the same weights as the model it replaces
        kind = env.model_patcher.ModelPatcher if disable_dynamic else env.model_patcher.CoreModelPatcher
        return dit_presets.build(args.preset, dtype=dtype, patcher_class=kind)
    patcher.cached_patcher_init = (reload, ())
    label, nbytes = budget
    offloaded = offload_model(patcher, -1, 1, AUTO_POLICY, True)
    controller = offloaded.attachments.get("layerwise_offload")
    if controller is None:
        raise RuntimeError(f"[layerwise-offload] the node passed the dynamic model through: "
                           f"{offloaded.attachments}")

    def moved():
        stats = controller.manager.stats(synchronize=False)
        return stats.bytes_copied, 0
    hook = count_forwards(offloaded)
    try:
        row("layerwise_aimdo", label, nbytes, offloaded, moved, contextlib.nullcontext)
    finally:
        hook.remove()


def smoke(args, tables, state) -> int:
    """The engine's CUDA path on the tiny preset, a few settings, each bitwise against the full load. gpu_run.sh runs
    it under ``TORCH_CUDA_SANITIZER=1``: torch's stream sanitizer then checks every kernel's reads and writes against
    the streams' events and synchronisations, and a race fails the row."""
    sanitizer = getattr(getattr(torch.cuda, "_sanitizer", None), "cuda_sanitizer", None)
    enabled = bool(getattr(sanitizer, "enabled", False))
    tables["preflight"].add(comfyui="none", name="smoke_cuda_sanitizer", value=enabled, unit="",
                            note=f"TORCH_CUDA_SANITIZER={os.environ.get('TORCH_CUDA_SANITIZER', '')!r}")
    h = make_harness(args, state, tables)
    try:
        h.full()
        for resident, prefetch, policy in ((0, 1, "leading"), (1, 2, "strided"), (-1, 1, AUTO_POLICY)):
            h.layerwise(resident, prefetch, policy, "device", None, mode="smoke", ballast=False)
    finally:
        h.teardown()
    return 0


STEPS = {"preflight": preflight, "smoke": smoke, "sidebyside": sidebyside, "lora": lora, "fp8": fp8,
         "dynamic": dynamic}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--out", required=True, help="folder of the CSVs (rows appended as measured)")
    parser.add_argument("--work", required=True, help="scratch folder; <work>/state links the steps")
    parser.add_argument("--preset", default="flux")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps per run (>= 3; step 1 is warm-up)")
    parser.add_argument("--budgets", default="0.6,0.3", help="fractions of the blocks' bytes (largest first)")
    parser.add_argument("--lowvram", action="store_true", help="also ComfyUI's own partial loading per budget")
    parser.add_argument("--sweep", action="store_true", help="also fixed resident counts at the smallest budget")
    parser.add_argument("--weights", action="store_true", help="also residency_policy weights per budget")
    parser.add_argument("--takeover", action="store_true",
                        help="dynamic: also the node taking the dynamic model over, at the smallest budget")
    parser.add_argument("--name", default="", help="the step's name in the CSVs (default: the step)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.step_name = args.name or args.step
    if args.dry_run:
        args.preset = DRY_PRESETS.get(args.preset, args.preset)
        args.steps = 3
        args.budgets = args.budgets.split(",")[-1]  # one budget walks the same code as two, in half the time
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tables = {name: Table(Path(args.out), name) for name in TABLES}  # every header exists from the first step on
    state = State(Path(args.work))
    started = time.perf_counter()
    if args.step not in ("preflight", "dynamic"):
        comfy_env.import_comfyui(cpu=args.dry_run, import_nodes=False)
        # ComfyUI's import leaves millions of objects that live as long as the step; frozen, the full collection
        # between modes (Harness._fresh) skips them: 0.45 s -> a few ms each, 15 times a step.
        gc.freeze()
    if args.dry_run and args.step != "dynamic":
        os.environ[CPU_LOOPBACK_ENV] = "1"  # the node's real path on the CPU
    status = STEPS[args.step](args, tables, state)
    log(f"{'dry run: ' if args.dry_run else ''}step {args.step_name} ({args.step}, {args.preset}, ComfyUI "
        f"{comfyui_version()}) done in {time.perf_counter() - started:.1f} s, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
