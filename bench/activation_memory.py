"""Peak activation memory of one DiT forward, measured on ComfyUI's own model classes without real weights.

    .venv/bin/python -P bench/activation_memory.py              # all families -> bench/results/activation_memory.*
    .venv/bin/python -P bench/activation_memory.py --family flux1 --out /tmp/x
    python -P bench/activation_memory.py --device cuda --out DIR    # on a GPU: adds measured max_memory_allocated

The model is built on the ``meta`` device with one block per block list (:data:`FAMILIES`), and one forward
runs under a ``TorchDispatchMode`` that adds each new storage's ``nbytes`` to the live total and subtracts them
(``weakref.finalize``) when PyTorch frees it: what the caching allocator would be asked for, without its rounding.
Weights are not counted (the planner's other term); forward hooks on the blocks record the live bytes at each
block's entry and the peak inside it. (torch's ``MemTracker`` keeps the same books per module and training
category; at inference the storage count is all that is needed, and it sees the attention stand-in exactly.)

Attention: ComfyUI's attention functions are replaced by a stand-in that allocates what CUDA SDPA flash /
memory-efficient allocate: the output (in the (batch, tokens, heads, dim) layout, so ComfyUI's reshape is a view)
and a float32 log-sum-exp of (batch, heads, tokens) (flash always returns it; an upper bound). No tokens x tokens
matrix. Not counted: kernel and cuBLAS workspaces, allocator rounding and fragmentation, masked paths (a mask makes
PyTorch pick another kernel): why the planner keeps ComfyUI's reserve on top. The inputs are the diffusion model's
own (after ``BaseModel._apply_model`` casts the latent); ComfyUI's wrapper adds ``latent_bytes`` x 3 (input cast,
output, denoised), included in ``peak_bytes``.

The models: ComfyUI's own DiT classes at the released models' dimensions (:data:`FAMILIES`: the class, its
arguments, the block-count arguments, the inputs of one forward); the resolutions a user samples at (:data:`CASES`;
latent shapes as ComfyUI's empty-latent nodes make them: VAE stride 8, 16 for Wan 2.2 5B / Flux 2, LTXV's 32 x 8).
Tokens are ``latent elements per channel / patch area``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402

from .dit_families import CASES, FAMILIES  # noqa: E402
from .measure import RESULTS  # noqa: E402
from .meta_forward import LiveBytes, flash_like_attention, meta_forward  # noqa: E402
from ..devtools import comfy_env  # noqa: E402

FIELDS = ("family", "label", "resolution", "main", "batch", "dtype", "latent_channels", "tokens", "block_width",
          "peak_bytes", "forward_peak_bytes", "block_peak_bytes", "block_entry_bytes", "outside_peak_bytes",
          "latent_bytes", "attention_calls", "measured_max_allocated_bytes")


def measure_meta(spec, case, batch: int, dtype: torch.dtype) -> dict:
    from ..offload import block_width
    model = spec.build(dtype).eval()
    calls = []
    tracker = LiveBytes()
    tracker.ignore(model)
    block_peak = block_entry = 0

    def enter(i):
        nonlocal block_entry
        tracker.in_block = True
        block_entry = max(block_entry, tracker.live)
        tracker.reset_window()

    def leave(i):
        nonlocal block_peak
        tracker.in_block = False
        block_peak = max(block_peak, tracker.window_peak)

    blocks = meta_forward(model, spec, case.latent, batch, dtype, flash_like_attention(calls), tracker, enter, leave)
    latent_bytes = batch * math.prod(case.latent) * dtype.itemsize
    forward_peak = tracker.peak
    return dict(latent_channels=case.latent[0], tokens=math.prod(case.latent[1:]) // spec.patch_area,
                block_width=block_width(blocks[0]),
                forward_peak_bytes=forward_peak, peak_bytes=forward_peak + 3 * latent_bytes,
                block_peak_bytes=block_peak, block_entry_bytes=block_entry,
                outside_peak_bytes=tracker.outside_peak, latent_bytes=latent_bytes, attention_calls=len(calls))


def measure_cuda(spec, case, batch: int, dtype: torch.dtype, device: str = "cuda") -> int:
    """``torch.cuda.max_memory_allocated`` of one forward, ComfyUI's attention as it is on the GPU, counted the way
    :func:`measure_meta` counts: the inputs, what the forward allocates beyond the weights, + 3 latents."""
    model = spec.build(dtype).to_empty(device=device).eval()  # uninitialised weights: only memory is measured
    with torch.no_grad(), torch.device(device):
        x = torch.zeros((batch,) + tuple(case.latent), dtype=dtype)
        kwargs = {k: (v.zero_() if isinstance(v, torch.Tensor) else v) for k, v in spec.inputs(x, batch, dtype).items()}
        inputs = sum(t.untyped_storage().nbytes() for t in [x, *kwargs.values()] if isinstance(t, torch.Tensor))
        model(x, **kwargs, transformer_options={})  # warm-up: cuBLAS workspaces and the like are made once
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = model(x, **kwargs, transformer_options={})
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
    del model, x, kwargs
    torch.cuda.empty_cache()
    latent_bytes = batch * math.prod(case.latent) * dtype.itemsize
    return peak + inputs + 3 * latent_bytes


def write_markdown(rows, path: Path) -> None:
    gib = lambda n: f"{int(n) / 2**30:.2f}" if n not in ("", None) else ""
    lines = [
        "# Activation memory of one forward (bf16), measured on ComfyUI 0.3.75's model classes",
        "",
        "Made by `.venv/bin/python -P bench/activation_memory.py` (meta tensors, no real weights; the module "
        "docstring says how). `peak` = the forward's peak live activation bytes + 3 latent-sized tensors of "
        "ComfyUI's wrapper; this is what the planner plans for. Attention is counted as CUDA flash SDPA "
        "allocates it (output + float32 log-sum-exp, no tokens x tokens matrix); kernel workspaces, allocator "
        "rounding and fragmentation are not counted. `measured` is `torch.cuda.max_memory_allocated` on a GPU "
        "(empty where no GPU was lent).",
        "",
        "| family | resolution | batch | tokens | peak GiB | peak while a block runs GiB | peak between blocks GiB "
        "| measured GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = f"**{r['label']}**" if r["main"] in (True, "1", 1) and int(r["batch"]) == 1 else r["label"]
        lines.append(f"| {name} | {r['resolution']} | {r['batch']} | {r['tokens']} | {gib(r['peak_bytes'])} | "
                     f"{gib(r['block_peak_bytes'])} | {gib(r['outside_peak_bytes'])} | "
                     f"{gib(r['measured_max_allocated_bytes'])} |")
    lines += ["", "Bold: the main resolution at batch 1 (batch 2 is cond + uncond batched, as ComfyUI runs cfg > 1)."]
    path.write_text("\n".join(lines) + "\n")


def measure_row(spec, case, batch: int, dtype: torch.dtype, cuda: bool) -> dict:
    row = dict(family=spec.name, label=spec.label, resolution=case.resolution, main=int(case.main), batch=batch,
               dtype="bf16", **measure_meta(spec, case, batch, dtype), measured_max_allocated_bytes="")
    if cuda:
        row["measured_max_allocated_bytes"] = measure_cuda(spec, case, batch, dtype)
    print(f"[activation_memory] {spec.name:14s} {case.resolution:13s} batch {batch}: tokens {row['tokens']:6d} "
          f"peak {row['peak_bytes'] / 2**30:6.2f} GiB (block {row['block_peak_bytes'] / 2**30:.2f}, outside "
          f"{row['outside_peak_bytes'] / 2**30:.2f}, {row['attention_calls']} attention calls)"
          + (f" measured {row['measured_max_allocated_bytes'] / 2**30:.2f} GiB" if cuda else ""), flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="", help="comma-separated families (default: all)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda also measures max_memory_allocated per row (needs the memory for 1-2 blocks)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for activation_memory.csv / .md")
    args = parser.parse_args(argv)

    comfy_env.import_comfyui(cpu=args.device == "cpu", import_nodes=False)
    wanted = [f for f in args.family.split(",") if f] or list(FAMILIES)
    unknown = [f for f in wanted if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    dtype = torch.bfloat16
    rows = []
    started = time.perf_counter()
    cases = [case for case in CASES if case.family in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "activation_memory.csv", "w", newline="") as table:
        # Row by row, flushed: a run cut short by a time limit keeps the rows it measured.
        writer = csv.DictWriter(table, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for case in cases:
            for batch in case.batches:
                rows.append(measure_row(FAMILIES[case.family], case, batch, dtype, args.device == "cuda"))
                writer.writerow(rows[-1])
                table.flush()
    write_markdown(rows, out / "activation_memory.md")
    print(f"[activation_memory] {len(rows)} rows in {time.perf_counter() - started:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
