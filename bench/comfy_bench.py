"""Side by side inside the real ComfyUI (in-process): ComfyUI's full load, its own partial loading and this pack's
node at the same VRAM budgets B for weights; ``--formats``: weight formats side by side (bench_formats.py).

    python -P bench/comfy_bench.py --preset tiny --device cpu --steps 10 --budgets 0.6,0.75,0.9 --out bench/results
    python -P bench/comfy_bench.py --preset flux,wan21_14b,qwen_image --device cuda --deadline-s 90 --out DIR
    python -P bench/comfy_bench.py --preset tiny_wan --formats bf16,fp8_mixed,gguf_q4_0 --residents 0,2

B (``--budgets``) is the non-block weights + f x the blocks' bytes, or a size (12GiB); activations come on top.
Every mode samples the same latent and noise (Euler, ``comfy.sample.sample``, so ``load_models_gpu`` places the
weights each time, under ``torch.inference_mode()`` as ComfyUI's executor does) on a preset (devtools/dit_presets.py):
``full`` (everything resident: the reference of every ``bitwise_equal``), ``comfy_lowvram`` (ComfyUI's partial
loading, handed B through ``LoadedModel.model_load``: measure.comfy_weight_budget says why; it keeps the largest
modules and casts the rest every forward), ``layerwise`` (the node at each resident count x prefetch x policy;
``fits_budgets``: the B its ``model_size()`` fits) and ``layerwise_auto`` (resident_layers=-1, handed B likewise).

Per run: ``step_ms`` is the median of the steps after the first (loading, warm-up); ``weights_device_bytes`` what
is held for weights at the end (lowvram: + ComfyUI's cast buffer; layerwise: non-block weights + the manager's
buffers and slots); ``streamed_bytes_per_forward`` the streamed blocks (lowvram: the modules left lowvram);
``h2d_bytes_per_step`` what was counted moving (the manager's counters; ComfyUI's casts); ``h2d_gbps`` a pinned copy
of one block's size; ``bound_ms`` = max(full-load step, h2d bytes / h2d_gbps). A run that raises is a row with
``error``. Files: ``comfy_bench_<preset>_<device>.csv``, ``_summary.csv`` (per B: ComfyUI against the fastest
fitting layerwise configuration), ``_meta.json``, ``_plot.png``. On the CPU (the CPU loopback) the times mean
nothing: the run checks the accounting and bitwise equality; real numbers come from bench/gpu_run.sh.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

from .harness import COLUMNS, DTYPES, SUMMARY_COLUMNS, BenchConfig, BenchResult, Harness  # noqa: E402
from .measure import cpu_loopback, largest_fitting_resident, streamed_bytes, write_csv  # noqa: E402
from ..offload import format_bytes, format_rate  # noqa: E402

# ----------------------------------------------------------------------------------------------- the report
def write_outputs(result: BenchResult, out: Path) -> Dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"comfy_bench_{result.config.preset}_{result.meta['device'].split(':')[0]}"
    files = {"csv": write_csv(f"{stem}.csv", result.rows, COLUMNS),
             "summary": write_csv(f"{stem}_summary.csv", result.summary, SUMMARY_COLUMNS), "meta": f"{stem}_meta.json"}
    Path(files["meta"]).write_text(json.dumps({**result.meta, "skipped": result.skipped}, indent=2))
    if result.config.plot:
        try:
            files["png"] = plot(result, Path(f"{stem}_plot.png"))
        except ImportError:
            print("[comfy-bench] matplotlib is not installed: no PNG (pip install matplotlib)")
    return files


def plot(result: BenchResult, path: Path) -> str:
    """Step time against resident count per (prefetch, policy), the bound, full load, ComfyUI at each budget."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta, sizes = result.rows, result.meta, result.block_nbytes
    full = next(r for r in rows if r["mode"] == "full")
    ours = [r for r in rows if r["mode"] == "layerwise" and not r["error"]]
    n = len(sizes)
    fig, ax = plt.subplots(figsize=(12, 5.5))
    groups: Dict[Tuple[int, str], List[dict]] = {}
    for r in ours:
        groups.setdefault((r["prefetch"], r["policy"]), []).append(r)
    all_resident = [r for r in ours if r["resident"] == n]
    for (p, policy), members in sorted(groups.items()):
        members = sorted(members + [m for m in all_resident if m not in members], key=lambda r: r["resident"])
        ax.plot([m["resident"] for m in members], [m["step_ms"] for m in members], marker="o", ms=4, lw=1.2,
                ls="-" if policy == "leading" else "--", label=f"layerwise prefetch {p}, {policy}")
    h2d = meta["h2d_gbps"] * 1e9
    fwd = statistics.median([r["forwards_per_step"] for r in ours] or [1])
    bound = [max(full["step_ms"], streamed_bytes(sizes, r, "leading") * fwd / h2d * 1e3) for r in range(n + 1)]
    ax.plot(range(n + 1), bound, color="black", lw=1, ls=":", label=f"bound max(full, bytes / {h2d / 1e9:.1f} GB/s)")
    ax.axhline(full["step_ms"], color="grey", lw=0.8, label="full load (all resident)")
    for index, (label, budget) in enumerate(result.budgets):
        comfy = next((r for r in rows if r["mode"] == "comfy_lowvram" and r["budget"] == label and not r["error"]),
                     None)
        if comfy is None:
            continue
        x, left = 0.0, budget - result.non_block_bytes  # how many leading blocks B's weight bytes would hold
        for size in sizes:
            if left <= 0:
                break
            x, left = x + min(1.0, left / size), left - size
        ax.scatter([x], [comfy["step_ms"]], marker="X", s=90, color="crimson", zorder=5)
        ax.annotate(f"ComfyUI lowvram B={label}\n({format_bytes(budget)})", (x, comfy["step_ms"]),
                    textcoords="offset points", xytext=(6, 6 + 14 * (index % 3)), fontsize=7, color="crimson")
        fit = largest_fitting_resident(sizes, result.non_block_bytes, budget, 1, "leading")
        if fit is not None:
            ax.axvline(fit, color="crimson", lw=0.5, ls=":")
    autos = [r for r in rows if r["mode"] == "layerwise_auto" and not r["error"]]
    if autos:
        ax.scatter([r["resident"] for r in autos], [r["step_ms"] for r in autos], marker="*", s=110,
                   color="darkgreen", zorder=6, label="layerwise auto (-1) under ComfyUI's budget B")
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
    return str(path)


def print_result(result: BenchResult) -> None:
    """Per budget, ComfyUI's own offloading against the fastest layerwise configuration that fits it (every run was
    logged as it ran; the CSV holds them all)."""
    meta = result.meta
    print(f"\n{meta['preset']} on {meta.get('gpu', meta['device'])}: {meta['num_blocks']} blocks "
          f"({format_bytes(sum(result.block_nbytes))}), non-block {format_bytes(result.non_block_bytes)}, "
          f"{meta['dtype']}, {meta['steps']} steps; h2d {format_rate(meta['h2d_gbps'] * 1e9)}; ComfyUI {meta['comfyui']}, torch {meta['torch']}")
    ms = lambda v: "-" if v == "" else f"{v:.2f} ms/step"  # noqa: E731
    size = lambda v: "-" if v == "" else format_bytes(v)  # noqa: E731
    for s in result.summary:
        print(f"  B={s['budget']} ({format_bytes(s['budget_bytes'])}): ComfyUI lowvram {ms(s['comfy_step_ms'])}, "
              f"{size(s['comfy_h2d_bytes_per_step'])} h2d/step; layerwise {s['layerwise_config']} "
              f"{ms(s['layerwise_step_ms'])}, {size(s['layerwise_h2d_bytes_per_step'])} h2d/step, footprint "
              f"{size(s['layerwise_footprint_bytes'])}; auto r={s['auto_resident']} {ms(s['auto_step_ms'])}; "
              f"full load {ms(s['full_step_ms'])}")
    for note in result.skipped:
        print(f"skipped: {note}")
    for kind, path in result.files.items():
        print(f"wrote {kind}: {path}")


# ----------------------------------------------------------------------------------------------- entry points
def run_bench(config: BenchConfig) -> BenchResult:
    """Run every mode, write the CSVs / meta / plot under ``config.out`` (if given), return the result. On the CPU
    the node passes the model through unless the CPU loopback is asked for: it is set for this run only."""
    harness = Harness(config)
    with cpu_loopback(config.cpu, config.threads):
        try:
            harness.setup()
            result = harness.run()
        finally:
            harness.teardown()
    if config.out is not None:
        result.files = write_outputs(result, Path(config.out))
    return result


def run_formats_bench(config: BenchConfig):
    """The weight-format comparison (bench_formats.py), bf16 unless ``--dtype`` says otherwise; writes its CSV /
    Markdown under ``config.out``. Returns (rows, skipped lines, files). Outside ``torch.inference_mode()``: under
    it ComfyUI's own ``QuantizedTensor`` weights fail before the first step, without this pack (``Cannot set
    version_counter for inference tensor``, from ``module_size`` / ``Parameter.__new__``)."""
    from . import bench_formats
    config = dataclasses.replace(config, dtype=config.dtype or "bf16", budgets=(), plot=False, inference_mode=False)
    log = (lambda *a: None) if config.quiet else (lambda *a: print("[comfy-bench]", *a, flush=True))
    with cpu_loopback(config.cpu, config.threads):
        rows, skipped = bench_formats.run_formats(config, log)
    files = {} if config.out is None else bench_formats.write_format_outputs(rows, skipped, config,
                                                                             "cpu" if config.cpu else "cuda")
    return rows, skipped, files


def parse_args(argv=None) -> BenchConfig:
    from .bench_formats import parse_formats
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny",
                        help="flux | wan21_14b | qwen_image | tiny_wan | tiny (default tiny); several: flux,wan21_14b")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the preset's "
                        "(bf16; fp32 for tiny and on the CPU)")
    parser.add_argument("--blocks", default=None, help="block counts per block list, e.g. 4,8 for flux "
                        "(double,single); default: the preset's")
    parser.add_argument("--steps", type=int, default=6, help="sampling steps per run (>= 3; step 1 is warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="0.3,0.5,0.7,0.9",
                        help="VRAM budgets for weights: fractions of the blocks' bytes (added to the non-block "
                             "weights) or sizes like 12GiB; comma-separated")
    parser.add_argument("--residents", default="auto",
                        help="resident counts for the layerwise sweep, comma-separated, or 'auto' (0, quartiles, "
                             "all, and the largest count that fits each budget)")
    parser.add_argument("--prefetch", default="1,2,4")
    parser.add_argument("--policies", default="leading,strided")
    parser.add_argument("--out", default=None, help="folder for the CSVs, meta JSON and PNG")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (default 1)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no layerwise run after this many seconds (keeps a GPU call inside its limit)")
    parser.add_argument("--no-inference-mode", action="store_true",
                        help="sample outside torch.inference_mode() (ComfyUI's executor uses it; default: use it)")
    parser.add_argument("--formats", default="", help="compare weight formats instead (bench_formats.py; Wan "
                        "presets): bf16,fp8_mixed,gguf_q4_0 or all (+ gguf_f16, gguf_q8_0, gguf_q5_0); with "
                        "--residents for the node's runs")
    parser.add_argument("--quiet", action="store_true")
    a = parser.parse_args(argv)
    ints = lambda text: [int(part) for part in text.split(",") if part.strip()]  # noqa: E731
    return BenchConfig(
        preset=a.preset, device=a.device, dtype=a.dtype, blocks=tuple(ints(a.blocks)) if a.blocks else None,
        steps=a.steps, seed=a.seed, budgets=[b.strip() for b in a.budgets.split(",") if b.strip()],
        residents=None if a.residents == "auto" else ints(a.residents), prefetch=ints(a.prefetch),
        policies=[p.strip() for p in a.policies.split(",") if p.strip()],
        out=Path(a.out) if a.out else None, plot=not a.no_plot, threads=a.threads, deadline_s=a.deadline_s,
        quiet=a.quiet, inference_mode=not a.no_inference_mode, formats=parse_formats(a.formats),
    )


def main(argv=None) -> int:
    """Runs each preset of ``--preset a,b,c`` in turn (one ComfyUI import); a failing preset does not stop the rest."""
    config = parse_args(argv)
    status = 0
    for preset in [p.strip() for p in config.preset.split(",") if p.strip()]:
        if config.formats:
            from .bench_formats import markdown, wan14b_table
            rows, skipped, _ = run_formats_bench(dataclasses.replace(config, preset=preset))
            print(markdown(rows, skipped) + "\n" + wan14b_table(config.formats), flush=True)
            status = status or int(any(r["error"] or not r["bitwise_equal"] for r in rows))
            continue
        try:
            result = run_bench(dataclasses.replace(config, preset=preset))
        except Exception:  # noqa: BLE001 - report and go on with the next preset
            import traceback
            traceback.print_exc()
            print(f"[comfy-bench] preset {preset} failed", file=sys.stderr, flush=True)
            status = 2
            continue
        print_result(result)
        bad = [r for r in result.rows if not r["bitwise_equal"]]
        if bad:
            print(f"[comfy-bench] {preset}: {len(bad)} run(s) differ bitwise from the full load", file=sys.stderr)
            status = status or 1
        gc.collect()
    return status


if __name__ == "__main__":
    sys.exit(main())
