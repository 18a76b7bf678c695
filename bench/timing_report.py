"""The timing table's report: which rows are the defaults, the findings read from the rows, the sensitivity to
the model's two leading figures, the markdown and the picture (bench/timing_table.py makes the rows)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Dict, List

from ..devtools import template_memory
from ..offload import choose_resident_blocks, footprint
from ..offload.timing import costs as tm
from ..offload.timing.choice import CLOSE_STEP, SETTINGS
from ..offload.timing.step import predict
from .template_costs import GB, LORA_BYTES_PER_WEIGHT, TemplateCosts

BEFORE = ("leading", 1)  # the defaults before residency_policy auto


def is_default(row) -> bool:
    """A row of the node's defaults: residency_policy auto, the setting the timing model chooses at that count."""
    return row["policy"] == "auto"


def is_before(row) -> bool:
    return (row["policy"], row["prefetch"]) == BEFORE
WITHIN = 1.05


def _key(row) -> tuple:
    return row["GPU"], row["template"], int(row["resident_count"])


def fixes(rows: List[dict]) -> Dict[tuple, dict]:
    """Per (GPU, template, r): the setting within WITHIN that holds the fewest device bytes (ties: the order of
    ``SETTINGS``)."""
    order = {s: i for i, s in enumerate(SETTINGS)}
    best: Dict[tuple, dict] = {}
    for row in rows:
        if row["lora"] or row["ratio"] > WITHIN or is_default(row):
            continue
        k = _key(row)
        rank = (row["device_gib"], order[(row["policy"], row["prefetch"])])
        if k not in best or rank < best[k]["_rank"]:
            best[k] = dict(row, _rank=rank)
    return best


SENSITIVITY = (("DiT efficiency 0.5", 0.5, 1.0), ("DiT efficiency 1.0 (the matmul rate)", 1.0, 1.0),
               ("H2D -20 %", None, 0.8), ("H2D -20 %, DiT efficiency 1.0", 1.0, 0.8))


def sensitivity(templates: List[TemplateCosts], gpus, plans) -> List[str]:
    """How the defaults' misses move with the two figures the model leans on most (leading, prefetch 1 only)."""
    lines = ["| variant | plans over 1.05x at the defaults (fitting the card), by template and GPU | worst |",
             "| --- | --- | --- |"]
    for label, efficiency, h2d in SENSITIVITY:
        over, worst = [], (0.0, "")
        for g in gpus:
            flops = g.matmul_flops_per_s * (efficiency / tm.DIT_EFFICIENCY if efficiency else 1.0)
            variant = dataclasses.replace(g, matmul_flops_per_s=flops, h2d_bytes_per_s=g.h2d_bytes_per_s * h2d)
            for tc in templates:
                n = tc.costs.num_blocks
                fixed = (plans["context_and_desktop_bytes"] + plans["comfy_reserve_bytes"] + tc.non_block_bytes
                         + tc.activation_bytes)
                for r in range(n + 1):
                    device = footprint(tc.costs.block_bytes, choose_resident_blocks(n, r, "leading"), 1).total
                    if device + fixed > g.vram_bytes:
                        continue
                    ratio = predict(tc.costs, variant, r, *BEFORE).ratio
                    if ratio > WITHIN:
                        over.append((tc.key, g.name.rsplit(" ", 1)[0]))
                    worst = max(worst, (ratio, f"{tc.key}, {g.name}, r {r}"))
        by = ", ".join(f"{k} {gpu}: {n}" for (k, gpu), n in sorted(Counter(over).items()))
        lines.append(f"| {label} | {len(over)}{' (' + by + ')' if by else ''} | {worst[0]:.3f} ({worst[1]}) |")
    return lines


def headlines(rows: List[dict], templates: List[TemplateCosts], best: Dict[tuple, dict]) -> List[str]:
    """The findings, in numbers read from the rows."""
    plain = [r for r in rows if not r["lora"]]
    now = [r for r in plain if is_default(r)]
    now_over = [r for r in now if r["ratio"] > WITHIN]
    worst_now = max(now, key=lambda r: r["ratio"])
    out = [f"- At the defaults (residency_policy auto: the setting the model predicts fastest among those that fit), "
           f"{len(now_over)} of {len(now)} plans (template x GPU x resident count) predict more than {WITHIN}x the "
           f"bound; the worst is {worst_now['ratio']:.3f}x ({worst_now['template']}, {worst_now['GPU']}, r "
           f"{worst_now['resident_count']}, {worst_now['chosen']} {worst_now['prefetch']})."]
    shallow = shallow_auto(plain)
    shallow_over = [r for r in shallow if r["ratio"] > WITHIN]
    if shallow_over:
        worst = max(shallow_over, key=lambda r: r["ratio"])
        pairs = sorted({(r["template"], r["GPU"]) for r in shallow_over})
        where = "; ".join(f"{t} on the {g}: r " + _ranges([r["resident_count"] for r in shallow_over
                                                            if (r["template"], r["GPU"]) == (t, g)]) for t, g in pairs)
        out.append(f"- With auto choosing among prefetch 1-4 only (before the deeper leading rings), "
                   f"{len(shallow_over)} were over {WITHIN}x ({where}; worst {worst['ratio']:.3f}x at r {worst['resident_count']}, "
                   f"{worst['policy']} {worst['prefetch']}): leading keeps the biggest blocks, which come first, and a "
                   "ring of at most 5 slots leaves the copy engine idle while they compute; strided reaches its own "
                   "bound but keeps smaller blocks and streams more bytes, so its step is slower still. A leading "
                   "ring deep enough to take the copies of the residents' stretch reaches the bound.")
    default = [r for r in plain if is_before(r)]
    over = [r for r in default if r["ratio"] > WITHIN]
    out += [f"- Before it (leading, prefetch 1), {len(over)} of {len(default)} plans predicted more than {WITHIN}x "
            f"the bound, {sum(r['fits'] for r in over)} of them plans that fit their card:"]
    for (template, gpu), n in sorted(Counter((r["template"], r["GPU"]) for r in over).items()):
        mine = [r for r in over if (r["template"], r["GPU"]) == (template, gpu)]
        worst = max(mine, key=lambda r: r["ratio"])
        out.append(f"  - {template} on the {gpu}: r {_ranges([r['resident_count'] for r in mine])}, worst "
                   f"{worst['ratio']:.3f}x at r {worst['resident_count']}.")
    calm = [tc.key for tc in templates if not any(r["template"] == tc.key for r in over)]
    if calm:
        worst = max((r for r in default if r["template"] in calm), key=lambda r: r["ratio"])
        out.append(f"- {', '.join(calm)}: within {worst['ratio']:.3f}x everywhere (compute-bound on every card at "
                   "their template's shape).")
    auto = [r for r in default if r["auto"]]
    if auto:
        worst = max(auto, key=lambda r: r["ratio"])
        out.append(f"- At the resident count auto picks on each card (leading, prefetch 1), the worst ratio is "
                   f"{worst['ratio']:.3f}x ({worst['template']}, {worst['GPU']}, r {worst['resident_count']}): the "
                   "misses are at smaller resident counts (less free memory, other models loaded, a count set by hand).")
    fixed = [best[_key(r)] for r in over if _key(r) in best]
    if over:
        extra = max(b["device_gib"] - r["device_gib"] for r in over for b in [best.get(_key(r))] if b)
        out.append(f"- {len(fixed)} of the {len(over)} have a setting of the grid within "
                   f"{WITHIN}x; the one holding the fewest device bytes costs at most {extra:+.2f} GiB over the "
                   "default plan. No single setting serves every plan:")
        counts = []
        for setting in SETTINGS:
            n = sum(1 for r in plain if (r["policy"], r["prefetch"]) == setting and r["ratio"] > WITHIN)
            counts.append(f"{setting[0]} {setting[1]}: {n}")
        out.append("  - plans over " + f"{WITHIN}x per fixed setting: " + ", ".join(counts) + ".")
    gains = [g for per in same_budget(rows).values() for g in per]
    if gains:
        gain, r, b, d = max(gains, key=lambda g: g[0])
        out.append(f"- At the same device memory, the fastest plan of the grid beats the default by up to {gain:.0%} "
                   f"({d['template']}, {d['GPU']}: r {r} leading 1 {d['ratio']:.3f}x -> r {b['resident_count']} "
                   f"{b['policy']} {b['prefetch']} {b['ratio']:.3f}x).")
    lora = [r for r in rows if r["lora"] and r["fits"]]
    if lora:
        worst = max(lora, key=lambda r: r["ratio"])
        out.append(f"- With a LoRA (on its own stream): up to {worst['ratio']:.3f}x the bound ({worst['template']}, "
                   f"{worst['GPU']}, r {worst['resident_count']}, {worst['policy']} 1); the next copy no longer waits "
                   "for it, only the block's own compute does.")
    return out


def shallow_auto(plain: List[dict]) -> List[dict]:
    """Per (GPU, template, r): the row auto would have run choosing among prefetch 1-4 only (choose_plan's rule: the
    fastest step among the settings that fit, or among all where none fits; of those within CLOSE_STEP of it, the
    fewest device bytes)."""
    groups: Dict[tuple, List[dict]] = {}
    for row in plain:
        if not is_default(row) and row["prefetch"] <= 4:
            groups.setdefault(_key(row), []).append(row)
    out = []
    for mine in groups.values():
        pool = [r for r in mine if r["fits"]] or mine
        fastest = min(r["predicted_step_ms"] for r in pool)
        close = [r for r in pool if r["predicted_step_ms"] <= fastest * CLOSE_STEP]
        out.append(min(close, key=lambda r: r["device_gib"]))
    return out


def same_budget(rows: List[dict]) -> Dict[tuple, List[tuple]]:
    """Per (template, GPU): for each default plan, (gain, r, the fastest row holding no more device memory, the
    default row)."""
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        if not row["lora"]:
            groups.setdefault((row["template"], row["GPU"]), []).append(row)
    out = {}
    for key, mine in groups.items():
        gains = []
        for d in (r for r in mine if is_before(r)):
            best = min((r for r in mine if r["device_gib"] <= d["device_gib"]),
                       key=lambda r: (r["predicted_step_ms"], r["device_gib"]))
            gains.append((1 - best["predicted_step_ms"] / d["predicted_step_ms"], d["resident_count"], best, d))
        out[key] = gains
    return out


def _ranges(values: List[int]) -> str:
    out, start, prev = [], None, None
    for v in sorted(values):
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def write_markdown(rows: List[dict], templates: List[TemplateCosts], gpus, path: Path, check=None) -> None:
    best = fixes(rows)
    default = [r for r in rows if is_before(r) and not r["lora"]]
    by = {(_key(r), r["policy"], r["prefetch"], r["lora"]): r for r in rows}
    over = [r for r in default if r["ratio"] > WITHIN]
    lines = [
        "# Timing model: predicted step time vs the bound",
        "",
        "Made by `.venv/bin/python -P bench/timing_table.py --replay` (3 minutes on the project's shared 2-core "
        "machine); every row is in "
        "`timing_model.csv`, the curves in `timing_model.png`. **A model, not a measurement**: the first GPU run "
        "checks it.",
        "",
        "## Headlines",
        "",
        *headlines(rows, templates, best),
        "",
        "## How",
        "",
        "`offload/timing/step.py` computes the manager's schedule from the plan: the compute stream runs the blocks "
        "in order, each streamed block waits for its bytes, the copy of the streamed block `prefetch` places on is "
        "queued before it into the slot the previous streamed block left (wrapping into the next step), one copy "
        "engine, the LoRA on a stream of its own. The step is the steady state (between the ends of forwards 2 and "
        "3). `bench/timing_replay.py` checks that schedule against the real `LayerwiseOffloadManager` (below). The "
        "bound is `max(compute, streamed bytes / H2D)`.",
        "",
        "Assumptions:",
        "",
        "- One copy engine (the copy stream), a constant pinned H2D rate; every streamed block page-locked.",
        f"- Block compute = counted FLOPs / (achievable dense bf16 matmul rate x {tm.DIT_EFFICIENCY}) + weight casts "
        "(fp8, GGUF) at HBM bandwidth. Element-wise kernels are inside the 0.7; attention is counted as flash "
        "attention computes it. One forward per step (cond + uncond batched where CFG > 1).",
        f"- Host: {tm.LAUNCH_S_PER_BLOCK * 1e3:.2f} ms to launch each block, "
        f"{tm.HOST_S_PER_STREAMED_BLOCK * 1e3:.3f} ms of bookkeeping per streamed block in bf16 "
        f"({tm.HOST_S_PER_STREAMED_BLOCK_FP8 * 1e3:.3f} ms plain fp8: Qwen-Image; "
        f"{tm.HOST_S_PER_STREAMED_BLOCK_QUANTIZED * 1e3:.3f} ms fp8 scaled `QuantizedTensor`: Wan 2.2 fp8; "
        f"{tm.HOST_S_PER_STREAMED_BLOCK_GGUF * 1e3:.3f} ms GGUF; the worst medians of the `after` rows of "
        "`host_time.csv`, measured on the project's 2-core CPU), issued ahead of the GPU without limit; the sampler "
        "reads each step's result back (a host sync at the end of every step).",
        f"- LoRA rows: every linear weight patched on the device with ComfyUI's float32 math, "
        f"{LORA_BYTES_PER_WEIGHT} bytes of device-memory traffic per weight, on a stream of its own after the copy (as "
        "offload/device/backend.py queues it); it takes no SM time from the compute stream (optimistic).",
        "- Not modelled: arming (the residents' first copies), PCIe contention with other traffic, clocks, the "
        "launch queue's depth, kernels' warm-up.",
        "",
        "## GPUs",
        "",
        "| GPU | pinned H2D GB/s | achievable bf16 matmul TFLOP/s | x DiT efficiency | HBM GB/s | source |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for g in gpus:
        lines.append(f"| {g.name} | {g.h2d_bytes_per_s / GB:.0f} | {g.matmul_flops_per_s / 1e12:.0f} | "
                     f"{g.dit_flops_per_s / 1e12:.0f} | {g.hbm_bytes_per_s / GB:.0f} | {g.source} |")
    lines += ["", "## Templates", "",
              "FLOPs per block counted on ComfyUI's model classes (meta device, `FlopCounterMode` + flash attention "
              "count); `estimate` is the rule of thumb 2 x linear weights x tokens + 4 x tokens^2 x width ("
              "text tokens included for joint attention).", "",
              "| template | blocks | tokens x batch | block GB | counted TFLOP/block | estimate | outside TFLOP | "
              + " | ".join(f"{g.name}: compute / copy ms per block" for g in gpus) + " |",
              "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in gpus) + " |"]
    for tc in templates:
        sizes = sorted(set(tc.costs.block_bytes), reverse=True)
        per_gpu = []
        for g in gpus:
            secs = tc.costs.block_seconds(g)
            parts = []
            for k, n in enumerate(tc.lists):
                i = sum(tc.lists[:k])
                parts.append(f"{secs[i] * 1e3:.1f} / {tc.costs.block_bytes[i] / g.h2d_bytes_per_s * 1e3:.1f}")
            per_gpu.append("; ".join(parts))
        lines.append(
            f"| {tc.name} | {' + '.join(map(str, tc.lists))} | {tc.tokens} x {tc.batch} | "
            f"{' / '.join(f'{s / GB:.2f}' for s in sizes)} | {' / '.join(f'{f / 1e12:.2f}' for f in tc.list_flops)} | "
            f"{' / '.join(f'{f / 1e12:.2f}' for f in tc.list_estimate)} | {tc.costs.outside_flops / 1e12:.2f} | "
            + " | ".join(per_gpu) + " |")
    lines += ["", "## Before residency_policy auto: leading, prefetch 1", "",
              f"Per template and GPU: the worst ratio over every resident count, the counts above {WITHIN}x, those "
              "of them whose plan fits the card, the ratio at the count auto picks on that card, and the settings "
              f"that bring those counts to <= {WITHIN}x in the model (for each count, the one holding the fewest "
              "device bytes; the next table names it count by count).", "",
              "| template | GPU | worst ratio (r) | r over 1.05x | of which fit the card | auto r: ratio | fixed by |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for tc in templates:
        for g in gpus:
            mine = [r for r in default if r["template"] == tc.key and r["GPU"] == g.name]
            worst = max(mine, key=lambda r: r["ratio"])
            bad = [r["resident_count"] for r in mine if r["ratio"] > WITHIN]
            bad_fit = [r["resident_count"] for r in mine if r["ratio"] > WITHIN and r["fits"]]
            auto = [r for r in mine if r["auto"]]
            auto_text = f"{auto[0]['resident_count']}: {auto[0]['ratio']:.3f}" if auto else "none fits"
            settings = sorted({(best[_key(r)]["policy"], best[_key(r)]["prefetch"]) for r in mine
                               if r["ratio"] > WITHIN and _key(r) in best})
            unfixed = [r["resident_count"] for r in mine if r["ratio"] > WITHIN and _key(r) not in best]
            fixed = ", ".join(f"{p} {q}" for p, q in settings) or "-"
            if unfixed:
                fixed += f"; none for r {_ranges(unfixed)}"
            lines.append(f"| {tc.name} | {g.name} | {worst['ratio']:.3f} ({worst['resident_count']}) | "
                         f"{_ranges(bad) or '-'} | {_ranges(bad_fit) or '-'} | {auto_text} | {fixed} |")
    lines += ["", f"## Every row over {WITHIN}x at leading, prefetch 1, and its fix", "",
              "`fix`: the setting within 1.05x that holds the fewest device bytes (`+GiB`: its extra device memory "
              "over "
              "the default plan; negative when it holds less); `strided 1` is `strided` at prefetch 1.", "",
              "| GPU | template | r | fits | step ms | bound ms | ratio | copy idle ms | compute stall ms | fix | "
              "fix ratio | +GiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in over:
        b = best.get(_key(r))
        fix = (f"{b['policy']} {b['prefetch']} | {b['ratio']:.3f} | {b['device_gib'] - r['device_gib']:+.2f}"
               if b else "none in the grid | | ")
        lines.append(f"| {r['GPU']} | {r['template']} | {r['resident_count']} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['predicted_step_ms']:.1f} | {r['bound_ms']:.1f} | {r['ratio']:.3f} | "
                     f"{r['copy_idle_ms']:.1f} | "
                     f"{r['compute_stall_ms']:.1f} | {fix} |")
    if not over:
        lines.append("| (none) | | | | | | | | | | | |")
    lines += ["", "## Sensitivity", "",
              "The two figures the model leans on most, varied for the default setting (rows whose plan fits the "
              "card; the main tables use DiT efficiency 0.7 and the H2D rates above):", "",
              *sensitivity(templates, gpus, template_memory.load_plans())]
    lines += ["", "## One setting for every plan?", "",
              f"Rows (template x GPU x r, all fitting their card) above {WITHIN}x for each fixed setting of the "
              "grid:", "",
              "| setting | rows over | worst (GPU, template, r) |", "| --- | --- | --- |"]
    for policy, prefetch in SETTINGS:
        mine = [r for r in rows if not r["lora"] and (r["policy"], r["prefetch"]) == (policy, prefetch)]
        bad = [r for r in mine if r["ratio"] > WITHIN]
        worst = max(mine, key=lambda r: r["ratio"])
        where = ", ".join(f"{g} {n}" for (g, n), _ in
                          sorted(Counter((r["GPU"].split()[1], r["template"]) for r in bad).items()))
        lines.append(f"| {policy} {prefetch} | {len(bad)}{' (' + where + ')' if where else ''} | "
                     f"{worst['ratio']:.3f} ({worst['GPU']}, {worst['template']}, {worst['resident_count']}) |")
    lines += ["", "## The same device memory, the best plan", "",
              "For each default plan (leading 1, r residents), the fastest plan of the grid (any r, policy, prefetch) "
              "that holds no more device memory: what a choice of plan by the model would gain at that budget. Listed: "
              "template x GPU pairs where it gains more than 2 % somewhere.", "",
              "| template | GPU | budgets (default r) where the best plan gains > 2 % | largest gain: default r -> best plan "
              "(ratios) |", "| --- | --- | --- | --- |"]
    for (key, gpu_name), gains in same_budget(rows).items():
        better = [g for g in gains if g[0] > 0.02]
        if not better:
            continue
        gain, r, best_row, default_row = max(better, key=lambda g: g[0])
        lines.append(f"| {key} | {gpu_name} | {_ranges([g[1] for g in better])} | {gain:.1%}: r {r} -> r "
                     f"{best_row['resident_count']} {best_row['policy']} {best_row['prefetch']} "
                     f"({default_row['ratio']:.3f} -> {best_row['ratio']:.3f}) |")
    lines += ["", "## LoRA on the device (prefetch 1)", "",
              "The LoRA math runs on a stream of its own between a block's copy and its done event: the block's "
              "compute waits for it, the next block's copy does not (on the copy stream, as before this change, "
              "Flux at r = 0 on the RTX 4090 was 1.348x with a LoRA). Ratios against the same bound (which has no LoRA term): at r = 0, and the worst "
              "over every r whose plan fits the card; `+ms` is what the LoRA adds to the step at r = 0 (leading).", "",
              "| template | GPU | LoRA ms per block (largest) | r=0 leading: no LoRA / LoRA | +ms | "
              "worst leading + LoRA (r) | worst strided + LoRA (r) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for tc in templates:
        for g in gpus:
            k = (g.name, tc.key, 0)
            plain, lead = by[(k, "leading", 1, 0)], by[(k, "leading", 1, 1)]
            fit = [r for r in rows if r["template"] == tc.key and r["GPU"] == g.name and r["lora"] and r["fits"]]
            worst = {p: max((r for r in fit if r["policy"] == p), key=lambda r: r["ratio"], default=None)
                     for p in ("leading", "strided")}
            text = {p: (f"{w['ratio']:.3f} ({w['resident_count']})" if w else "-") for p, w in worst.items()}
            lora_ms = max(tc.lora_costs.lora_bytes) / g.hbm_bytes_per_s * 1e3
            lines.append(f"| {tc.name} | {g.name} | {lora_ms:.1f} | {plain['ratio']:.3f} / {lead['ratio']:.3f} | "
                         f"{lead['predicted_step_ms'] - plain['predicted_step_ms']:+.0f} | "
                         f"{text['leading']} | {text['strided']} |")
    if check is not None:
        lines += check.lines()
    path.write_text("\n".join(lines) + "\n")


def plot(rows: List[dict], templates: List[TemplateCosts], gpus, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(templates), len(gpus), figsize=(4.2 * len(gpus), 2.6 * len(templates)),
                             sharey=True, squeeze=False)
    series = [(("auto", None), "k", "auto (the default)"), (("leading", 1), "C3", "leading, prefetch 1 (before)"),
              (("leading", 2), "C1", "leading, prefetch 2"),
              (("strided", 1), "C0", "strided, prefetch 1"), (("strided", 2), "C2", "strided, prefetch 2")]
    for i, tc in enumerate(templates):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            mine = [r for r in rows if r["template"] == tc.key and r["GPU"] == g.name and not r["lora"]]
            for (setting, color, label) in series:
                pts = sorted((r["resident_count"], r["ratio"]) for r in mine if r["policy"] == setting[0]
                             and (setting[1] is None or r["prefetch"] == setting[1]))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.2, label=label)
            lora = sorted((r["resident_count"], r["ratio"]) for r in rows if r["template"] == tc.key
                          and r["GPU"] == g.name and r["lora"] and r["policy"] == "leading")
            ax.plot([p[0] for p in lora], [p[1] for p in lora], color="C4", lw=0.8, ls=":",
                    label="leading 1 + LoRA")
            misfit = [r["resident_count"] for r in mine if is_before(r) and not r["fits"]]
            if misfit:
                ax.axvspan(min(misfit) - 0.5, max(misfit) + 0.5, color="0.9", zorder=0)
            auto = [r["resident_count"] for r in mine if r["auto"]]
            if auto:
                ax.axvline(auto[0], color="k", lw=0.6, ls="--")
            ax.axhline(WITHIN, color="0.5", lw=0.6, ls=":")
            ax.set_ylim(0.95, 1.7)
            if i == 0:
                ax.set_title(g.name, fontsize=9)
            if j == 0:
                ax.set_ylabel(tc.key + "\nstep / bound", fontsize=8)
            if i == len(templates) - 1:
                ax.set_xlabel("resident blocks", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle("Timing model: predicted step / max(compute, streamed bytes / H2D); grey: plan does not fit the "
                 "card; dashed: auto's pick", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=80)
