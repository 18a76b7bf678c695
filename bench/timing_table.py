"""The timing model's table: predicted step time vs the bound for every template, resident count, policy and
prefetch depth on four reference GPUs (offload/timing/ predicts; the .md it writes says how and on what).

    .venv/bin/python -P bench/timing_table.py              # -> bench/results/timing_model.{csv,md,png}
    .venv/bin/python -P bench/timing_table.py --out /tmp/x --templates flux1_dev --gpus "RTX 4090 24GB"
    .venv/bin/python -P bench/timing_table.py --replay     # also choose by replaying the real manager: agreement

Per template (devtools/template_memory.py's list, block bytes from devtools/template_plans.json), FLOPs per block
are COUNTED, not derived: ComfyUI's own class at the released dimensions, one block per block list
(dit_families.py), runs one forward on the ``meta`` device at the template's latent and batch under
``FlopCounterMode`` (matmuls, convolutions), attention replaced by meta_forward.py's flash-like stand-in plus
the flash kernel's own count (``4 x batch x heads x query tokens x key tokens x head dim``). Element-wise work is
the part of ``DIT_EFFICIENCY`` that is not matmul. The shape-only rule of thumb (:func:`shape_estimate`) counts
the modulation linears at every token and the text stream's linears at the image's tokens, so it overestimates
double-stream blocks up to 2.6x: whoever feeds the engine FLOPs should count. fp8 and GGUF weights are cast to
bf16 every forward (``stored + 2 x weights`` bytes of device-memory traffic); LoRA rows apply ComfyUI's float32
LoRA math on a stream of its own (about 28 bytes of traffic per weight) at every streamed copy.

Rows: every resident count 0..N, every setting of ``offload.timing.choice.SETTINGS`` (leading and strided at prefetch 1-4,
leading at 6, 8, 12, 16; LoRA rows prefetch 1). ``fits``: the plan
(residents + slots + non-block weights + activations + ComfyUI's reserve + 0.5 GiB context) fits the card;
``auto``: the count the planner picks there. ``--replay``: auto's choice made again by replaying the real
manager (bench/timing_replay.py), the agreement and the host seconds of each in the .md.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Dict, List

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

from .measure import RESULTS  # noqa: E402
from ..devtools import template_memory  # noqa: E402
from ..offload import choose_resident_blocks, footprint, planner  # noqa: E402
from ..offload.timing import costs as tm  # noqa: E402
from ..offload.timing.choice import SETTINGS, choose_plan  # noqa: E402
from ..offload.timing.step import predict  # noqa: E402
from . import timing_replay  # noqa: E402
from .template_costs import TemplateCosts, template_costs  # noqa: E402
from .timing_report import plot, write_markdown  # noqa: E402

FIELDS = ("GPU", "template", "resident_count", "policy", "chosen", "prefetch", "predicted_step_ms", "bound_ms", "ratio",
          "copy_idle_ms", "compute_stall_ms", "compute_ms", "copy_ms", "host_ms", "lora", "fits", "auto",
          "device_gib")
def auto_resident(tc: TemplateCosts, gpu, plans) -> int:
    """The count the planner picks on this card, fed as devtools/template_memory.py feeds it."""
    free = gpu.vram_bytes - plans["context_and_desktop_bytes"] - tc.non_block_bytes
    plan = planner.plan_residency(list(tc.costs.block_bytes), max(free, 0), reserve_bytes=plans["comfy_reserve_bytes"],
                                  activation_bytes=tc.activation_bytes, prefetch_size=tc.prefetch)
    return plan.resident_count if plan.fits else -1


def rows_for(tc: TemplateCosts, gpu, plans, check=None) -> List[dict]:
    n = tc.costs.num_blocks
    auto = auto_resident(tc, gpu, plans)
    fixed = plans["context_and_desktop_bytes"] + plans["comfy_reserve_bytes"] + tc.non_block_bytes + tc.activation_bytes
    rows = []
    for r in range(n + 1):
        variants = [(s, False) for s in SETTINGS] + [((p, 1), True) for p in ("leading", "strided")]
        # residency_policy auto, as the node runs it: the fastest predicted setting among those that fit the card.
        fitting = [(policy, prefetch, r) for policy, prefetch in SETTINGS
                   if footprint(tc.costs.block_bytes, choose_resident_blocks(n, r, policy), prefetch).total
                   + fixed <= gpu.vram_bytes]
        candidates = fitting or [(policy, prefetch, r) for policy, prefetch in SETTINGS]
        choice = choose_plan(tc.costs, gpu, candidates)
        if check is not None:
            check.compare(tc, gpu, r, candidates, choice)
        variants.append((("auto", choice.prefetch), False))
        for (policy, prefetch), lora in variants:
            costs = tc.lora_costs if lora else tc.costs
            chosen = choice.policy if policy == "auto" else policy
            p = choice.prediction if policy == "auto" else predict(costs, gpu, r, policy, prefetch)
            device = footprint(costs.block_bytes, choose_resident_blocks(n, r, chosen), prefetch).total + fixed
            rows.append(dict(GPU=gpu.name, template=tc.key, resident_count=r, policy=policy, chosen=chosen,
                             prefetch=prefetch,
                             predicted_step_ms=round(p.step_s * 1e3, 2), bound_ms=round(p.bound_s * 1e3, 2),
                             ratio=round(p.ratio, 4), copy_idle_ms=round(p.copy_idle_s * 1e3, 2),
                             compute_stall_ms=round(p.compute_stall_s * 1e3, 2), compute_ms=round(p.compute_s * 1e3, 2),
                             copy_ms=round(p.copy_s * 1e3, 2), host_ms=round(p.host_s * 1e3, 2), lora=int(lora),
                             fits=int(device <= gpu.vram_bytes), auto=int(r == auto),
                             device_gib=round(device / 2 ** 30, 2)))
    return rows


class ReplayCheck:
    """Auto's choice at every (GPU, template, r) made twice, by the product's model and by replaying the real manager
    (bench/timing_replay.py), and the host seconds of each planning: the replay on the first card as in a fresh
    process (no recording kept), on the others with the first card's recordings (their timing alone)."""

    def __init__(self, cold_gpu: str):
        self.cold_gpu = cold_gpu
        self.plans = 0
        self.differing: List[str] = []
        self.seconds: Dict[str, List[float]] = {"model": [], "replay kept": [], "replay cold": []}

    def compare(self, tc: TemplateCosts, gpu, r: int, candidates, choice) -> None:
        cold = gpu.name == self.cold_gpu
        started = time.perf_counter()
        choose_plan(tc.costs, gpu, candidates)
        self.seconds["model"].append(time.perf_counter() - started)
        if cold:
            timing_replay.clear_recordings()
        started = time.perf_counter()
        replayed = choose_plan(tc.costs, gpu, candidates, model=timing_replay.predict)
        self.seconds["replay cold" if cold else "replay kept"].append(time.perf_counter() - started)
        self.plans += 1
        if (replayed.policy, replayed.prefetch) != (choice.policy, choice.prefetch):
            self.differing.append(f"| {gpu.name} | {tc.key} | {r} | {choice.policy} {choice.prefetch} "
                                  f"({choice.prediction.ratio:.3f}) | {replayed.policy} {replayed.prefetch} "
                                  f"({replayed.prediction.ratio:.3f}) |")

    def lines(self) -> List[str]:
        def per_planning(key):
            times = sorted(self.seconds[key])
            return (f"{sum(times) / len(times):.4f} s mean, {times[len(times) // 2]:.4f} median, {times[-1]:.4f} max "
                    f"over {len(times)}") if times else "not measured"
        out = ["", "## The replay check", "",
               f"Auto's setting chosen by the model and by replaying the real manager (`bench/timing_replay.py`): "
               f"{self.plans - len(self.differing)} of {self.plans} plans agree.", "",
               "Host seconds per planning (`choose_plan` over the candidates, this machine): "
               f"the model {per_planning('model')}; the replay in a fresh process (recording every candidate's "
               f"schedule) {per_planning('replay cold')}; the replay with the schedules recorded before "
               f"{per_planning('replay kept')}."]
        if self.differing:
            out += ["", "| GPU | template | r | model (ratio) | replay (ratio) |", "| --- | --- | --- | --- | --- |",
                    *self.differing]
        return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS), help="folder for timing_model.csv / .md / .png")
    parser.add_argument("--templates", default="", help="comma-separated template keys (default: all)")
    parser.add_argument("--gpus", default="", help="comma-separated GPU names from offload.timing.costs.GPUS")
    parser.add_argument("--replay", action="store_true",
                        help="also choose auto's setting by replaying the real manager, and report the agreement")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    templates = template_costs([k for k in args.templates.split(",") if k] or None)
    names = [g for g in args.gpus.split(",") if g] or list(tm.GPUS)
    gpus = [tm.GPUS[g] for g in names]
    plans = template_memory.load_plans()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: List[dict] = []
    check = ReplayCheck(gpus[0].name) if args.replay else None
    for tc in templates:
        for g in gpus:
            rows += rows_for(tc, g, plans, check)
        print(f"[timing_table] {tc.key}: {len(rows)} rows, {time.perf_counter() - started:.0f} s", flush=True)
    with open(out / "timing_model.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, templates, gpus, out / "timing_model.md", check)
    plot(rows, templates, gpus, out / "timing_model.png")
    print(f"[timing_table] {len(rows)} rows in {time.perf_counter() - started:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
