"""The steps of the one-call GPU run (bench/gpu_run.sh; docs/gpu_run.md has the plan), one process each; every row
goes to a CSV as it is measured.

    python -P bench/gpu_steps.py preflight  --out DIR --work W
    python -P bench/gpu_steps.py sidebyside --out DIR --work W --preset flux [--lowvram] [--sweep]
    python -P bench/gpu_steps.py lora|fp8   --out DIR --work W        (fp8: ComfyUI 0.33.0 with comfy-kitchen)
    python -P bench/gpu_steps.py dynamic    --out DIR --work W --preset flux   (ComfyUI 0.33.0's dynamic VRAM)
    ... --dry-run: the same code on the CPU loopback at the tiny presets (no ballast, no registration timing)

``sidebyside``: the full load (the reference; per-block compute from CUDA events, per-block copies of registered
memory), then at each budget B (fractions f: non-block weights + f x the blocks + the full load's activation peak
+ 1.5 GiB, held free by a ``Ballast``) ComfyUI's own offloading (``--lowvram``) and this pack at its defaults, then
(``--sweep``) every resident count 0..N in steps (:func:`sweep_counts`), with the whole device and the node's
defaults for policy and prefetch, each beside the timing model's prediction for the setting that ran (the replay of
offload/timing/ fed this GPU's measured per-block compute and copy rate) and with its per-block CUDA-event
timeline (``timeline.csv``). ``<work>/state/`` hands the reference and budgets to the 0.33.0 ``dynamic`` process,
which starts comfy-aimdo in ComfyUI's order (its state is global: a process of its own) and counts the bytes dynamic
VRAM really moves (bench/gpu_dynamic.py). The harness every ComfyUI step measures with is bench/gpu_harness.py, the
tables it writes bench/gpu_tables.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import List

AIMDO_BEFORE_TORCH = None
if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())
    if sys.argv[1:2] == ["dynamic"]:
        # ComfyUI's main.py loads aimdo's library before anything imports torch; so does the dynamic step.
        import comfy_aimdo.control
        try:
            AIMDO_BEFORE_TORCH = "torch" not in sys.modules and bool(
                comfy_aimdo.control.init(simple_vram_headroom=None, nvml_pressure=True))
        except TypeError:  # comfy-aimdo 0.4.9's protocol
            AIMDO_BEFORE_TORCH = "torch" not in sys.modules and bool(comfy_aimdo.control.init())
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ""

import torch  # noqa: E402

from .gpu_dynamic import dynamic  # noqa: E402
from .gpu_harness import AUTO_POLICY, WEIGHTS_POLICY, log, make_harness  # noqa: E402
from .gpu_tables import TABLES, State, Table  # noqa: E402
from .measure import (CPU_LOOPBACK_ENV, block_lora, comfyui_version, copy_seconds, page_aligned_host,  # noqa: E402
                      with_lora)
from ..devtools import comfy_env  # noqa: E402

DRY_PRESETS = {"flux": "tiny", "wan21_14b": "tiny_wan"}  # what a dry run builds in a preset's place


# ----------------------------------------------------------------------------------------------- preflight
def resident_copy(nbytes: int, device: torch.device) -> dict:
    """A resident's copy as arming does it: pageable host memory through the page-locked bounce ring, queued on a
    copy stream; GB/s to the copy's end, the seconds the host was held, and register + unregister s per GiB."""
    # Looks inside: the preflight times the manager's own copy machinery, which has no public handle.
    from ..offload.device.backend import StreamBackend
    from ..offload.device.resident_copy import bounce_for
    from ..offload.memory.pinning import CudaHostRegisterPinner
    src = page_aligned_host(nbytes)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    backend = StreamBackend(device, measure_time=False)
    pinner = CudaHostRegisterPinner()
    started = time.perf_counter()
    granted = pinner.register(src)
    if granted:
        pinner.unregister(src)
    register_s = (time.perf_counter() - started) * (1 << 30) / nbytes if granted else ""
    bounce = bounce_for(pinner)
    if bounce is None:
        raise RuntimeError("the bounce ring could not be page-locked")
    try:
        torch.cuda.synchronize()
        started = time.perf_counter()
        handle = bounce.copy(backend, dst, src)
        host_s = time.perf_counter() - started
        handle.done.synchronize()
        total_s = time.perf_counter() - started
    finally:
        bounce.close()
    if not torch.equal(dst[:: 1 << 20].cpu(), src[:: 1 << 20]):
        raise RuntimeError("the bounce copy did not arrive whole")
    return {"gbps": nbytes / total_s / 1e9, "host_s": host_s, "register_s": register_s}


def preflight(args, tables, state) -> int:
    from . import bench_engine
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    cuda = device.type == "cuda"

    def add(name, value, unit="", note=""):
        tables["preflight"].add(comfyui="none", name=name, value=value, unit=unit, note=note)

    def failed(error):
        return f"{type(error).__name__}: {error}"[:200]

    add("torch", torch.__version__, note=f"cuda {torch.version.cuda}")
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        add("gpu", torch.cuda.get_device_name(device), note=f"{total} B")
    nbytes = (1 << 30) if cuda else (16 << 20)
    gbps = {}
    for kind in ("registered", "pinned", "pageable"):
        try:
            gbps[kind] = nbytes / copy_seconds(nbytes, device, kind) / 1e9
            add(f"h2d_gbps_{kind}", gbps[kind], "GB/s",
                f"{nbytes} B, median of 5" + ("" if cuda else ", CPU: host copy"))
        except Exception as error:  # noqa: BLE001 - a refused kind is a result
            add(f"h2d_gbps_{kind}", "", "GB/s", failed(error))
    state.save("preflight", {"gbps": gbps.get("registered") or gbps.get("pinned") or 0.0})
    if not cuda:
        add("h2d_gbps_resident_bounce", "", "GB/s", "dry run: needs CUDA")
        add("stale_cuda_error_after_refusal", "", "cudaError", "dry run: needs CUDA")
    else:
        try:
            resident = resident_copy(nbytes, device)
            add("h2d_gbps_resident_bounce", resident["gbps"], "GB/s", f"{nbytes} B pageable through the 2 x 32 MiB "
                f"page-locked ring (offload/device/resident_copy.py), host blocked {resident['host_s']:.3f} s")
            add("register_s_per_gib", resident["register_s"], "s", "cudaHostRegister + Unregister of 1 GiB: what a "
                "change of the streamed set pays per GiB of blocks whose membership changed")
        except Exception as error:  # noqa: BLE001 - a refused ring is a result
            add("h2d_gbps_resident_bounce", "", "GB/s", failed(error))
        # A refused registration (the same pages twice) must leave no error behind for the next kernel launch.
        from ..offload.memory.pinning import CudaHostRegisterPinner, _runtime_last_error  # looks inside, as above
        pinner, buf = CudaHostRegisterPinner(), page_aligned_host(1 << 20)
        first, second = pinner.register(buf), pinner.register(buf)
        reader = _runtime_last_error()  # torch's cudart bindings have no cudaGetLastError
        left = int(reader()) if reader is not None else "n/a: libcudart not reachable"
        try:
            torch.ones(4, device=device).add_(1).sum().item()
            launch = "ok"
        except Exception as error:  # noqa: BLE001
            launch = failed(error)[:150]
        if first:
            pinner.unregister(buf)
        add("stale_cuda_error_after_refusal", left, "cudaError",
            f"register {first}, again {second}; next kernel {launch}")
    hooks = bench_engine.bench_hooks(device, num_blocks=48, repeats=7 if cuda else 3, inner=20 if cuda else 2)
    for key in ("manager_overhead_us_per_block", "noop_hook_overhead_us_per_block", "manager_logic_us_per_block",
                "bare_us_per_block"):
        add(f"hooks_{key}", hooks[key], "us", "48 tiny blocks, all resident (bench/bench_engine.py)")
    return 0


# ----------------------------------------------------------------------------------------------- the ComfyUI steps
def sweep_counts(num_blocks: int, runs: int = 7) -> List[int]:
    """Resident counts 0..N in even steps (at most ``runs``, N always), ends first and then the middles of what is
    left, so a step cut by its cap still spans the whole range."""
    step = max(1, -(-num_blocks // max(1, runs - 1)))
    counts = sorted(set(range(0, num_blocks, step)) | {num_blocks})
    order, spans = [counts[0]] + ([counts[-1]] if len(counts) > 1 else []), [(0, len(counts) - 1)]
    while spans:
        a, b = spans.pop(0)
        if b - a >= 2:
            m = (a + b) // 2
            order.append(counts[m])
            spans += [(a, m), (m, b)]
    return order


def sidebyside(args, tables, state) -> int:
    h = make_harness(args, state, tables)
    try:
        h.full(per_block=True, state=state)
        budgets = h.budgets_for(args.budgets)
        for label, budget in budgets:
            if args.lowvram:
                h.comfy_lowvram(label, budget)
            h.layerwise(-1, 1, AUTO_POLICY, label, budget, mode="layerwise_auto")  # the node's defaults
            if args.weights:  # the fewest bytes a step at this budget, and what it costs against auto and ComfyUI
                h.layerwise(-1, 1, WEIGHTS_POLICY, label, budget, mode="layerwise_weights")
        if args.sweep:  # the whole device: every count fits, whatever the budgets allow
            for resident in sweep_counts(len(h.block_nbytes)):
                h.layerwise(resident, 1, AUTO_POLICY, "device", None, mode="sweep", ballast=False, timeline=True)
        state.save(f"{h.comfyui}_{h.config.preset}_auto", h.auto_ms)
    finally:
        h.teardown()
    return 0


def lora(args, tables, state) -> int:
    h = make_harness(args, state, tables, blocks=None if args.dry_run else (4,))
    try:
        base = h.patcher
        h.full()
        h.patcher = with_lora(base, block_lora(base, rank=16))
        h.full(mode="full_lora")
        if torch.equal(h.references["full"], h.references["full_lora"]):
            raise RuntimeError("[layerwise-offload] the LoRA changed nothing: the LoRA rows would compare nothing")
        h.layerwise(0, 1, "leading", "", 0, mode="layerwise_lora", ballast=False)
        h.patcher, h.reference, h.compute_ms = base, h.references["full"], h.computes["full"]
        h.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False)
    finally:
        h.teardown()
    return 0


def fp8(args, tables, state) -> int:
    """bf16 and ComfyUI's fp8 mixed precision (QuantizedTensor; comfy-kitchen's kernels on 0.33.0): bytes streamed
    and step time, each against its own full load. Outside inference_mode: QuantizedTensor weights fail under it."""
    import tempfile
    from ..devtools.quantized_models import save_fp8_mixed
    blocks = None if args.dry_run else (4,)
    h = make_harness(args, state, tables, inference_mode=False, blocks=blocks)
    with tempfile.TemporaryDirectory(prefix="lwo_fp8_", dir=args.work) as tmp:
        try:
            sd = {k: v.detach().to("cpu", copy=True) for k, v in h.diffusion_model.state_dict().items()}
            h.full()
            h.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False)
        finally:
            h.teardown()
        path = save_fp8_mixed(sd, Path(tmp) / "fp8_mixed.safetensors", "gpu run fp8")
        del sd, h
        gc.collect()
        import comfy.sd
        q = make_harness(args, state, tables, inference_mode=False, blocks=blocks,
                         load=lambda: comfy.sd.load_diffusion_model(path))
        try:
            q.full(weights="fp8_mixed")
            q.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False, weights="fp8_mixed")
        finally:
            q.teardown()
    return 0


def smoke(args, tables, state) -> int:
    """The engine's CUDA path on the tiny preset, a few settings, each bitwise against the full load. gpu_run.sh runs
    it under ``TORCH_CUDA_SANITIZER=1``: torch's stream sanitizer then checks every kernel's reads and writes against
    the streams' events and synchronisations, and a race fails the row."""
    sanitizer = getattr(getattr(torch.cuda, "_sanitizer", None), "cuda_sanitizer", None)
    enabled = bool(getattr(sanitizer, "enabled", False))
    tables["preflight"].add(comfyui="none", name="smoke_cuda_sanitizer", value=enabled, unit="",
                            note=f"TORCH_CUDA_SANITIZER={os.environ.get('TORCH_CUDA_SANITIZER', '')!r}")
    h = make_harness(args, state, tables)
    try:
        h.full()
        for resident, prefetch, policy in ((0, 1, "leading"), (1, 2, "strided"), (-1, 1, AUTO_POLICY)):
            h.layerwise(resident, prefetch, policy, "device", None, mode="smoke", ballast=False)
    finally:
        h.teardown()
    return 0


STEPS = {"preflight": preflight, "smoke": smoke, "sidebyside": sidebyside, "lora": lora, "fp8": fp8,
         "dynamic": dynamic}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--out", required=True, help="folder of the CSVs (rows appended as measured)")
    parser.add_argument("--work", required=True, help="scratch folder; <work>/state links the steps")
    parser.add_argument("--preset", default="flux")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps per run (>= 3; step 1 is warm-up)")
    parser.add_argument("--budgets", default="0.6,0.3", help="fractions of the blocks' bytes (largest first)")
    parser.add_argument("--lowvram", action="store_true", help="also ComfyUI's own partial loading per budget")
    parser.add_argument("--sweep", action="store_true", help="also fixed resident counts at the smallest budget")
    parser.add_argument("--weights", action="store_true", help="also residency_policy weights per budget")
    parser.add_argument("--takeover", action="store_true",
                        help="dynamic: also the node taking the dynamic model over, at the smallest budget")
    parser.add_argument("--name", default="", help="the step's name in the CSVs (default: the step)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.step_name = args.name or args.step
    if args.dry_run:
        args.preset = DRY_PRESETS.get(args.preset, args.preset)
        args.steps = 3
        args.budgets = args.budgets.split(",")[-1]  # one budget walks the same code as two, in half the time
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tables = {name: Table(Path(args.out), name) for name in TABLES}  # every header exists from the first step on
    state = State(Path(args.work))
    started = time.perf_counter()
    if args.step not in ("preflight", "dynamic"):
        comfy_env.import_comfyui(cpu=args.dry_run, import_nodes=False)
        # ComfyUI's import leaves millions of objects that live as long as the step; frozen, the full collection
        # between modes (Harness._fresh) skips them: 0.45 s -> a few ms each, 15 times a step.
        gc.freeze()
    if args.dry_run and args.step != "dynamic":
        os.environ[CPU_LOOPBACK_ENV] = "1"  # the node's real path on the CPU
    if args.step == "dynamic":
        log(f"comfy-aimdo init() before torch was imported: {AIMDO_BEFORE_TORCH}")
    status = STEPS[args.step](args, tables, state)
    log(f"{'dry run: ' if args.dry_run else ''}step {args.step_name} ({args.step}, {args.preset}, ComfyUI "
        f"{comfyui_version()}) done in {time.perf_counter() - started:.1f} s, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
