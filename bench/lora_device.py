"""What applying a LoRA on the device as each block is copied in costs per step, against baking it into RAM.

    python -P bench/lora_device.py [--device cpu|cuda] [--dim 768] [--blocks 4] [--steps 4] [--repeats 2] [--cycles 2]

A Wan 2.1 of ComfyUI's own class (random weights, ``dim`` wide, fp32 on the CPU, bf16 on CUDA), a rank-4 LoRA over
every Linear of its blocks, every block streamed (the worst case: each block is patched at every copy). Three
ways, each on a fresh model, timed over ``repeats`` sampling runs after a warm-up run, taking turns ``cycles``
times; the fastest run of each way counts: ``device`` (the node as it is: the LoRA applied on the device after
each copy, the host keeps the unpatched weights once), ``baked`` (the LoRA baked into the host store once, the
node's way for quantized weights: no work per copy, but a second copy in RAM) and ``none``. Prints ms per step,
device / baked and device / none, the extra time per streamed block copy, and whether ``device`` and ``baked``
are bitwise ComfyUI's own full load with the LoRA. On the CPU loopback the LoRA math and the copies share the
cores, so only the ratios mean anything; on a GPU the math runs on a stream of its own.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

from .measure import CPU_LOOPBACK_ENV, block_lora, with_lora  # noqa: E402
from ..devtools import comfy_env  # noqa: E402


def timed(transform, total):
    """``transform`` with its time added to ``total[0]`` (host clock; on CUDA only the time to queue it)."""
    def run(index, weights):
        start = time.perf_counter()
        transform(index, weights)
        total[0] += time.perf_counter() - start
    run.signature = transform.signature
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=2)
    args = parser.parse_args()
    os.environ[CPU_LOOPBACK_ENV] = "1"
    comfy_env.import_comfyui(cpu=args.device == "cpu", import_nodes=False)
    import torch
    import comfy.model_management as mm
    from ..devtools import tiny_dits
    from ..nodes import controller as controller_module
    from ..nodes.controller import offload_model

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    config = dict(tiny_dits.WAN21_TINY_CONFIG, dim=args.dim, num_heads=args.dim // 128, ffn_dim=4 * args.dim,
                  num_layers=args.blocks)

    def build():
        return tiny_dits._build("WAN21_T2V", config, 5, dtype)

    def sample(patcher):
        return tiny_dits.sample(patcher, seed=3, steps=args.steps, family="wan21")

    lora = block_lora(build(), rank=4)
    reference = sample(with_lora(build(), lora))
    mm.unload_all_models()
    # Looks inside: "baked" is the node with no device patch plan, as it runs for quantized weights.
    device_plan = controller_module.device_patch_plan
    rows, times, copies, transform_seconds = {}, {}, {}, [0.0]
    for _ in range(args.cycles):  # the ways take turns, so a busy machine slows each of them alike
        for way in ("device", "baked", "none"):
            controller_module.device_patch_plan = device_plan if way == "device" else (lambda *a, **k: {})
            model = build()
            offloaded = offload_model(with_lora(model, lora) if way != "none" else model, 0, 1, "leading", False)
            out = sample(offloaded)  # warm-up: packs the host store
            manager = offloaded.attachments["layerwise_offload"].manager
            if manager.after_copy is not None:
                transform_seconds[0] = 0.0
                manager.set_after_copy(timed(manager.after_copy, transform_seconds))
            copies_before, copy_seconds_before = manager.stats().copies_issued, manager.stats().copy_seconds
            for _ in range(args.repeats):
                before = manager.stats().forwards
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = sample(offloaded)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.setdefault(way, []).append(time.perf_counter() - start)
                forwards = manager.stats().forwards - before
            after = manager.stats()
            copies[way] = (after.copies_issued - copies_before, after.copy_seconds - copy_seconds_before)
            rows[way] = (min(times[way]) / args.steps, forwards, after.host_bytes,
                         torch.equal(out, reference) if way != "none" else None)
            del offloaded, model, manager
            mm.unload_all_models()
    controller_module.device_patch_plan = device_plan

    print(f"[layerwise-offload] Wan 2.1 dim {args.dim}, {args.blocks} blocks all streamed, {args.device}, {dtype}, "
          f"{args.steps} steps, fastest of {args.repeats * args.cycles} runs")
    for way, (step, forwards, store, equal) in rows.items():
        bitwise = "" if equal is None else f", bitwise equal to ComfyUI's full load: {equal}"
        print(f"  {way:6s} {step * 1000:9.1f} ms per step ({forwards} forwards per run), host store "
              f"{store / 2**20:.1f} MiB{bitwise}")
    device, baked, none = (rows[w][0] for w in ("device", "baked", "none"))
    copies_per_step = rows["device"][1] / args.steps * args.blocks
    print(f"  device / baked = {device / baked:.3f}, device / none = {device / none:.3f}; "
          f"extra per streamed block copy: {(device - baked) / copies_per_step * 1000:.2f} ms "
          f"({(device - baked) / baked:.1%} of a baked step)")
    if args.device == "cpu":  # synchronous: the copy clock holds the copy and the transform, one after the other
        count, seconds = copies["device"]
        math, copy = transform_seconds[0] / count, (seconds - transform_seconds[0]) / count
        print(f"  LoRA math per block copy {math * 1000:.2f} ms against the copy itself {copy * 1000:.2f} ms: "
              f"math / copy = {math / copy:.2f} ({count} copies in the last cycle)")


if __name__ == "__main__":
    main()
