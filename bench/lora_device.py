"""What applying a LoRA on the device as each block is copied in costs per step, against baking it into RAM.

    python -P bench/lora_device.py [--device cpu|cuda] [--dim 768] [--blocks 4] [--steps 4] [--repeats 2] [--cycles 2]

A Wan 2.1 of ComfyUI's own class (random weights, ``dim`` wide, fp32 on the CPU, bf16 on CUDA), a rank-4 LoRA
over every Linear of its blocks, every block streamed (``resident_layers=0``, the worst case: each block is
patched at every copy). Three ways, each on a fresh model, timed over ``repeats`` sampling runs after a
warm-up run, the ways taking turns ``cycles`` times; the fastest run of each way counts:

- ``device``: the node as it is, the LoRA applied on the device after each copy (the host keeps the unpatched
  weights once);
- ``baked``:  the LoRA baked into the host store once (the node's way before, and still its way for quantized
  weights): no work per copy, but the patched weights are a second copy in RAM while ComfyUI keeps backups;
- ``none``:   no LoRA.

It prints ms per step and the ratios device / baked and device / none, the extra time per streamed block
copy, and checks that ``device`` and ``baked`` are bitwise equal to ComfyUI's own full load with the LoRA.
On the CPU loopback the "device" work and the copies run on the same cores, so only the ratios mean
anything; on a GPU the work runs on the copy stream, beside the compute of the block before.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def _comfy_env():
    spec = importlib.util.spec_from_file_location("_lwo_lora_comfy_env", REPO_ROOT / "devtools" / "comfy_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=2)
    args = parser.parse_args()
    os.environ["LAYERWISE_OFFLOAD_CPU_LOOPBACK"] = "1"
    env = _comfy_env()
    env.import_pack_modules(root=REPO_ROOT)
    env.import_comfyui(cpu=args.device == "cpu", import_nodes=False)
    import torch
    import comfy.model_management as mm
    import comfy.sd
    from layerwise_offload.devtools import tiny_dits
    from layerwise_offload.nodes import controller as controller_module
    from layerwise_offload.nodes.offload_node import offload_model

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    config = dict(tiny_dits.WAN21_TINY_CONFIG, dim=args.dim, num_heads=args.dim // 128, ffn_dim=4 * args.dim,
                  num_layers=args.blocks)

    def build():
        return tiny_dits._build("WAN21_T2V", config, 5, dtype)

    def lora_for(patcher, rank=4):
        generator = torch.Generator().manual_seed(7)
        lora = {}
        for key, tensor in patcher.model.state_dict().items():
            if ".blocks." in key and key.endswith(".weight") and tensor.ndim == 2:
                stem = key[:-len(".weight")]
                lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
                lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
        return lora

    lora = lora_for(build())

    def with_lora(patcher):
        return comfy.sd.load_lora_for_models(patcher, None, lora, 0.8, 0)[0]

    def sample(patcher):
        return tiny_dits.sample(patcher, seed=3, steps=args.steps, family="wan21")

    reference = sample(with_lora(build()))
    mm.unload_all_models()
    device_plan = controller_module.device_patch_plan
    rows, times, copies, transform_seconds = {}, {}, {}, [0.0]
    for _ in range(args.cycles):  # the ways take turns, so a busy machine slows each of them alike
        for way in ("device", "baked", "none"):
            controller_module.device_patch_plan = device_plan if way == "device" else (lambda *a, **k: {})
            model = build()
            offloaded = offload_model(with_lora(model) if way != "none" else model, 0, 1, "leading", False)
            out = sample(offloaded)  # warm-up: packs the host store
            manager = offloaded.attachments["layerwise_offload"].manager
            if manager.after_copy is not None:
                transform_seconds[0] = 0.0
                manager.set_after_copy(timed(manager.after_copy, args.device, transform_seconds))
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
            equal = torch.equal(out, reference) if way != "none" else None
            after = manager.stats()
            copies[way] = (after.copies_issued - copies_before, after.copy_seconds - copy_seconds_before)
            rows[way] = (min(times[way]) / args.steps, forwards, after.host_bytes, equal)
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


def timed(transform, device, total):
    """``transform`` with its time added to ``total[0]`` (host clock; on CUDA only the time to queue it)."""
    def run(index, weights):
        start = time.perf_counter()
        transform(index, weights)
        total[0] += time.perf_counter() - start
    run.signature = transform.signature
    return run


if __name__ == "__main__":
    main()
