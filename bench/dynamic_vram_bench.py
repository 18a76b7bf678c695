"""ComfyUI 0.14.1's own dynamic VRAM (comfy-aimdo) against this pack at its defaults, one mode per process.

    python -P bench/dynamic_vram_bench.py --mode full      --preset flux --out DIR   # the reference
    python -P bench/dynamic_vram_bench.py --mode dynamic   --preset flux --out DIR
    python -P bench/dynamic_vram_bench.py --mode layerwise --preset flux --out DIR [--limit-fraction 0.6]
    python -P bench/dynamic_vram_bench.py --compare DIR                                # the table
    python -P bench/dynamic_vram_bench.py --dry-run --preset flux,wan21_14b           # CPU: imports and checks only

Modes, each on a fresh process so that comfy-aimdo's global state never leaks into another mode:

``full``       a plain ``ModelPatcher`` with the whole model loaded: ComfyUI without dynamic VRAM.
``dynamic``    what ComfyUI 0.14.1 does when started with ``--fast dynamic_vram`` on NVIDIA: ``main.py``'s own
               activation steps (``comfy_aimdo.control.init_device``, ``CoreModelPatcher = ModelPatcherDynamic``,
               the aimdo allocator as a ``torch.cuda.MemPool`` around the sampling, as ``execution.py`` does per
               node), everything else at its defaults.
``layerwise``  this pack's node at its defaults (``resident_layers=-1``: auto) on the plain patcher; 0.14.1 without
               the flag loads models this way.

``--limit-fraction F`` makes ComfyUI believe only ``F`` x the model's weight bytes plus ComfyUI's own
``minimum_inference_memory`` are free, through ComfyUI's ``--reserve-vram`` setting (``EXTRA_RESERVED_VRAM``),
so the model no longer fits. Both ComfyUI's planning and this pack's auto plan read that setting. comfy-aimdo
sizes its own residency from the device and may not honour it: the row records ``torch.cuda.max_memory_allocated``
and the aimdo-reported loaded bytes so the reader sees what each mode really held.

Bitwise: ``layerwise`` is meant to equal ``full`` bit for bit (same weights, same kernels). ``dynamic`` casts the
weights per forward through ``comfy.ops``; with bf16 weights, bf16 compute and no LoRA the cast is a copy, so it is
expected to match too, but ComfyUI makes no such promise: the table reports what it found.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODES = ("full", "dynamic", "layerwise")
FIELDS = ("preset", "mode", "limit_fraction", "steps", "step_ms", "peak_alloc_bytes", "model_bytes",
          "loaded_bytes", "resident_blocks", "num_blocks", "bitwise_equal_full", "comfyui", "error")


def _comfy_env():
    spec = importlib.util.spec_from_file_location("_lwo_dyn_comfy_env", HERE.parent / "devtools" / "comfy_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register_pack()
    return module


def import_comfy(mode: str, cpu: bool):
    """ComfyUI in this process; for ``dynamic`` the flag is set before ``comfy.model_management`` is imported."""
    env = _comfy_env()
    comfy_dir = env.comfyui_path()
    sys.path.insert(0, str(comfy_dir))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    if mode == "dynamic":
        comfy.cli_args.args.fast = {comfy.cli_args.PerformanceFeature.DynamicVRAM}
    return env.import_comfyui(cpu=cpu, import_nodes=False)


def activate_dynamic_vram(comfy_env) -> bool:
    """``main.py``'s activation of dynamic VRAM (ComfyUI 0.14.1), step for step."""
    import comfy.cli_args
    import comfy.memory_management
    import comfy_aimdo.control
    import comfy_aimdo.torch
    if not comfy.cli_args.enables_dynamic_vram():
        raise RuntimeError("dynamic VRAM is not enabled in comfy.cli_args (--fast dynamic_vram)")
    if not comfy_aimdo.control.init_device(comfy_env.model_management.get_torch_device().index):
        return False
    comfy_env.model_patcher.CoreModelPatcher = comfy_env.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_allocator = comfy_aimdo.torch.get_torch_allocator()
    return True


def check_versions(comfy_env) -> str:
    """What the dry run proves about 0.14.1: the version, and that the dynamic-VRAM pieces exist."""
    import comfy_aimdo.control  # noqa: F401  (import-time failure is what this checks)
    import comfy_aimdo.model_vbar  # noqa: F401
    import comfyui_version
    missing = [name for name in ("ModelPatcherDynamic", "CoreModelPatcher")
               if not hasattr(comfy_env.model_patcher, name)]
    if missing:
        raise RuntimeError(f"this ComfyUI has no {', '.join(missing)}: dynamic VRAM needs ComfyUI 0.14.1 or newer")
    try:
        import comfy_kitchen  # noqa: F401
        kitchen = "comfy_kitchen ok"
    except ImportError as error:
        kitchen = f"comfy_kitchen missing ({error})"
    return f"ComfyUI {comfyui_version.__version__}, comfy_aimdo ok, {kitchen}"


def build(preset_name: str, mode: str, comfy_env):
    from layerwise_offload.bench import dit_presets
    # CoreModelPatcher is ModelPatcherDynamic once activate_dynamic_vram ran, the plain ModelPatcher otherwise.
    patcher = dit_presets.build(preset_name, patcher_class=comfy_env.model_patcher.CoreModelPatcher)
    return dit_presets, patcher


def limit_free_memory(mm, patcher, fraction: float) -> None:
    """ComfyUI's ``--reserve-vram``, set so that ``fraction`` x the weights + the inference minimum are free."""
    total = mm.get_total_memory(mm.get_torch_device())
    keep_free = int(fraction * mm.module_size(patcher.model)) + int(mm.minimum_inference_memory())
    mm.EXTRA_RESERVED_VRAM = max(0, total - keep_free)


def run_mode(args) -> dict:
    cuda = args.device == "cuda"
    if not cuda:
        if args.mode == "dynamic":
            raise ValueError("dynamic VRAM needs an NVIDIA GPU (--device cuda)")
        os.environ["LAYERWISE_OFFLOAD_CPU_LOOPBACK"] = "1"  # the node's real path on the CPU, for checking this script
    env = import_comfy(args.mode, cpu=not cuda)
    mm = env.model_management
    if args.mode == "dynamic" and not activate_dynamic_vram(env):
        raise RuntimeError("comfy_aimdo.control.init_device failed: no working comfy-aimdo on this device")
    presets, patcher = build(args.preset, args.mode, env)
    if args.limit_fraction:
        limit_free_memory(mm, patcher, args.limit_fraction)
    model_bytes = mm.module_size(patcher.model)
    if args.mode == "layerwise":
        from layerwise_offload.nodes.offload_node import offload_model
        patcher = offload_model(patcher)  # every input at its default: auto residency
    from layerwise_offload.bench.bench_measure import StepClock
    clock = StepClock(cuda=cuda, on_first=lambda: None)
    allocator = getattr(sys.modules.get("comfy.memory_management"), "aimdo_allocator", None)
    pool = torch.cuda.use_mem_pool(torch.cuda.MemPool(allocator.allocator())) if allocator else contextlib.nullcontext()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode(), pool:
        out = presets.sample(patcher, args.preset, steps=args.steps, callback=clock)
    seconds = clock.step_seconds()
    controller = getattr(patcher, "attachments", {}).get("layerwise_offload")
    row = dict(preset=args.preset, mode=args.mode, limit_fraction=args.limit_fraction or "", steps=args.steps,
               step_ms=1e3 * sorted(seconds)[len(seconds) // 2] if seconds else "",
               peak_alloc_bytes=torch.cuda.max_memory_allocated() if cuda else "", model_bytes=model_bytes,
               loaded_bytes=patcher.loaded_size(), comfyui=str(env.path), error="",
               resident_blocks=controller.manager.resident_count() if controller else "",
               num_blocks=controller.manager.num_blocks if controller else "")
    stem = Path(args.out) / f"{args.preset}_{args.mode}_{args.limit_fraction or 'all'}"
    torch.save(out.cpu(), f"{stem}.pt")
    Path(f"{stem}.json").write_text(json.dumps(row))
    return row


def compare(out: Path) -> int:
    """One CSV + markdown table from the per-mode JSON rows, with bitwise equality against ``full``."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    from layerwise_offload.bench.bench_measure import bitwise_equal
    for row in rows:
        reference = out / f"{row['preset']}_full_all.pt"
        mine = out / f"{row['preset']}_{row['mode']}_{row['limit_fraction'] or 'all'}.pt"
        row["bitwise_equal_full"] = (bitwise_equal(torch.load(reference), torch.load(mine))
                                     if reference.exists() and mine.exists() else "")
    with open(out / "dynamic_vram.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    gib = lambda n: f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else ""
    lines = ["| preset | mode | free limit | ms/step | peak GiB | loaded GiB | resident | bitwise = full |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        step = f"{r['step_ms']:.1f}" if isinstance(r["step_ms"], float) else ""
        lines.append(f"| {r['preset']} | {r['mode']} | {r['limit_fraction'] or 'none'} | {step} | "
                     f"{gib(r['peak_alloc_bytes'])} | {gib(r['loaded_bytes'])} | "
                     f"{r['resident_blocks']}/{r['num_blocks']} | {r['bitwise_equal_full']} |")
    (out / "dynamic_vram.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def dry_run(presets) -> int:
    """Everything up to the first CUDA call: ComfyUI 0.14.1 and comfy-aimdo import, the presets resolve."""
    env = import_comfy("dynamic", cpu=True)
    print(f"[dynamic_vram_bench] dry run: {check_versions(env)} at {env.path}")
    from layerwise_offload.bench import dit_presets
    for name in presets:
        print(f"[dynamic_vram_bench] dry run: preset {name} resolves to "
              f"{dit_presets.check_resolves(name, env.supported_models)}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--preset", default="flux")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu runs full and layerwise on the CPU loopback, to check this script without a GPU")
    parser.add_argument("--limit-fraction", type=float, default=0.0)
    parser.add_argument("--out", default=str(HERE / "results" / "gpu" / "dynamic_vram"))
    parser.add_argument("--compare", default=None, help="folder of per-mode results to tabulate")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.compare:
        _comfy_env()
        return compare(Path(args.compare))
    if args.dry_run:
        return dry_run([p for p in args.preset.split(",") if p])
    if args.mode is None:
        parser.error("--mode is required (or --compare / --dry-run)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        row = run_mode(args)
    except Exception as error:  # noqa: BLE001 - a failing mode is a result; the next process goes on
        row = dict(preset=args.preset, mode=args.mode, limit_fraction=args.limit_fraction or "",
                   error=f"{type(error).__name__}: {error}"[:300])
        Path(args.out, f"{args.preset}_{args.mode}_{args.limit_fraction or 'all'}.json").write_text(json.dumps(row))
        print(f"[dynamic_vram_bench] {args.preset} {args.mode}: FAILED {row['error']}", flush=True)
        return 1
    peak = f"{row['peak_alloc_bytes'] / 2**30:.2f} GiB" if row["peak_alloc_bytes"] != "" else "-"
    print(f"[dynamic_vram_bench] {args.preset} {args.mode} limit {args.limit_fraction or 'none'}: "
          f"{row['step_ms']:.1f} ms/step, peak {peak}, resident {row['resident_blocks']}/{row['num_blocks']} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
