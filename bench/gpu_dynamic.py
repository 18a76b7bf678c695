"""ComfyUI 0.14.1's dynamic VRAM (comfy-aimdo), set up the way ComfyUI starts it, at the budgets and against the
reference that the 0.14.1 side-by-side step left in ``<work>/state`` (``bench/gpu_steps.py dynamic``).

ComfyUI's order, which this follows: ``cuda_malloc.py`` calls ``comfy_aimdo.control.init()`` (it loads aimdo's
library) and clears ``PYTORCH_CUDA_ALLOC_CONF`` before torch touches CUDA; ``main.py`` then calls
``init_device(index)``, makes ``ModelPatcherDynamic`` the ``CoreModelPatcher`` and installs aimdo's allocator;
``execution.py`` runs each node inside a ``torch.cuda.MemPool`` of that allocator and afterwards resets the cast
buffers and the VBAR watermarks. ``init_device`` without ``init`` returns False: every row would fail.
Its own process: aimdo's state is global and would leak into any other mode.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch

from .gpu_rows import Ballast, DevicePeak, bound_ms, ratio

__all__ = ["aimdo_init", "aimdo_init_device", "start_dynamic_vram", "run"]


def aimdo_init(control) -> None:
    """cuda_malloc.py's half: load aimdo's library, before anything initialises CUDA."""
    if not control.init():
        raise RuntimeError("comfy_aimdo.control.init() failed: aimdo's library does not load here")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ""  # cuda_malloc.py: aimdo and cudaMallocAsync exclude each other


def aimdo_init_device(control, index: int) -> None:
    """main.py's half: aimdo takes the device (False, and every dynamic row fails, without init() first)."""
    if not control.init_device(index):
        raise RuntimeError(f"comfy_aimdo.control.init_device({index}) failed after init()")


def start_dynamic_vram(control, index: int) -> str:
    """aimdo started as ComfyUI starts it. ``control`` is ``comfy_aimdo.control`` (a parameter: the order is
    checked without a GPU, tests/comfy/test_gpu_plan.py)."""
    aimdo_init(control)
    aimdo_init_device(control, index)
    return f"init() and init_device({index}) ok"


def _import(env, dry_run: bool):
    comfy_dir = env.comfyui_path()
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    comfy.cli_args.args.fast = {comfy.cli_args.PerformanceFeature.DynamicVRAM}
    import comfy_aimdo.control
    aimdo_init(comfy_aimdo.control)  # before comfy.model_management, whose import initialises CUDA
    started = "init() ok; init_device() needs a GPU (dry run)"
    comfy_env = env.import_comfyui(cpu=dry_run, import_nodes=False)
    gc.freeze()  # as gpu_steps does: the collections between runs then skip what the import made
    if not dry_run:
        import comfy.memory_management
        import comfy_aimdo.torch
        index = comfy_env.model_management.get_torch_device().index or 0
        aimdo_init_device(comfy_aimdo.control, index)
        started = f"init() and init_device({index}) ok"
        comfy_env.model_patcher.CoreModelPatcher = comfy_env.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_allocator = comfy_aimdo.torch.get_torch_allocator()
    return comfy_env, started


@contextlib.contextmanager
def _node_scope():
    """execution.py's per-node scope: aimdo's MemPool around the work, cast buffers and watermarks reset after."""
    import comfy.memory_management
    allocator = comfy.memory_management.aimdo_allocator
    if allocator is None:
        yield
        return
    import comfy.model_management
    import comfy_aimdo.model_vbar
    with torch.cuda.use_mem_pool(torch.cuda.MemPool(allocator.allocator())):
        try:
            yield
        finally:
            comfy.model_management.reset_cast_buffers()
            comfy_aimdo.model_vbar.vbars_reset_watermark_limits()


def run(args, tables, state, env) -> int:
    comfy_env, started = _import(env, args.dry_run)
    print(f"[gpu_steps] comfy-aimdo: {started}", flush=True)
    mm = comfy_env.model_management
    from . import dit_presets
    from .bench_measure import CastCounter, StepClock, bitwise_equal
    from .gpu_harness import HEADROOM, _version
    version = _version()
    saved = state.load(f"{version}_{args.preset}")
    if not saved:
        raise RuntimeError(f"[layerwise-offload] no {version}_{args.preset} in {state.folder}: the 0.14.1 "
                           "side-by-side step gives the reference and budgets; run it first")
    reference = torch.load(saved["reference"])
    auto_ms = state.load(f"{version}_{args.preset}_auto")  # this pack at auto, same budgets, same reference
    cuda = not args.dry_run
    device = mm.get_torch_device()
    dtype = torch.float32 if args.dry_run else None  # the side-by-side harness builds fp32 on the CPU too
    patcher = dit_presets.build(args.preset, dtype=dtype, patcher_class=comfy_env.model_patcher.CoreModelPatcher)
    kind = type(patcher).__name__
    extra = saved["act_reserve"] + (HEADROOM if cuda else 0)
    budgets = [("all", None)] + [(f"{float(f):g}", int(saved["non_block"] + float(f) * saved["block_total"] + extra))
                                 for f in args.budgets.split(",") if f.strip()]
    forwards = [0]
    hook = patcher.get_model_object("diffusion_model").register_forward_pre_hook(
        lambda m, a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        for label, budget in budgets:
            mm.unload_all_models()
            gc.collect()
            mm.soft_empty_cache()
            begun, error, seconds = time.perf_counter(), "", []
            counter, snap = CastCounter(), {}
            clock = StepClock(cuda=cuda, on_first=lambda: snap.update(f=forwards[0], b=counter.bytes))
            out = None
            with Ballast(device, budget) as ballast, DevicePeak(device) as peak:
                try:
                    with _node_scope(), counter.installed(), torch.inference_mode():
                        out = dit_presets.sample(patcher, args.preset, steps=args.steps, callback=clock)
                    seconds = clock.step_seconds()
                except Exception as exc:  # noqa: BLE001 - a failing budget is a result
                    import traceback
                    traceback.print_exc()
                    error = f"{type(exc).__name__}: {exc}"[:300]
            step_ms = 1e3 * sorted(seconds)[len(seconds) // 2] if seconds else ""
            intervals = max(1, args.steps - 1)
            streamed = (counter.bytes - snap["b"]) / intervals if seconds else ""
            bound = bound_ms(saved["compute_ms"], streamed or 0, saved["gbps"])
            tables["steps"].add(
                comfyui=version, step=args.step_name, preset=args.preset, mode="comfy_dynamic",
                weights=str(dtype or dit_presets.PRESETS[args.preset].dtype).replace("torch.", ""), budget=label,
                budget_bytes="" if budget is None else budget, ballast_bytes=ballast.nbytes,
                num_blocks=saved["num_blocks"], steps=args.steps,
                forwards_per_step=(forwards[0] - snap["f"]) / intervals if seconds else "",
                step_ms=step_ms, step_ms_spread=(max(seconds) - min(seconds)) * 1e3 if seconds else "",
                streamed_bytes_per_step=streamed, compute_ms=saved["compute_ms"], gbps=saved["gbps"],
                bound_ms=bound, ratio_to_bound=ratio(step_ms, bound),
                speedup_vs_comfy=ratio(step_ms, auto_ms.get(label)),
                device_peak_bytes=peak.peak_bytes,
                weights_device_bytes=patcher.loaded_size(),
                bitwise_equal_full=bitwise_equal(out, reference) if out is not None else False,
                seconds=time.perf_counter() - begun, error=error or ("" if cuda else f"dry run: {kind} on the CPU"))
            print(f"[gpu_steps] {args.preset} comfy_dynamic budget {label}: {step_ms} ms/step {error}", flush=True)
    finally:
        hook.remove()
        mm.unload_all_models()
    return 0
