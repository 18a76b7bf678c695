"""The steps of the one-call GPU run (bench/gpu_run.sh), one process each; every row goes to a CSV as it is measured.

    python -P bench/gpu_steps.py preflight  --out DIR --work W
    python -P bench/gpu_steps.py sidebyside --out DIR --work W --preset flux [--lowvram] [--sweep]
    python -P bench/gpu_steps.py lora       --out DIR --work W
    python -P bench/gpu_steps.py fp8        --out DIR --work W        (ComfyUI 0.14.1 with comfy-kitchen)
    python -P bench/gpu_steps.py dynamic    --out DIR --work W --preset flux   (bench/gpu_dynamic.py; 0.14.1)
    ... --dry-run: the same code on the CPU loopback at the tiny presets (no ballast, no registration timing)

``sidebyside``: ComfyUI's full load (the reference, per-block compute times from CUDA events, per-block copy
times of registered memory), then at each budget B (``--budgets``, fractions f: non-block weights + f x the
blocks + the full load's activation peak + 1.5 GiB, held free by a ``Ballast``) ComfyUI's own offloading
(``--lowvram``: 0.3.75 partial loading, its planner deciding from the real free memory) and this pack at auto,
then (``--sweep``) a few fixed resident counts at the smallest budget. The full run's numbers go to
``<work>/state/`` for the 0.14.1 dynamic-VRAM process, which compares with the same reference and budgets.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

AIMDO_BEFORE_TORCH = None
if __name__ == "__main__" and sys.argv[1:2] == ["dynamic"]:
    # ComfyUI's cuda_malloc.py loads aimdo's library before anything imports torch; so does the dynamic step.
    import comfy_aimdo.control
    AIMDO_BEFORE_TORCH = "torch" not in sys.modules and bool(comfy_aimdo.control.init())
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ""

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
DRY_PRESETS = {"flux": "tiny", "wan21_14b": "tiny_wan"}  # what a dry run builds in a preset's place
HEADROOM = 3 << 29  # 1.5 GiB: ComfyUI keeps minimum_inference_memory + reserved VRAM free on top of its estimate


def comfy_env():
    spec = importlib.util.spec_from_file_location("_lwo_gpu_comfy_env", HERE.parent / "devtools" / "comfy_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register_pack()
    return module


def comfyui_version() -> str:
    try:
        import comfyui_version as v
        return v.__version__
    except ImportError:
        return "none"


def log(*parts) -> None:
    print("[gpu_steps]", *parts, flush=True)


class State:
    """Numbers one process hands the next (the device run's ``<work>/state``): bandwidth, references, budgets."""

    def __init__(self, work: Path):
        self.folder = Path(work) / "state"
        self.folder.mkdir(parents=True, exist_ok=True)

    def save(self, name: str, data: dict) -> None:
        (self.folder / f"{name}.json").write_text(json.dumps(data))

    def load(self, name: str) -> dict:
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}


# ----------------------------------------------------------------------------------------------- copies
def page_aligned_host(nbytes: int) -> torch.Tensor:
    """A pageable host buffer that starts on a page and spans whole pages (registration locks whole pages)."""
    page = 4096
    size = -(-nbytes // page) * page
    raw = torch.empty(size + page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    return raw[start:start + size]


def copy_seconds(nbytes: int, device: torch.device, kind: str = "registered", repeats: int = 5) -> float:
    """Median seconds of one host -> device copy of ``nbytes`` from ``kind`` memory (registered | pinned |
    pageable); on the CPU a plain host copy."""
    if device.type != "cuda":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    from layerwise_offload.offload.host.pinning import CudaHostRegisterPinner
    pinner = CudaHostRegisterPinner()
    if kind == "pinned":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        src = page_aligned_host(nbytes)
        if kind == "registered" and not pinner.register(src):
            raise RuntimeError(f"cudaHostRegister refused {nbytes} bytes")
    src.fill_(1)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    try:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=kind != "pageable")
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    finally:
        torch.cuda.synchronize()
        if kind == "registered":
            pinner.unregister(src)
    return statistics.median(times)


def resident_copy(nbytes: int, device: torch.device) -> dict:
    """A resident's copy as arming does it: pageable host memory through the page-locked bounce ring, queued on a
    copy stream; GB/s to the copy's end, the seconds the host was held, and register + unregister s per GiB."""
    from layerwise_offload.offload.device.backend import StreamBackend
    from layerwise_offload.offload.host.pinning import CudaHostRegisterPinner
    from layerwise_offload.offload.device.resident_copy import bounce_for
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


# ----------------------------------------------------------------------------------------------- preflight
def preflight(args, tables, state) -> int:
    table = tables["preflight"]
    from layerwise_offload.bench import bench_engine
    from layerwise_offload.offload.host.pinning import CudaHostRegisterPinner
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    add = lambda name, value, unit="", note="": table.add(comfyui="none", name=name, value=value,  # noqa: E731
                                                          unit=unit, note=note)
    add("torch", torch.__version__, note=f"cuda {torch.version.cuda}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        add("gpu", torch.cuda.get_device_name(device), note=f"{total} B")
    nbytes = (1 << 30) if device.type == "cuda" else (16 << 20)
    gbps = {}
    for kind in ("registered", "pinned", "pageable"):
        try:
            gbps[kind] = nbytes / copy_seconds(nbytes, device, kind) / 1e9
            add(f"h2d_gbps_{kind}", gbps[kind], "GB/s", f"{nbytes} B, median of 5" + ("" if device.type == "cuda"
                                                                                     else ", CPU: host copy"))
        except Exception as error:  # noqa: BLE001 - a refused kind is a result
            add(f"h2d_gbps_{kind}", "", "GB/s", f"{type(error).__name__}: {error}"[:200])
    state.save("preflight", {"gbps": gbps.get("registered") or gbps.get("pinned") or 0.0})
    if device.type == "cuda":
        try:
            resident = resident_copy(nbytes, device)
            add("h2d_gbps_resident_bounce", resident["gbps"], "GB/s", f"{nbytes} B pageable through the 2 x 32 MiB "
                f"page-locked ring (offload/device/resident_copy.py), host blocked {resident['host_s']:.3f} s")
            add("register_s_per_gib", resident["register_s"], "s", "cudaHostRegister + Unregister of 1 GiB: what a "
                "change of the streamed set pays per GiB of blocks whose membership changed")
        except Exception as error:  # noqa: BLE001 - a refused ring is a result
            add("h2d_gbps_resident_bounce", "", "GB/s", f"{type(error).__name__}: {error}"[:200])
    else:
        add("h2d_gbps_resident_bounce", "", "GB/s", "dry run: needs CUDA")
    if device.type == "cuda":
        # A refused registration (the same pages twice) must leave no error behind for the next kernel launch.
        pinner, buf = CudaHostRegisterPinner(), page_aligned_host(1 << 20)
        first, second = pinner.register(buf), pinner.register(buf)
        from layerwise_offload.offload.host.pinning import _runtime_last_error
        reader = _runtime_last_error()  # torch's cudart bindings have no cudaGetLastError
        left = int(reader()) if reader is not None else "n/a: libcudart not reachable"
        try:
            torch.ones(4, device=device).add_(1).sum().item()
            launch = "ok"
        except Exception as error:  # noqa: BLE001
            launch = f"{type(error).__name__}: {error}"[:150]
        if first:
            pinner.unregister(buf)
        add("stale_cuda_error_after_refusal", left, "cudaError",
            f"register {first}, again {second}; next kernel {launch}")
    else:
        add("stale_cuda_error_after_refusal", "", "cudaError", "dry run: needs CUDA")
    hooks = bench_engine.bench_hooks(device, num_blocks=48, repeats=7 if device.type == "cuda" else 3,
                                     inner=20 if device.type == "cuda" else 2)
    for key in ("manager_overhead_us_per_block", "noop_hook_overhead_us_per_block", "manager_logic_us_per_block",
                "bare_us_per_block"):
        add(f"hooks_{key}", hooks[key], "us", "48 tiny blocks, all resident (bench/bench_engine.py)")
    return 0


# ----------------------------------------------------------------------------------------------- side by side
def make_harness(args, preset: str, inference_mode: bool = True, blocks=None):
    from layerwise_offload.bench.bench_config import BenchConfig
    from layerwise_offload.bench.gpu_harness import GpuHarness
    config = BenchConfig(preset=preset, device="cpu" if args.dry_run else "cuda", steps=args.steps,
                         blocks=blocks, budgets=(), plot=False, inference_mode=inference_mode)
    return config, GpuHarness


def sidebyside(args, tables, state) -> int:
    config, GpuHarness = make_harness(args, args.preset)
    h = GpuHarness(config, tables, step=args.step_name, gbps=state.load("preflight").get("gbps", 0.0))
    h.setup()
    try:
        h.full(per_block=True, state=state)
        budgets = h.budgets_for(args.budgets)
        for label, budget in budgets:
            if args.lowvram:
                h.comfy_lowvram(label, budget)
            h.layerwise(-1, 1, "leading", label, budget, mode="layerwise_auto")
        if args.sweep and budgets:
            label, budget = budgets[-1]
            for resident, prefetch in h.sweep_configs(budget):
                h.layerwise(resident, prefetch, "leading", label, budget, mode="layerwise")
        state.save(f"{h.comfyui}_{h.config.preset}_auto", h.auto_ms)
    finally:
        h.teardown()
    return 0


def lora(args, tables, state) -> int:
    config, GpuHarness = make_harness(args, args.preset, blocks=None if args.dry_run else (4,))
    h = GpuHarness(config, tables, step=args.step_name, gbps=state.load("preflight").get("gbps", 0.0))
    h.setup()
    try:
        base = h.patcher
        h.full()
        h.patcher = h.with_lora(base, rank=16)
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
    """bf16 and ComfyUI's fp8 mixed precision (QuantizedTensor; comfy-kitchen's kernels on 0.14.1): bytes streamed
    and step time, each against its own full load. Outside inference_mode: QuantizedTensor weights fail under it."""
    import tempfile
    from layerwise_offload.devtools.quantized_models import save_fp8_mixed
    config, GpuHarness = make_harness(args, args.preset, inference_mode=False,
                                      blocks=None if args.dry_run else (4,))
    gbps = state.load("preflight").get("gbps", 0.0)
    h = GpuHarness(config, tables, step=args.step_name, gbps=gbps)
    h.setup()
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
        q = GpuHarness(config, tables, step=args.step_name, gbps=gbps, load=lambda: comfy.sd.load_diffusion_model(path))
        q.setup()
        try:
            q.full(weights="fp8_mixed")
            q.layerwise(0, 1, "leading", "", 0, mode="layerwise", ballast=False, weights="fp8_mixed")
        finally:
            q.teardown()
    return 0


STEPS = {"preflight": preflight, "sidebyside": sidebyside, "lora": lora, "fp8": fp8}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=sorted(STEPS) + ["dynamic"])
    parser.add_argument("--out", required=True, help="folder of the CSVs (rows appended as measured)")
    parser.add_argument("--work", required=True, help="scratch folder; <work>/state links the steps")
    parser.add_argument("--preset", default="flux")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps per run (>= 3; step 1 is warm-up)")
    parser.add_argument("--budgets", default="0.6,0.3", help="fractions of the blocks' bytes (largest first)")
    parser.add_argument("--lowvram", action="store_true", help="also ComfyUI's own partial loading per budget")
    parser.add_argument("--sweep", action="store_true", help="also fixed resident counts at the smallest budget")
    parser.add_argument("--name", default="", help="the step's name in the CSVs (default: the step)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    args.step_name = args.name or args.step
    if args.dry_run:
        args.preset = DRY_PRESETS.get(args.preset, args.preset)
        args.steps = 3
        args.budgets = args.budgets.split(",")[-1]  # one budget walks the same code as two, in half the time
    Path(args.out).mkdir(parents=True, exist_ok=True)
    env = comfy_env()
    from layerwise_offload.bench.gpu_rows import TABLES, Table
    tables = {name: Table(Path(args.out), name) for name in TABLES}  # every header exists from the first step on
    state = State(Path(args.work))
    started = time.perf_counter()
    if args.step == "dynamic":
        from layerwise_offload.bench import gpu_dynamic
        log(f"comfy-aimdo init() before torch was imported: {AIMDO_BEFORE_TORCH}")
        status = gpu_dynamic.run(args, tables, state, env)
    else:
        if args.step != "preflight":
            env.import_comfyui(cpu=args.dry_run, import_nodes=False)
            # ComfyUI's import leaves millions of objects that live as long as the step; frozen, the full
            # collection between modes (bench_modes._fresh) skips them: 0.45 s -> a few ms each, 15 times a step.
            gc.freeze()
        if args.dry_run:
            os.environ["LAYERWISE_OFFLOAD_CPU_LOOPBACK"] = "1"  # the node's real path on the CPU
        status = STEPS[args.step](args, tables, state)
    log(f"{'dry run: ' if args.dry_run else ''}step {args.step_name} ({args.step}, {args.preset}, ComfyUI "
        f"{comfyui_version()}) done in {time.perf_counter() - started:.1f} s, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
