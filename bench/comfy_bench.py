"""Side-by-side benchmark inside the real ComfyUI (in-process): full load, ComfyUI's own partial loading,
and this pack's layerwise offload, at the same VRAM budgets.

    python -P bench/comfy_bench.py --preset flux --device cuda --out bench/results/gpu
    python -P bench/comfy_bench.py --preset flux,wan21_14b,qwen_image --device cuda --deadline-s 90 --out DIR
    python -P bench/comfy_bench.py --preset tiny --device cpu --steps 10 --budgets 0.6,0.75,0.9 --out bench/results
    (the last one is the committed CPU proxy; bench/gpu_run.sh is the one-call GPU run)
    python -P bench/comfy_bench.py --preset wan21_14b --blocks 4 --formats bf16,fp8_mixed,gguf_q4_0 --residents 0,2
    (weight formats side by side: bench_formats.py)

Budgets (``--budgets``, default 0.3,0.5,0.7,0.9): a fraction f means the non-block weights plus f times the blocks'
bytes; a size (12GiB, 800MiB) is taken as is. B is a budget for WEIGHTS on the device (what ComfyUI's
``lowvram_model_memory`` means); activations come on top in every mode.

Model: a DiT built from ComfyUI's own classes (``bench/dit_presets.py``) with random weights, real-size blocks
but fewer of them, bf16 on a GPU (float32 for the ``tiny`` CPU preset).

Modes (all sample the same latent with the same noise, Euler, ``--steps`` steps, through ``comfy.sample.sample``,
the function the KSampler node calls, so ComfyUI's ``load_models_gpu`` places the weights every time):

``full``           (a) everything resident: ComfyUI's own full load.
``comfy_lowvram``  (b) ComfyUI's partial loading ("lowvram") at each budget B: ``load_models_gpu`` runs as usual
                   but hands ``LoadedModel.model_load`` the weight budget B instead of the number its free-memory
                   heuristic computed (see :func:`comfy_weight_budget` for why this hook and not a faked
                   ``get_free_memory``). ``ModelPatcher.partially_load`` -> ``load()`` then picks what stays on the
                   device (largest modules first) and marks the rest lowvram, which ``comfy.ops`` casts to the
                   device on every forward. On the CPU ComfyUI never does this on its own; the same hook drives it
                   there too (weights are "cast" onto the device they already live on, so nothing moves).
``layerwise``      (c) this pack's node (``offload_model``) for each resident count x prefetch x policy of the
                   sweep. Its footprint (``model_size()``: non-block weights + resident blocks + prefetch slots)
                   is compared with each budget: the ``fits_budgets`` column, and the per-budget summary picks the
                   fastest configuration that fits. On the CPU it runs the CPU loopback
                   (LAYERWISE_OFFLOAD_CPU_LOOPBACK=1, set only while the benchmark runs).
``layerwise_auto`` the node with resident_layers=-1 (auto) at each budget B, with B handed to it the same way as to
                   ComfyUI's lowvram (the node caps its residents to ComfyUI's budget). Skipped, with a note, when the
                   node does not accept -1.

Every run samples under ``torch.inference_mode()`` like ComfyUI's executor (``--no-inference-mode`` to turn it off).
A run that raises becomes a row with ``error`` set; the sweep goes on.

Measured per run (one sampling of ``--steps`` steps; step 1 absorbs loading, arming and warm-up, so the step time
is the median of the ``steps - 1`` intervals between the sampler's per-step callbacks, CUDA events on a GPU,
``perf_counter`` on the CPU):

- ``step_ms``: median step time (``step_ms_spread``: max - min of the intervals). ``forwards_per_step``:
  diffusion-model forwards per step (cfg 1 runs one; cfg > 1 runs cond and uncond, batched into one forward when
  memory allows).
- ``weights_device_bytes``: weight bytes ComfyUI / the manager hold on the device (full: ``loaded_size()``;
  comfy_lowvram: ``loaded_size()`` + the cast buffer ComfyUI reserved; layerwise: non-block weights + the
  manager's resident buffers and slots). ``peak_alloc_bytes``: ``torch.cuda.max_memory_allocated`` over the run
  (weights + activations; GPU only).
- ``streamed_bytes_per_forward``: layerwise: the streamed blocks' bytes; comfy_lowvram: the bytes of the modules
  ComfyUI left lowvram (cast every forward). ``h2d_bytes_per_step``: bytes actually copied host-to-device per step
  (layerwise: the manager's counters; comfy_lowvram: counted in ``comfy.ops.cast_bias_weight`` for lowvram
  modules), so it equals ``streamed_bytes_per_forward * forwards_per_step``.
- ``stall_ms_per_step``: time compute waited for copies (the manager's stats; on the CPU loopback every copy is
  a stall). ``copy_gbps``: the manager's achieved copy rate.
- ``h2d_gbps``: host-to-device bandwidth measured in the same run: a pinned host -> device copy of one
  block-sized buffer (a plain ``copy_`` on the CPU). ``bound_ms`` = max(full-load step time,
  h2d_bytes_per_step / h2d_gbps): what a perfect overlap of copies and compute would give.
- ``bitwise_equal``: the output latent is bit-for-bit the full-load output.

Outputs: a printed table, ``<out>/comfy_bench_<preset>_<device>.csv`` (every run), ``..._summary.csv`` (one row per
budget: ComfyUI's point against the fastest fitting layerwise configuration), ``..._meta.json`` (versions,
sizes) and ``..._plot.png`` (step time against resident count, with the bound and ComfyUI's point at each budget;
needs matplotlib, skipped with a message otherwise).

Where things are: this file is the command line and ``run_bench``; ``bench_config.py`` holds the settings, the
result and the table columns; ``dit_presets.py`` the models (presets); ``bench_modes.py`` the modes and the
sweep (``Harness``); ``bench_measure.py`` the byte accounting, ComfyUI hooks, step clock and bandwidth probe;
``bench_report.py`` the printed tables, CSV / JSON files and the plot.

On the CPU the absolute times mean nothing (no PCIe, two cores shared with other work): the CPU run checks the
harness and the accounting. Real numbers come from a GPU (``bench/gpu_run.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_NAME = "layerwise_offload"


def _comfy_env():
    """devtools/comfy_env.py, loaded by path (it has no relative imports), with the pack registered."""
    module = sys.modules.get(f"{PACK_NAME}.devtools.comfy_env")
    if module is None:
        spec = importlib.util.spec_from_file_location("_lwo_bench_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    module.register_pack()
    return module


_comfy_env()  # run as a script, the pack's modules import as `layerwise_offload.*` from here on

from layerwise_offload.bench.bench_config import (  # noqa: E402  (after the pack is registered)
    COLUMNS, CPU_LOOPBACK_ENV, DTYPES, MODES, SUMMARY_COLUMNS, BenchConfig, BenchResult)
from layerwise_offload.bench.bench_formats import (  # noqa: E402
    check_preset, gguf_missing, markdown, parse_formats, run_formats, write_format_outputs)
from layerwise_offload.bench.bench_modes import Harness  # noqa: E402
from layerwise_offload.bench.bench_report import print_result, write_outputs  # noqa: E402

__all__ = ["COLUMNS", "SUMMARY_COLUMNS", "MODES", "CPU_LOOPBACK_ENV", "BenchConfig", "BenchResult", "run_bench",
           "parse_args", "main"]


@contextlib.contextmanager
def _env(name: str, value: Optional[str]):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def _cpu_threads(device: str, threads: Optional[int]):
    """One torch thread on the CPU by default: two cores shared with other work make multi-threaded
    timings swing by 10x; GPU runs keep torch's setting."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_bench(config: BenchConfig) -> BenchResult:
    """Run every mode, write the CSVs / meta / plot under ``config.out`` (if given), return the result."""
    harness = Harness(config)
    # On the CPU the node passes the model through unless the CPU loopback is asked for; set it for this run only.
    cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    with _cpu_threads(config.device, config.threads), _env(CPU_LOOPBACK_ENV, "1" if cpu else None):
        try:
            harness.setup()
            result = harness.run()
        finally:
            harness.teardown()
    if config.out is not None:
        result.files = write_outputs(result, Path(config.out))
    return result


def run_formats_bench(config: BenchConfig):
    """The weight-format comparison (bench_formats.py) for ``config.preset``, bf16 unless ``--dtype`` says
    otherwise; writes its CSV / Markdown under ``config.out``. Returns (rows, skipped lines, files).

    Every format samples outside ``torch.inference_mode()``: under it, ComfyUI's own ``QuantizedTensor`` weights
    fail before the first step (0.3.75 and 0.14.1, without this pack: ``Cannot set version_counter for inference
    tensor`` from ``module_size`` / ``Parameter.__new__`` detaching them)."""
    config = dataclasses.replace(config, dtype=config.dtype or "bf16", budgets=(), plot=False, inference_mode=False)
    log = (lambda *a: None) if config.quiet else (lambda *a: print("[comfy-bench]", *a, flush=True))
    cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    with _cpu_threads(config.device, config.threads), _env(CPU_LOOPBACK_ENV, "1" if cpu else None):
        rows, skipped = run_formats(config, log)
    files = write_format_outputs(rows, skipped, config, "cpu" if cpu else "cuda") if config.out is not None else {}
    return rows, skipped, files


# ----------------------------------------------------------------------------------------------- CLI
def _ints(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv=None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny",
                        help="flux | wan21_14b | qwen_image | tiny (default tiny); several: flux,wan21_14b")
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
    parser.add_argument("--formats", default="", help="compare weight formats instead (bench_formats.py): "
                        "bf16,fp8_mixed,gguf_q4_0 (Wan presets); with --residents for the node's runs")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="import ComfyUI on the CPU and check the presets resolve; run nothing")
    a = parser.parse_args(argv)
    blocks = tuple(_ints(a.blocks)) if a.blocks else None
    return BenchConfig(
        preset=a.preset, device=a.device, dtype=a.dtype, blocks=blocks, steps=a.steps, seed=a.seed,
        budgets=[b.strip() for b in a.budgets.split(",") if b.strip()],
        residents=None if a.residents == "auto" else _ints(a.residents), prefetch=_ints(a.prefetch),
        policies=[p.strip() for p in a.policies.split(",") if p.strip()],
        out=Path(a.out) if a.out else None, plot=not a.no_plot, threads=a.threads, deadline_s=a.deadline_s,
        quiet=a.quiet, inference_mode=not a.no_inference_mode, formats=parse_formats(a.formats),
    )


def dry_run(config: BenchConfig) -> int:
    """Everything before the first CUDA call: ComfyUI imports (on the CPU) and every preset resolves."""
    env = _comfy_env().import_comfyui(cpu=True, import_nodes=False)
    from layerwise_offload.bench import dit_presets
    for preset in [p.strip() for p in config.preset.split(",") if p.strip()]:
        print(f"[comfy-bench] dry run: preset {preset} resolves to "
              f"{dit_presets.check_resolves(preset, env.supported_models)} in ComfyUI at {env.path}", flush=True)
        if config.formats:
            check_preset(preset)
            why = gguf_missing() if "gguf_q4_0" in config.formats else ""
            print(f"[comfy-bench] dry run: formats {','.join(config.formats)} of {preset}"
                  + (f"; gguf_q4_0 would be skipped: {why}" if why else "; ComfyUI-GGUF and gguf found"), flush=True)
    return 0


def main(argv=None) -> int:
    """Runs each preset of ``--preset a,b,c`` in turn (one ComfyUI import); a failing preset does not stop the rest."""
    _comfy_env()  # registers the pack so `layerwise_offload.bench...` imports work when run as a script
    argv = sys.argv[1:] if argv is None else list(argv)
    config = parse_args(argv)
    if "--dry-run" in argv:
        return dry_run(config)
    status = 0
    for preset in [p.strip() for p in config.preset.split(",") if p.strip()]:
        if config.formats:
            rows, skipped, _ = run_formats_bench(dataclasses.replace(config, preset=preset))
            print(markdown(rows, skipped), flush=True)
            bad = [r for r in rows if r["error"] or not r["bitwise_equal"]]
            status = status or (1 if bad else 0)
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
