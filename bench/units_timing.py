"""Streaming weight by weight, timed by the timing model: does the plan over weight units (``offload/units.py``) that
moves fewer bytes than ComfyUI's own partial loading (bench/g5_bytes.py) still reach the bound max(compute, streamed
bytes / H2D), and at which prefetch depth?

    COMFYUI_PATH=$PWD/.comfyui/ComfyUI .venv/bin/python -P bench/units_timing.py --out bench/results

For every template of bench/timing_table.py (ComfyUI's own classes, one block per block list, on the meta device at
the template's latent and batch), the blocks' weight units are hooked and the FLOPs are counted per *segment*: from
a unit's pre-hook to the next unit's (attention and element-wise work after a unit belong to it, which is when the
next unit's copy overlaps them; work in a block before its first unit is charged to that unit, which waits for its
copy: pessimistic). The full model repeats each block's units in the order its forward called them. At each G5
budget (0.3/0.5/0.7/0.9 of the weights, the non-unit weights placed first) the engine's plan over these units
(``plan_weight_units``) at prefetch 1, 2, 4 and 8 is timed on the four reference cards by the timing model (the real
manager's schedule, replayed with durations). Host costs per streamed unit are the per-block ones of
``offload/gpu_costs.py`` times the unit-to-block ratio measured per weight format in one run of bench/host_time.py
(``bench/results/host_time_units.csv``: phase ``units`` over phase ``blocks``, 0.4-0.9: the hooks cost about as much
as the re-pointing of a block's 30 parameters); kernel launches are a block's spread over its units
plus 20 us for the two hooks. ``g5_over_comfy``: the plan's bytes per step over ComfyUI 0.3.75's at the same budget
(bench/results/g5_bytes_per_step.csv). Writes ``units_timing.csv``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from ..devtools import comfy_env  # noqa: E402
from ..offload import plan_streamed_tails, plan_weight_units, weight_units  # noqa: E402

HOST_TIME_UNITS = Path(__file__).resolve().parent / "results" / "host_time_units.csv"


def unit_host_ratios(path: Path = HOST_TIME_UNITS) -> dict:
    """Per weight format, a streamed unit's host time over a streamed block's, both measured in the same run."""
    with path.open(newline="") as f:
        rows = {(r["format"], r["phase"]): float(r["ms_per_block"]) for r in csv.DictReader(f)}
    return {fmt: rows[(fmt, "units")] / rows[(fmt, "blocks")] for fmt, phase in rows if phase == "blocks"}


UNIT_HOST_RATIO = unit_host_ratios()
from ..offload import timing_model as tm  # noqa: E402
from ..offload.host.packing import block_parameters, plan_layout  # noqa: E402
from .activation_memory import FAMILIES, block_lists, meta_forward  # noqa: E402
from .g5_bytes import FRACTIONS, block_geometry  # noqa: E402
from .timing_table import FAMILY_OF_CONFIG, HOST_FORMAT, counted_attention  # noqa: E402

PREFETCHES = (1, 2, 4, 8)
HOOKS_S_PER_UNIT = 20e-6  # a unit's pre- and post-hook from Python
FIELDS = ("GPU", "template", "budget_fraction", "prefetch", "units", "streamed_bytes", "slot_bytes", "ratio",
          "predicted_step_ms", "bound_ms", "compute_stall_ms", "copy_idle_ms", "g5_over_comfy",
          "block_tails_ratio", "block_tails_g5_over_comfy")


def unit_segments(spec, latent, batch: int):
    """Per block of the one-block-per-list model: its units in the order its forward called them, and each one's
    segment FLOPs; and the FLOPs outside every block."""
    attention_flops = [0.0]
    attention = counted_attention([], attention_flops)
    counter = FlopCounterMode(display=False)

    def total():
        return counter.get_total_flops() + attention_flops[0]

    model = spec.build(torch.bfloat16).eval()
    blocks = block_lists(model)
    units = weight_units(blocks)
    order = {i: [] for i in range(len(blocks))}  # block -> [(unit, flops at its pre-hook)]
    ends = {}
    handles = [unit.register_forward_pre_hook(lambda m, a, u=u, b=b: order[b].append((u, total())))
               for u, (unit, b) in enumerate(zip(units.units, units.block_of))]
    in_blocks = [0.0]
    starts = {}
    try:
        meta_forward(model, spec, latent, batch, torch.bfloat16, attention, counter,
                     lambda i: starts.__setitem__(i, total()),
                     lambda i: ends.__setitem__(i, total()))
    finally:
        for handle in handles:
            handle.remove()
    per_block = []
    for b in range(len(blocks)):
        seen = order[b]
        marks = [starts[b]] + [flops for _, flops in seen[1:]] + [ends[b]]
        segments = [marks[k + 1] - marks[k] for k in range(len(seen))]
        layouts = [plan_layout(block_parameters(units.units[u])) for u, _ in seen]
        per_block.append(([layout.nbytes for layout in layouts], [layout.tail_sizes for layout in layouts],
                          segments))
        in_blocks[0] += ends[b] - starts[b]
    return per_block, total() - in_blocks[0], units.left_out_nbytes(), model


def comfy_bytes(results: Path):
    path = results / "g5_bytes_per_step.csv"
    if not path.exists():
        return {}
    with open(path) as f:
        return {(r["template"], float(r["budget_fraction"])): int(r["comfy_lowvram_bytes_per_step"])
                for r in csv.DictReader(f)}


def rows(keys=None, gpus=None, prefetches=PREFETCHES, results: Path = Path(__file__).parent / "results"):
    comfy_env.import_comfyui(cpu=True, import_nodes=False)
    from .g5_bytes import templates
    comfy = comfy_bytes(results)
    out = []
    gpus = gpus or list(tm.GPUS)
    for t, weights_bf16, scale in templates(keys):
        spec = FAMILIES[FAMILY_OF_CONFIG[t.comfy_config]]
        per_kind, outside, _, model = unit_segments(spec, tuple(t.latent[1:]), t.cfg_batch)
        counts = ((t.unet_config["depth"], t.unet_config["depth_single_blocks"]) if len(per_kind) == 2
                  else (t.unet_config["num_layers"],))
        sizes, options, flops = [], [], []
        for (kind_sizes, kind_options, kind_flops), count in zip(per_kind, counts):
            for _ in range(count):
                sizes += kind_sizes
                options += kind_options
                flops += kind_flops
        total_weights = sum(p.numel() * p.element_size() for p in _full_model_params(t))
        rest = total_weights - sum(sizes)
        host_format = HOST_FORMAT.get(t.key, "bf16")
        host = tm.HOST_S_PER_STREAMED_BLOCK_BY_FORMAT[host_format] * UNIT_HOST_RATIO[host_format]
        launch = tm.LAUNCH_S_PER_BLOCK * len(per_kind) / sum(len(k[0]) for k in per_kind) + HOOKS_S_PER_UNIT
        scaled = [int(s * scale) for s in sizes]
        cast = None
        if t.stored_bytes != 2:
            cast = tuple(int(b + 2 * b / t.stored_bytes) for b in scaled)
        costs = tm.ModelCosts(tuple(scaled), tuple(flops), outside_flops=outside, cast_bytes=cast,
                              host_s_per_streamed_block=host, launch_s_per_block=launch)
        del model
        # The same budget with whole-block tails (the node's streamed-tails plan), at the same prefetch depth: each
        # block's FLOPs are its units' segments
        block_sizes, block_options, non_block = block_geometry(t)
        block_flops = [sum(kind[2]) for kind, count in zip(per_kind, counts) for _ in range(count)]
        block_costs = tm.ModelCosts(tuple(int(s * scale) for s in block_sizes), tuple(block_flops),
                                    outside_flops=outside, host_s_per_streamed_block=host,
                                    cast_bytes=None if cast is None else tuple(
                                        int(b * scale * (1 + 2 / t.stored_bytes)) for b in block_sizes))
        for fraction in FRACTIONS:
            budget = int(weights_bf16 * fraction)
            for prefetch in prefetches:
                tails_plan = plan_streamed_tails(block_sizes, block_options, budget - non_block,
                                                 prefetch_size=prefetch)
                plan = plan_weight_units(sizes, options, budget - rest, prefetch_size=prefetch)
                if plan is None:
                    continue
                tails = [int(tail * scale) for tail in plan.tails]
                streamed = int(plan.streamed_bytes * scale)
                reference = comfy.get((t.key, fraction))
                for name in gpus:
                    p = tm.predict(costs, tm.GPUS[name], plan.resident_count, "leading", prefetch, tails=tails)
                    block = None if tails_plan is None else tm.predict(
                        block_costs, tm.GPUS[name], 0, "leading", prefetch,
                        tails=[int(tail * scale) for tail in tails_plan.tails])
                    out.append(dict(
                        GPU=name, template=t.key, budget_fraction=fraction, prefetch=prefetch, units=len(sizes),
                        streamed_bytes=streamed, slot_bytes=int(plan.slot_bytes * scale), ratio=round(p.ratio, 4),
                        predicted_step_ms=round(p.step_s * 1e3, 2), bound_ms=round(p.bound_s * 1e3, 2),
                        compute_stall_ms=round(p.compute_stall_s * 1e3, 2),
                        copy_idle_ms=round(p.copy_idle_s * 1e3, 2),
                        g5_over_comfy=round(streamed / reference, 4) if reference else "",
                        block_tails_ratio="" if block is None else round(block.ratio, 4),
                        block_tails_g5_over_comfy="" if block is None or not reference else round(
                            tails_plan.streamed_bytes * scale / reference, 4)))
    return out


def _full_model_params(template):
    from .g5_bytes import meta_patcher
    return list(meta_patcher(template).model.diffusion_model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write units_timing.csv into this folder")
    ap.add_argument("--templates", nargs="*")
    ap.add_argument("--gpus", nargs="*")
    args = ap.parse_args(argv)
    table = rows(args.templates, args.gpus)
    best = {}
    for r in table:
        key = (r["GPU"], r["template"], r["budget_fraction"])
        if r["ratio"] <= 1.05 and key not in best:
            best[key] = r
    print(f"{'GPU':16} {'template':20} {'B':>4} {'prefetch':>8} {'ratio':>6} {'G5':>7} {'tails':>6}")
    for key in sorted({(r["GPU"], r["template"], r["budget_fraction"]) for r in table}):
        r = best.get(key)
        rows_for = [x for x in table if (x["GPU"], x["template"], x["budget_fraction"]) == key]
        shown = r or min(rows_for, key=lambda x: x["ratio"])
        print(f"{key[0]:16} {key[1]:20} {key[2]:>4} {shown['prefetch']:>8} {shown['ratio']:>6} "
              f"{str(shown['g5_over_comfy']):>7} {str(shown['block_tails_ratio']):>6}"
              f"{'' if r else '  (none <= 1.05)'}")
    if args.out:
        path = Path(args.out) / "units_timing.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(table)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
