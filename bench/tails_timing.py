"""Streamed tails in the timing model (issue 28): for every template on the four reference GPUs, at a VRAM budget for
the blocks of 30, 50, 70 and 90% of their bytes, what the whole-block plan auto picks (the fastest fitting policy,
prefetch depth and resident count), what the streamed-tails plans (prefetch 1 and 2) predict, and which auto picks
with both among its candidates: bytes streamed per step, predicted step time, its bound
(max(compute, streamed bytes / H2D)) and the step against the whole-block plan's.

    COMFYUI_PATH=$PWD/.comfyui/ComfyUI .venv/bin/python -P bench/tails_timing.py --out bench/results

Costs are bench/timing_table.py's (FLOPs counted on the meta device, block bytes from devtools/template_plans.json);
tail sizes are the templates' real block layouts on the meta device (``BlockLayout.tail_sizes``), scaled by the
stored bytes per weight for fp8 and GGUF templates. The budget holds blocks and slots only (as in the G5 table):
activations, non-block weights and ComfyUI's reserve come off the card before it. Head copies happen once, at
arming, and are not in the step.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

from ..devtools import dit_presets, template_memory  # noqa: E402
from ..offload import Schedule, choose_resident_blocks, largest_fitting, plan_streamed_tails  # noqa: E402
from ..offload.gpu_costs import GPUS  # noqa: E402
from ..offload.plan_choice import choose_plan  # noqa: E402
from ..offload.timing_model import SETTINGS  # noqa: E402

FRACTIONS = (0.3, 0.5, 0.7, 0.9)
FIELDS = ("GPU", "template", "budget_fraction", "plan", "policy", "prefetch", "resident_count", "largest_tail_bytes",
          "streamed_bytes_per_step", "device_bytes", "predicted_step_ms", "bound_ms", "ratio", "step_vs_whole")


def tail_options(template, block_bytes):
    """Per block, its tail sizes from the template's layout on the meta device, scaled to its stored bytes."""
    from ..nodes import discovery
    from ..offload.host.packing import block_parameters, plan_layout
    from .g5_bytes import meta_patcher

    dit = meta_patcher(template).model.diffusion_model
    layouts = [plan_layout(block_parameters(block)) for block in discovery.discover_blocks(dit).blocks]
    if len(layouts) != len(block_bytes):
        raise AssertionError(f"{template.key}: {len(layouts)} blocks on the meta device, {len(block_bytes)} planned")
    options = []
    for layout, stored in zip(layouts, block_bytes):
        scaled = sorted({int(size * stored / layout.nbytes) for size in layout.tail_sizes[:-1]} - {0, stored})
        options.append(tuple(scaled) + (stored,))
    return options


def rows_for(template, costs, options, gpu, fraction):
    sizes = list(costs.block_bytes)
    n = len(sizes)
    room = int(fraction * sum(sizes))
    whole = []
    for policy, prefetch in SETTINGS:
        def fits(count, policy=policy, prefetch=prefetch):
            return Schedule(choose_resident_blocks(n, count, policy)).device_bytes(sizes, prefetch) <= room
        if fits(0):
            whole.append((policy, prefetch, largest_fitting(fits, n)))
    tails = []
    for prefetch in sorted({prefetch for _, prefetch in SETTINGS}):  # as the node offers them (nodes/controller.py)
        plan = plan_streamed_tails(sizes, options, room, prefetch_size=prefetch)
        if plan is not None:
            tails.append(("leading", prefetch, 0, plan.tails))
    if not whole:
        return []
    picks = [("whole-block auto", choose_plan(costs, gpu, whole))]
    picks += [(f"tails, prefetch {c[1]}", choose_plan(costs, gpu, [c])) for c in tails[:2]]
    picks.append(("auto with tails", choose_plan(costs, gpu, whole + tails)))
    base = picks[0][1].prediction.step_s
    out = []
    for label, choice in picks:
        p = choice.prediction
        streamed = sum(choice.tails) if choice.tails else sum(
            s for s, keep in zip(sizes, choose_resident_blocks(n, choice.resident_count, choice.policy)) if not keep)
        out.append(dict(GPU=gpu.name, template=template.key, budget_fraction=fraction, plan=label,
                        policy="tails" if choice.tails else choice.policy, prefetch=choice.prefetch,
                        resident_count=choice.resident_count,
                        largest_tail_bytes=max(choice.tails) if choice.tails else "",
                        streamed_bytes_per_step=streamed, device_bytes=choice.device_bytes,
                        predicted_step_ms=round(p.step_s * 1e3, 3), bound_ms=round(p.bound_s * 1e3, 3),
                        ratio=round(p.ratio, 3), step_vs_whole=round(p.step_s / base, 3)))
    return out


def markdown(rows):
    lines = ["# Streamed tails in the timing model", "",
             "Written by `bench/tails_timing.py` (see its docstring for what it assumes). Per template, reference GPU "
             "and VRAM budget for the blocks (a fraction of their bytes): the whole-block plan auto picks without "
             "streamed tails, and the plan it picks with them among its candidates. `vs whole`: the predicted step "
             "against the whole-block plan's; `ratio`: step / its own bound (max(compute, streamed bytes / H2D)).", "",
             "| GPU | template | budget | whole: GiB/step | whole: ratio | auto: plan | auto: GiB/step | auto: ratio "
             "| auto vs whole |", "|---|---|---|---|---|---|---|---|---|"]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["GPU"], r["template"], r["budget_fraction"]), {})[r["plan"]] = r
    gib = 2 ** 30
    worst = 0.0
    for (gpu, template, fraction), plans in by_key.items():
        whole, auto = plans["whole-block auto"], plans["auto with tails"]
        kind = "tails" if auto["policy"] == "tails" else f"{auto['policy']} r={auto['resident_count']}"
        lines.append(f"| {gpu} | {template} | {fraction} | {whole['streamed_bytes_per_step'] / gib:.2f} | "
                     f"{whole['ratio']} | {kind}, p{auto['prefetch']} | {auto['streamed_bytes_per_step'] / gib:.2f} | "
                     f"{auto['ratio']} | {auto['step_vs_whole']} |")
        worst = max(worst, auto["ratio"])
    picked = sum(1 for plans in by_key.values() if plans["auto with tails"]["policy"] == "tails")
    lines += ["", f"Auto picks streamed tails in {picked} of {len(by_key)} cases; its predicted step is at most "
              f"{max(p['auto with tails']['step_vs_whole'] for p in by_key.values())}x the whole-block plan's "
              f"(never slower by construction: the whole-block plans are among its candidates), and at most "
              f"{worst}x its own bound."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from .timing_table import template_costs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write tails_timing.csv and .md into this folder")
    ap.add_argument("--templates", nargs="*", help="template keys (default: all)")
    args = ap.parse_args(argv)
    templates = {t.key: t for t in template_memory._templates(dit_presets)}
    rows = []
    for tc in template_costs(args.templates):
        template = templates[tc.key]
        options = tail_options(template, tc.costs.block_bytes)
        for gpu in GPUS.values():
            for fraction in FRACTIONS:
                rows.extend(rows_for(template, tc.costs, options, gpu, fraction))
    text = markdown(rows)
    print(text)
    if args.out:
        folder = Path(args.out)
        with open(folder / "tails_timing.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        (folder / "tails_timing.md").write_text(text)
        print(f"wrote {folder / 'tails_timing.csv'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
