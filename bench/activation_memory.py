"""Peak activation memory of one DiT forward, measured on ComfyUI's own model classes without real weights.

    .venv/bin/python -P bench/activation_memory.py              # all families -> bench/results/activation_memory.*
    .venv/bin/python -P bench/activation_memory.py --family flux1 --out /tmp/x
    python -P bench/activation_memory.py --device cuda --out DIR    # on a GPU: adds measured max_memory_allocated

How (CPU, the default): the model is built on the ``meta`` device (shapes and dtypes, no storage) with one block
per block list, and one forward runs under a ``TorchDispatchMode`` that sees every tensor an operator returns. A
new storage adds its ``nbytes`` to the live total and a ``weakref.finalize`` on it subtracts them when PyTorch
frees it, so the tracker follows exactly what the caching allocator would be asked for (without its rounding
to 512-byte blocks). Inputs are allocated inside the tracker; weights are not counted (they are the planner's
other term). Forward hooks on the blocks record the live bytes at each block's entry and the peak inside it. (PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` keeps the same kind of books, per module and per category of
training state; at inference with one forward the storage count above is all that is needed, and it lets the
attention stand-in below be seen for exactly what it allocates.)

Attention: ComfyUI's attention functions are replaced, for the measurement, by a stand-in that allocates what
PyTorch's CUDA SDPA flash / memory-efficient kernels allocate for the output: the output itself (in the
(batch, tokens, heads, dim) layout, so ComfyUI's later reshape is a view) and a float32 log-sum-exp of
(batch, heads, tokens) (flash always returns it; memory-efficient does not at inference: an upper bound). No
tokens x tokens matrix exists, as on the GPU. Not counted: kernel workspaces, cuBLAS workspaces, allocator
rounding and fragmentation, and the masked paths (a mask makes PyTorch pick the memory-efficient or math
kernel); these are why the planner keeps ComfyUI's reserve on top.

Forward inputs are the diffusion model's own (what ComfyUI's ``BaseModel._apply_model`` passes after casting
the latent to the model dtype); ComfyUI's wrapper around it adds a few latent-sized tensors, included as
``latent_bytes`` x 3 (input cast, output, denoised) in ``peak_bytes``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import sys
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
FIELDS = ("family", "label", "resolution", "main", "batch", "dtype", "latent_channels", "tokens", "block_width",
          "peak_bytes", "forward_peak_bytes", "block_peak_bytes", "block_entry_bytes", "outside_peak_bytes",
          "latent_bytes", "attention_calls", "measured_max_allocated_bytes")


def _load_comfy_env():
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", HERE.parent / "devtools" / "comfy_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LiveBytes(TorchDispatchMode):
    """Live bytes of every storage created by an operator while the mode is active, and their peaks."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.window_peak = 0  # peak since the last reset_window()
        self.outside_peak = 0  # peak reached while no block was running
        self.in_block = False
        self._sizes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf.untyped_storage())
        return out

    def ignore(self, module) -> None:
        """Weights and buffers existed before the forward: views of them allocate nothing."""
        for tensor in list(module.parameters()) + list(module.buffers()):
            self._track(tensor.untyped_storage(), counted=False)

    def _track(self, storage, counted: bool = True) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes() if counted else 0
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.window_peak = max(self.window_peak, self.live)
        if not self.in_block:
            self.outside_peak = max(self.outside_peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.live -= self._sizes.pop(key, 0)

    def reset_window(self) -> None:
        self.window_peak = self.live


def flash_like_attention(calls):
    """A stand-in for ComfyUI's attention functions that allocates what CUDA flash SDPA allocates."""
    def attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
        calls.append(1)
        if skip_reshape:
            batch, heads, tokens, _ = q.shape
            value_dim = v.shape[-1]
        else:
            batch, tokens = q.shape[:2]
            value_dim = v[0].numel() // (v.shape[1] * heads)  # v may come as (b, L, heads, dim) or (b, L, heads * dim)
        logsumexp = torch.empty((batch, heads, tokens), dtype=torch.float32, device=q.device)
        out = torch.empty((batch, tokens, heads, value_dim), dtype=q.dtype, device=q.device)
        del logsumexp
        if skip_output_reshape:
            return out.transpose(1, 2)
        return out.view(batch, tokens, heads * value_dim)
    return attention


@contextmanager
def attention_replaced(replacement):
    """Swap every ``optimized_attention*`` name bound in ComfyUI's model modules, restore them after."""
    names = ("optimized_attention", "optimized_attention_masked")
    saved = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("comfy.ldm"):
            continue
        for name in names:
            if callable(getattr(module, name, None)):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def block_lists(model):
    """The blocks as the node finds them (the pack's own discovery)."""
    from layerwise_offload.nodes.discovery import discover_blocks
    return discover_blocks(model).blocks


def measure_meta(spec, case, batch: int, dtype: torch.dtype) -> dict:
    from layerwise_offload.offload.activation_model import block_width
    model = spec.build(dtype).eval()
    blocks = block_lists(model)
    calls = []
    tracker = LiveBytes()
    tracker.ignore(model)
    block_peak = block_entry = 0

    def enter(module, args):
        nonlocal block_entry
        tracker.in_block = True
        block_entry = max(block_entry, tracker.live)
        tracker.reset_window()

    def leave(module, args, output):
        nonlocal block_peak
        tracker.in_block = False
        block_peak = max(block_peak, tracker.window_peak)

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        with torch.no_grad(), torch.device("meta"), attention_replaced(flash_like_attention(calls)), tracker:
            x = torch.empty((batch,) + tuple(case.latent), dtype=dtype)
            kwargs = spec.inputs(x, batch, dtype)
            out = model(x, **kwargs, transformer_options={})
            del out
    finally:
        for handle in handles:
            handle.remove()
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
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for activation_memory.csv / .md")
    parser.add_argument("--dry-run", action="store_true", help="import and build every family, measure nothing")
    args = parser.parse_args(argv)

    env = _load_comfy_env()
    env.register_pack()
    env.import_comfyui(cpu=args.device == "cpu", import_nodes=False)
    from layerwise_offload.bench.activation_specs import CASES, FAMILIES

    wanted = [f for f in args.family.split(",") if f] or list(FAMILIES)
    unknown = [f for f in wanted if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    dtype = torch.bfloat16
    rows = []
    started = time.perf_counter()
    cases = [case for case in CASES if case.family in wanted]
    if args.dry_run:
        for name in dict.fromkeys(case.family for case in cases):
            FAMILIES[name].build(dtype)
            print(f"[activation_memory] dry run: built {FAMILIES[name].label} on the meta device", flush=True)
        return 0
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
