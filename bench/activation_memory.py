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
import importlib
import math
import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

if __name__ == "__main__":  # run by path: the pack registered as `layerwise_offload`, so the relative imports work
    import runpy
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "devtools" / "comfy_env.py"))["enter_pack"](globals())

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from .measure import RESULTS  # noqa: E402
from ..devtools import comfy_env  # noqa: E402
from ..devtools.comfy_env import with_fields_this_comfyui_needs  # noqa: E402

FIELDS = ("family", "label", "resolution", "main", "batch", "dtype", "latent_channels", "tokens", "block_width",
          "peak_bytes", "forward_peak_bytes", "block_peak_bytes", "block_entry_bytes", "outside_peak_bytes",
          "latent_bytes", "attention_calls", "measured_max_allocated_bytes")


@dataclass(frozen=True)
class FamilySpec:
    name: str
    label: str
    cls: str  # "module:Class" inside comfy.ldm
    kwargs: Dict[str, Any]
    one_block: Dict[str, Any]  # the constructor's block-count arguments, one block per list
    patch_area: int  # latent elements per channel that make one token
    inputs: Callable[..., Dict[str, Any]] = field(repr=False)  # (x, batch, dtype) -> forward kwargs beyond x

    def build(self, dtype: torch.dtype):
        import comfy.ops
        module_name, class_name = self.cls.split(":")
        cls = getattr(importlib.import_module("comfy.ldm." + module_name), class_name)
        return cls(**with_fields_this_comfyui_needs(self.kwargs), **self.one_block, dtype=dtype,
                   device=torch.device("meta"),
                   operations=comfy.ops.disable_weight_init)


@dataclass(frozen=True)
class Case:
    family: str
    resolution: str
    latent: Tuple[int, ...]  # per batch item: (C, H, W) or (C, T, H, W)
    batches: Tuple[int, ...] = (1, 2)
    main: bool = False  # the resolution the README's headline row uses


def _empty(*shape, dtype):
    return torch.empty(shape, dtype=dtype)


def _flux_inputs(text_tokens: int, text_dim: int, pooled: int = 0):
    def make(x, batch, dtype):
        out = {"timestep": _empty(batch, dtype=torch.float32),
               "context": _empty(batch, text_tokens, text_dim, dtype=dtype),
               "guidance": _empty(batch, dtype=torch.float32)}
        if pooled:
            out["y"] = _empty(batch, pooled, dtype=dtype)
        return out
    return make


def _text_inputs(text_tokens: int, text_dim: int, timestep: str = "timestep", **extra):
    def make(x, batch, dtype):
        out = {timestep: _empty(batch, dtype=torch.float32),
               "context": _empty(batch, text_tokens, text_dim, dtype=dtype)}
        for key, value in extra.items():
            out[key] = value(batch, dtype) if callable(value) else value
        return out
    return make


WAN = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, freq_dim=256, text_dim=4096, window_size=(-1, -1),
           qk_norm=True, cross_attn_norm=True, eps=1e-6, image_model="wan2.1")
FLUX1 = dict(image_model="flux", guidance_embed=True, in_channels=16, out_channels=16, vec_in_dim=768,
             context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, axes_dim=[16, 56, 56], theta=10000,
             patch_size=2, qkv_bias=True)
FLUX2 = dict(image_model="flux2", guidance_embed=True, in_channels=128, out_channels=128, vec_in_dim=None,
             context_in_dim=15360, hidden_size=6144, mlp_ratio=3.0, num_heads=48, axes_dim=[32, 32, 32, 32],
             theta=2000, patch_size=1, qkv_bias=False, global_modulation=True, mlp_silu_act=True, ops_bias=False,
             default_ref_method="index", ref_index_scale=10.0)
HUNYUAN = dict(image_model="hunyuan_video", in_channels=16, out_channels=16, patch_size=[1, 2, 2], vec_in_dim=768,
               axes_dim=[16, 56, 56], context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, theta=256,
               qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False,
               vision_in_dim=None)
SD35_LARGE = dict(input_size=None, patch_size=2, in_channels=16, out_channels=16, adm_in_channels=2048,
                  context_embedder_config={"target": "torch.nn.Linear",
                                           "params": {"in_features": 4096, "out_features": 2432}},
                  pos_embed_max_size=192, pos_embed_scaling_factor=None, qk_norm="rms", num_patches=36864)
LUMINA = dict(patch_size=2, in_channels=16, qk_norm=True, image_model="lumina2")

FAMILIES: Dict[str, FamilySpec] = {f.name: f for f in (
    FamilySpec("flux1", "Flux.1 dev (hidden 3072)", "flux.model:Flux", FLUX1,
               {"depth": 1, "depth_single_blocks": 1}, 4, _flux_inputs(512, 4096, pooled=768)),
    FamilySpec("flux2", "Flux 2 dev (hidden 6144)", "flux.model:Flux", FLUX2,
               {"depth": 1, "depth_single_blocks": 1}, 1, _flux_inputs(512, 15360)),
    FamilySpec("wan_14b", "Wan 2.1 / 2.2 14B (dim 5120)", "wan.model:WanModel",
               {**WAN, "in_dim": 16, "out_dim": 16, "dim": 5120, "ffn_dim": 13824, "num_heads": 40},
               {"num_layers": 1}, 4, _text_inputs(512, 4096)),
    FamilySpec("wan_1_3b", "Wan 2.1 1.3B (dim 1536)", "wan.model:WanModel",
               {**WAN, "in_dim": 16, "out_dim": 16, "dim": 1536, "ffn_dim": 8960, "num_heads": 12},
               {"num_layers": 1}, 4, _text_inputs(512, 4096)),
    FamilySpec("wan22_5b", "Wan 2.2 TI2V 5B (dim 3072)", "wan.model:WanModel",
               {**WAN, "in_dim": 48, "out_dim": 48, "dim": 3072, "ffn_dim": 14336, "num_heads": 24},
               {"num_layers": 1}, 4, _text_inputs(512, 4096)),
    FamilySpec("qwen_image", "Qwen-Image (24 heads of 128)", "qwen_image.model:QwenImageTransformer2DModel",
               dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128, num_attention_heads=24,
                    joint_attention_dim=3584, axes_dims_rope=(16, 56, 56), image_model="qwen_image"),
               {"num_layers": 1}, 4, _text_inputs(256, 3584)),
    FamilySpec("hunyuan_video", "HunyuanVideo (hidden 3072)", "hunyuan_video.model:HunyuanVideo", HUNYUAN,
               {"depth": 1, "depth_single_blocks": 1}, 4, _flux_inputs(256, 4096, pooled=768)),
    FamilySpec("sd35_large", "SD3.5 Large (hidden 2432)",
               "modules.diffusionmodules.mmdit:OpenAISignatureMMDITWrapper", SD35_LARGE,
               {"depth": 38, "num_blocks": 1}, 4,
               _text_inputs(154, 4096, "timesteps", y=lambda batch, dtype: _empty(batch, 2048, dtype=dtype))),
    FamilySpec("lumina2", "Lumina 2 (dim 2304)", "lumina.model:NextDiT",
               {**LUMINA, "dim": 2304, "cap_feat_dim": 2304, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32],
                "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0},
               {"n_layers": 1, "n_refiner_layers": 1}, 4, _text_inputs(256, 2304, "timesteps", num_tokens=256)),
    FamilySpec("z_image", "Z-Image (dim 3840)", "lumina.model:NextDiT",
               {**LUMINA, "dim": 3840, "cap_feat_dim": 2560, "n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48],
                "axes_lens": [1536, 512, 512], "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0,
                "z_image_modulation": True, "time_scale": 1000.0, "pad_tokens_multiple": 32},
               {"n_layers": 1, "n_refiner_layers": 1}, 4, _text_inputs(256, 2560, "timesteps", num_tokens=256)),
    FamilySpec("ltxv", "LTXV 2B (hidden 2048)", "lightricks.model:LTXVModel",
               dict(in_channels=128, cross_attention_dim=2048, attention_head_dim=64, num_attention_heads=32,
                    caption_channels=4096), {"num_layers": 1}, 1,
               _text_inputs(128, 4096, attention_mask=lambda batch, dtype: torch.ones(batch, 128, dtype=dtype),
                            frame_rate=25)),
)}

CASES: Tuple[Case, ...] = (
    Case("flux1", "512x512", (16, 64, 64)),
    Case("flux1", "1024x1024", (16, 128, 128), main=True),
    Case("flux1", "1536x1536", (16, 192, 192)),
    Case("flux2", "1024x1024", (128, 64, 64), main=True),
    Case("flux2", "1536x1536", (128, 96, 96)),
    Case("wan_14b", "832x480x33", (16, 9, 60, 104)),
    Case("wan_14b", "832x480x81", (16, 21, 60, 104), main=True),
    Case("wan_14b", "1280x720x81", (16, 21, 90, 160)),
    Case("wan_1_3b", "832x480x33", (16, 9, 60, 104)),
    Case("wan_1_3b", "832x480x81", (16, 21, 60, 104), main=True),
    Case("wan22_5b", "832x480x121", (48, 31, 30, 52)),
    Case("wan22_5b", "1280x704x121", (48, 31, 44, 80), main=True),
    Case("qwen_image", "1024x1024", (16, 1, 128, 128)),
    Case("qwen_image", "1328x1328", (16, 1, 166, 166), main=True),
    Case("hunyuan_video", "848x480x61", (16, 16, 60, 106)),
    Case("hunyuan_video", "1280x720x129", (16, 33, 90, 160), main=True),
    Case("sd35_large", "1024x1024", (16, 128, 128), main=True),
    Case("sd35_large", "1536x1536", (16, 192, 192)),
    Case("lumina2", "1024x1024", (16, 128, 128), main=True),
    Case("lumina2", "1536x1536", (16, 192, 192)),
    Case("z_image", "1024x1024", (16, 128, 128), main=True),
    Case("z_image", "1536x1536", (16, 192, 192)),
    Case("ltxv", "768x512x97", (128, 13, 16, 24), main=True),
    Case("ltxv", "1216x704x121", (128, 16, 22, 38)),
)


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
    from ..nodes.discovery import discover_blocks  # imports ComfyUI: only after import_comfyui
    return discover_blocks(model).blocks


def meta_forward(model, spec, latent, batch: int, dtype: torch.dtype, attention, mode, enter, leave):
    """One forward of ``model`` (``spec``'s, built on the meta device) under ``mode`` (a dispatch or counting mode),
    ComfyUI's attention replaced by ``attention`` and ``enter(i)`` / ``leave(i)`` around block i; its blocks."""
    blocks = block_lists(model)
    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(lambda m, a, i=i: enter(i)),
                                                          b.register_forward_hook(lambda m, a, o, i=i: leave(i)))]
    try:
        with torch.no_grad(), torch.device("meta"), attention_replaced(attention), mode:
            x = torch.empty((batch,) + tuple(latent), dtype=dtype)
            model(x, **spec.inputs(x, batch, dtype), transformer_options={})
    finally:
        for handle in handles:
            handle.remove()
    return blocks


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
