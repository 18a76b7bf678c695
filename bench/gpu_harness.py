"""The GPU run's harness (bench/gpu_steps.py runs it): comfy_bench's side-by-side harness measured at physically
equal VRAM (a ``Ballast`` per run), with device-level peaks, per-block CUDA-event timings, the timing model's
prediction beside each run of the pack and one ``steps`` row appended per run (bench/gpu_tables.py)."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .harness import BenchConfig, Harness
from .measure import comfyui_version, copy_seconds, elapsed, mark
from .gpu_tables import Ballast, DevicePeak, add_step, ratio

AUTO_POLICY = "auto"  # the node's residency_policy default (nodes/offload_node.py; not imported: ComfyUI comes later)
WEIGHTS_POLICY = "weights"  # the node's weight-by-weight plan (the fewest bytes a step at a budget)
HEADROOM = 3 << 29  # 1.5 GiB: ComfyUI keeps minimum_inference_memory + reserved VRAM free on top of its estimate


def log(*parts) -> None:
    print("[gpu_steps]", *parts, flush=True)


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


def make_harness(args, state, tables, inference_mode: bool = True, blocks=None, load=None) -> GpuHarness:
    config = BenchConfig(preset=args.preset, device="cpu" if args.dry_run else "cuda", steps=args.steps,
                         blocks=blocks, budgets=(), plot=False, inference_mode=inference_mode)
    h = GpuHarness(config, tables, step=args.step_name, gbps=state.load("preflight").get("gbps", 0.0), load=load)
    h.setup()
    return h
