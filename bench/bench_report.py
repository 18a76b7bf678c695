"""The report: the one-line log per run, the printed tables, the CSV / meta JSON files and the plot."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .bench_config import COLUMNS, SUMMARY_COLUMNS, BenchResult
from .bench_measure import gib, size_text, equivalent_blocks, largest_fitting_resident, streamed_bytes

def row_line(row) -> str:
    what = row["mode"]
    if row["mode"] == "comfy_lowvram":
        what += f" B={row['budget']}"
    elif row["mode"].startswith("layerwise"):
        what += f" r={row['resident']} p={row['prefetch']} {row['policy']}"
    if row.get("error"):
        return f"{what}: FAILED {row['error']}"
    if row["mode"] == "layerwise_auto":
        what += f" B={row['budget']}"
    return (f"{what}: {row['step_ms']:.2f} ms/step, {row['h2d_bytes_per_step'] / 2**20:.1f} MiB h2d/step, "
            f"bitwise {'equal' if row['bitwise_equal'] else 'DIFFERENT'}")


def _fmt(value, column: str) -> str:
    if value == "" or value is None:
        return "-"
    if column.endswith("_bytes") or column.endswith("_bytes_per_step") or column.endswith("_per_forward"):
        return f"{value / 2**30:.3f}G" if value >= 2**30 else f"{value / 2**20:.1f}M"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


TABLE_COLUMNS = ["mode", "budget", "resident", "prefetch", "policy", "fits_budgets", "forwards_per_step", "step_ms",
                 "weights_device_bytes", "peak_alloc_bytes", "h2d_bytes_per_step", "stall_ms_per_step", "bound_ms",
                 "step_over_bound", "bitwise_equal", "error"]
SUMMARY_TABLE_COLUMNS = ["budget", "budget_bytes", "comfy_step_ms", "comfy_h2d_bytes_per_step", "layerwise_config",
                         "layerwise_step_ms", "layerwise_h2d_bytes_per_step", "layerwise_footprint_bytes",
                         "layerwise_bound_ms", "speedup_vs_comfy", "auto_resident", "auto_step_ms", "full_step_ms"]


def format_table(rows, columns) -> str:
    cells = [[c for c in columns]] + [[_fmt(r.get(c, ""), c) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write_csv(path: Path, rows, columns):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]) for c in columns})


def write_outputs(result: BenchResult, out: Path) -> Dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"comfy_bench_{result.config.preset}_{result.meta['device'].split(':')[0]}"
    files = {"csv": str(out / f"{stem}.csv"), "summary": str(out / f"{stem}_summary.csv"),
             "meta": str(out / f"{stem}_meta.json")}
    _write_csv(Path(files["csv"]), result.rows, COLUMNS)
    _write_csv(Path(files["summary"]), result.summary, SUMMARY_COLUMNS)
    with open(files["meta"], "w") as f:
        json.dump({**result.meta, "skipped": result.skipped}, f, indent=2)
    if result.config.plot:
        png = out / f"{stem}_plot.png"
        message = plot(result, png)
        if message is None:
            files["png"] = str(png)
        else:
            print(f"[comfy-bench] {message}")
    return files


def plot(result: BenchResult, path: Path) -> Optional[str]:
    """Step time against resident count per (prefetch, policy), the bound, full load, ComfyUI at each budget."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    rows = result.rows
    full = next(r for r in rows if r["mode"] == "full")
    ours = [r for r in rows if r["mode"] == "layerwise" and not r["error"]]
    n = len(result.block_nbytes)
    fig, ax = plt.subplots(figsize=(12, 5.5))
    groups: Dict[Tuple[int, str], List[dict]] = {}
    for r in ours:
        groups.setdefault((r["prefetch"], r["policy"]), []).append(r)
    all_resident = [r for r in ours if r["resident"] == n]
    for (p, policy), members in sorted(groups.items()):
        members = sorted(members + [m for m in all_resident if m not in members], key=lambda r: r["resident"])
        ax.plot([m["resident"] for m in members], [m["step_ms"] for m in members],
                marker="o", ms=4, lw=1.2, ls="-" if policy == "leading" else "--",
                label=f"layerwise prefetch {p}, {policy}")
    xs = list(range(n + 1))
    h2d = result.meta["h2d_gbps"] * 1e9
    fwd = [r["forwards_per_step"] for r in ours] or [1]
    fwd = statistics.median(fwd)
    bound = [max(full["step_ms"], streamed_bytes(result.block_nbytes, r, "leading") * fwd / h2d * 1e3) for r in xs]
    ax.plot(xs, bound, color="black", lw=1, ls=":", label=f"bound max(full, bytes / {h2d / 1e9:.1f} GB/s)")
    ax.axhline(full["step_ms"], color="grey", lw=0.8, label="full load (all resident)")
    for index, (label, budget) in enumerate(result.budgets):
        comfy = next((r for r in rows if r["mode"] == "comfy_lowvram" and r["budget"] == label
                      and not r["error"]), None)
        if comfy is None:
            continue
        x = equivalent_blocks(result.block_nbytes, budget - result.non_block_bytes)
        ax.scatter([x], [comfy["step_ms"]], marker="X", s=90, color="crimson", zorder=5)
        ax.annotate(f"ComfyUI lowvram B={label}\n({size_text(budget)})", (x, comfy["step_ms"]),
                    textcoords="offset points", xytext=(6, 6 + 14 * (index % 3)), fontsize=7, color="crimson")
        fit = largest_fitting_resident(result.block_nbytes, result.non_block_bytes, budget, 1, "leading")
        if fit is not None:
            ax.axvline(fit, color="crimson", lw=0.5, ls=":")
    autos = [r for r in rows if r["mode"] == "layerwise_auto" and not r["error"]]
    if autos:
        ax.scatter([r["resident"] for r in autos], [r["step_ms"] for r in autos], marker="*", s=110,
                   color="darkgreen", zorder=6, label="layerwise auto (-1) under ComfyUI's budget B")
    meta = result.meta
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
    return None


def print_result(result: BenchResult) -> None:
    meta = result.meta
    print(f"\n{meta['preset']} on {meta.get('gpu', meta['device'])}: {meta['num_blocks']} blocks "
          f"({gib(sum(result.block_nbytes))} GiB), non-block {gib(result.non_block_bytes)} GiB, {meta['dtype']}, "
          f"{meta['steps']} steps; h2d {meta['h2d_gbps']:.2f} GB/s; ComfyUI {meta['comfyui']}, torch {meta['torch']}")
    print(format_table(result.rows, TABLE_COLUMNS))
    print("\nper budget (layerwise: the fastest configuration whose footprint fits B):")
    print(format_table(result.summary, SUMMARY_TABLE_COLUMNS))
    for note in result.skipped:
        print(f"skipped: {note}")
    for kind, path in result.files.items():
        print(f"wrote {kind}: {path}")
