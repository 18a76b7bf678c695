"""The GPU run's dynamic-VRAM step (bench/gpu_steps.py dynamic, its own process on ComfyUI 0.33.0): comfy-aimdo
started in ComfyUI's order (its state is global), 0.33's dynamic VRAM at the budgets and against the reference the
0.33.0 side-by-side step left, the bytes it really moves (:class:`VbarCastCounter`), and the node taking the dynamic
model over (``--takeover``)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from typing import Callable, Tuple

import torch

from .gpu_harness import AUTO_POLICY, HEADROOM, log
from .gpu_tables import Ballast, DevicePeak, add_step, ratio
from .measure import CPU_LOOPBACK_ENV, StepClock, bitwise_equal, cast_bytes, comfyui_version, tensor_nbytes
from ..devtools import comfy_env


def aimdo_init(control) -> None:
    """main.py's first half (0.33.0): load aimdo's library before anything initialises CUDA, with main.py's
    arguments where this aimdo takes them (no --reserve-vram; NVML pressure unless --disable-nvml-pressure)."""
    try:
        started = control.init(simple_vram_headroom=None, nvml_pressure=True)
    except TypeError:  # comfy-aimdo 0.4.9's protocol, as main.py falls back to
        started = control.init()
    if not started:
        raise RuntimeError("comfy_aimdo.control.init() failed: aimdo's library does not load here")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ""  # cuda_malloc.py: aimdo and cudaMallocAsync exclude each other


def aimdo_init_device(control, index: int) -> None:
    """main.py's second half: aimdo takes the device (False, and every dynamic row fails, without init() first)."""
    try:
        taken = control.init_devices([(index, 0)])  # (device, --vram-headroom 0 GiB)
    except TypeError:
        taken = control.init_devices([index])
    if not taken:
        raise RuntimeError(f"comfy_aimdo.control.init_devices([{index}]) failed after init()")


def _import_dynamic(dry_run: bool):
    """ComfyUI 0.33.0 started as its main.py starts it on NVIDIA, where dynamic VRAM is the default: aimdo's
    library loaded (``init()``) before CUDA, then given the device, ``ModelPatcherDynamic`` made the
    ``CoreModelPatcher`` and ``comfy.memory_management.aimdo_enabled`` turned on."""
    comfy_dir = comfy_env.comfyui_path()
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    if not hasattr(comfy.cli_args, "enables_dynamic_vram"):
        raise RuntimeError(f"[layerwise-offload] the ComfyUI at {comfy_dir} has no default dynamic VRAM: the dynamic "
                           "step measures 0.33.0's (COMFYUI_PATH)")
    import comfy_aimdo.control
    aimdo_init(comfy_aimdo.control)  # before comfy.model_management, whose import initialises CUDA
    started = "init() ok; init_devices() needs a GPU (dry run)"
    env = comfy_env.import_comfyui(cpu=dry_run, import_nodes=False)
    gc.freeze()  # as main() does for the other steps: the collections between runs then skip what the import made
    if not dry_run:
        import comfy.memory_management
        index = env.model_management.get_torch_device().index or 0
        aimdo_init_device(comfy_aimdo.control, index)
        started = f"init() and init_devices([{index}]) ok"
        env.model_patcher.CoreModelPatcher = env.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    return env, started


@contextlib.contextmanager
def _node_scope():
    """execution.py's per-node scope (0.33.0): after the node, the cast buffers, the prefetch queues and the VBAR
    watermark limits reset."""
    import comfy.memory_management
    try:
        yield
    finally:
        if comfy.memory_management.aimdo_enabled:
            import comfy.model_management
            import comfy.model_prefetch
            import comfy_aimdo.model_vbar
            comfy.model_management.reset_cast_buffers()
            comfy.model_prefetch.cleanup_prefetch_queues()
            comfy_aimdo.model_vbar.vbars_reset_watermark_limits()


class VbarCastCounter:
    """The bytes ComfyUI 0.33's dynamic VRAM really moves. A module with VBAR pages (``_v``) is readied by
    ``comfy.ops.cast_modules_with_vbar`` (per module at its cast, or a block's modules at once where a model
    prefetches blocks): where aimdo's fault returns the signature the module was last cast with, its pages are still
    resident and nothing moves (``_prefetch["resident"]``); otherwise its weight and bias (aligned, as the copy
    moves them) and any LowVramPatch are copied. Those are counted in ``bytes``, the resident ones in
    ``resident_bytes``. Modules without VBAR pages are cast the classic way and counted as ``measure.CastCounter``
    counts them (a module on another device, or left lowvram). Both functions are looked up in ``comfy.ops`` at call
    time, so replacing them there sees every cast."""

    def __init__(self):
        self.bytes = 0
        self.resident_bytes = 0

    @staticmethod
    def _module_bytes(module) -> int:
        try:
            from comfy.memory_management import vram_aligned_size as aligned  # 0.33: the size the copy moves
        except ImportError:  # a ComfyUI without VBARs (0.3.75): what a test's stand-in moved
            aligned = None
        tensors = [module.weight, getattr(module, "bias", None)]
        if aligned is not None:
            return int(aligned(tensors))
        return sum(map(tensor_nbytes, tensors))

    @contextlib.contextmanager
    def installed(self):
        import comfy.ops

        vbar_cast = getattr(comfy.ops, "cast_modules_with_vbar", None)
        classic_cast = comfy.ops.cast_bias_weight

        def counting_vbar(comfy_modules, *args, **kwargs):
            out = vbar_cast(comfy_modules, *args, **kwargs)
            for module in comfy_modules:
                if (getattr(module, "_prefetch", None) or {}).get("resident"):
                    self.resident_bytes += self._module_bytes(module)
                    continue
                self.bytes += self._module_bytes(module)
                for key in ("weight", "bias"):
                    patch = getattr(module, key + "_lowvram_function", None)
                    if patch is not None:
                        self.bytes += int(patch.memory_required())
            return out

        def counting_classic(s, input=None, dtype=None, device=None, *args, **kwargs):
            if not hasattr(s, "_v"):  # a VBAR module is counted by counting_vbar, whatever its weight's device
                self.bytes += cast_bytes(s, input, device)
            return classic_cast(s, input, dtype, device, *args, **kwargs)

        comfy.ops.cast_bias_weight = counting_classic
        if vbar_cast is not None:
            comfy.ops.cast_modules_with_vbar = counting_vbar
        try:
            yield self
        finally:
            comfy.ops.cast_bias_weight = classic_cast
            if vbar_cast is not None:
                comfy.ops.cast_modules_with_vbar = vbar_cast


def dynamic(args, tables, state) -> int:
    """ComfyUI 0.33.0's dynamic VRAM at the budgets and against the reference the 0.33.0 side-by-side step left."""
    env, started = _import_dynamic(args.dry_run)
    log(f"comfy-aimdo: {started}")
    mm = env.model_management
    from ..devtools import dit_presets
    version = comfyui_version()
    saved = state.load(f"{version}_{args.preset}")
    if not saved:
        raise RuntimeError(f"[layerwise-offload] no {version}_{args.preset} in {state.folder}: the {version} "
                           "side-by-side step gives the reference and budgets; run it first")
    reference = torch.load(saved["reference"])
    auto_ms = state.load(f"{version}_{args.preset}_auto")  # this pack at auto, same budgets, same reference
    cuda = not args.dry_run
    device = mm.get_torch_device()
    dtype = torch.float32 if args.dry_run else None  # the side-by-side harness builds fp32 on the CPU too
    patcher = dit_presets.build(args.preset, dtype=dtype, patcher_class=env.model_patcher.CoreModelPatcher)
    kind = type(patcher).__name__
    extra = saved["act_reserve"] + (HEADROOM if cuda else 0)
    budgets = [("all", None)] + [(f"{float(f):g}", int(saved["non_block"] + float(f) * saved["block_total"] + extra))
                                 for f in args.budgets.split(",") if f.strip()]
    forwards = [0]

    def count_forwards(model):
        return model.get_model_object("diffusion_model").register_forward_pre_hook(
            lambda m, a: forwards.__setitem__(0, forwards[0] + 1))

    def row(mode: str, label: str, budget, run_patcher, moved: Callable[[], Tuple[int, int]], scope) -> None:
        """One sampling run at ``budget``: ``moved()`` reads (bytes streamed, bytes left resident) so far."""
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache()
        begun, error, seconds, snap = time.perf_counter(), "", [], {}
        clock = StepClock(cuda, on_first=lambda: snap.update(zip("fbr", (forwards[0], *moved()))))
        out = None
        with Ballast(device, budget) as ballast, DevicePeak(device) as peak:
            try:
                with _node_scope(), scope(), torch.inference_mode():
                    out = dit_presets.sample(run_patcher, args.preset, steps=args.steps, callback=clock)
                seconds = clock.step_seconds()
            except Exception as exc:  # noqa: BLE001 - a failing budget is a result
                import traceback
                traceback.print_exc()
                error = f"{type(exc).__name__}: {exc}"[:300]
        step_ms = 1e3 * sorted(seconds)[len(seconds) // 2] if seconds else ""
        intervals = max(1, args.steps - 1)
        streamed, resident = moved()
        add_step(
            tables["steps"], comfyui=version, step=args.step_name, preset=args.preset, mode=mode,
            weights=str(dtype or dit_presets.PRESETS[args.preset].dtype).replace("torch.", ""), budget=label,
            budget_bytes="" if budget is None else budget, ballast_bytes=ballast.nbytes,
            num_blocks=saved["num_blocks"], steps=args.steps,
            forwards_per_step=(forwards[0] - snap["f"]) / intervals if seconds else "",
            step_ms=step_ms, step_ms_spread=(max(seconds) - min(seconds)) * 1e3 if seconds else "",
            streamed_bytes_per_step=(streamed - snap["b"]) / intervals if seconds else "",
            resident_bytes_per_step=(resident - snap["r"]) / intervals if seconds else "",
            compute_ms=saved["compute_ms"], gbps=saved["gbps"],
            speedup_vs_comfy=ratio(step_ms, auto_ms.get(label)) if mode == "comfy_dynamic" else "",
            device_peak_bytes=peak.peak_bytes, weights_device_bytes=run_patcher.loaded_size(),
            bitwise_equal_full=bitwise_equal(out, reference) if out is not None else False,
            seconds=time.perf_counter() - begun, error=error or ("" if cuda else f"dry run: {kind} on the CPU"))
        log(f"{args.preset} {mode} budget {label}: {step_ms} ms/step {error}")

    hook = count_forwards(patcher)
    try:
        for label, budget in budgets:
            counter = VbarCastCounter()
            row("comfy_dynamic", label, budget, patcher, lambda: (counter.bytes, counter.resident_bytes),
                counter.installed)
        if args.takeover:
            takeover(args, patcher, budgets[-1], env, dtype, row, count_forwards)
    finally:
        hook.remove()
        mm.unload_all_models()
    return 0


def takeover(args, patcher, budget, env, dtype, row, count_forwards) -> None:
    """The node on the dynamic patcher, with comfy-aimdo started: it takes the model over as an ordinary model
    (``get_non_dynamic_delegate``, which reloads it through ``cached_patcher_init`` as a core loader's model is), and
    every device byte it allocates goes through aimdo's allocator hooks. The row's speed-up is over dynamic VRAM at
    the same budget."""
    from ..devtools import dit_presets
    from ..nodes.controller import offload_model
    if args.dry_run:
        os.environ[CPU_LOOPBACK_ENV] = "1"

    def reload(disable_dynamic=False):  # the preset is seeded: the same weights as the model it replaces
        kind = env.model_patcher.ModelPatcher if disable_dynamic else env.model_patcher.CoreModelPatcher
        return dit_presets.build(args.preset, dtype=dtype, patcher_class=kind)
    patcher.cached_patcher_init = (reload, ())
    label, nbytes = budget
    offloaded = offload_model(patcher, -1, 1, AUTO_POLICY, True)
    controller = offloaded.attachments.get("layerwise_offload")
    if controller is None:
        raise RuntimeError(f"[layerwise-offload] the node passed the dynamic model through: "
                           f"{offloaded.attachments}")

    def moved():
        stats = controller.manager.stats(synchronize=False)
        return stats.bytes_copied, 0
    hook = count_forwards(offloaded)
    try:
        row("layerwise_aimdo", label, nbytes, offloaded, moved, contextlib.nullcontext)
    finally:
        hook.remove()
