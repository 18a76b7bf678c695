"""Bytes on the wire per forward for each weight format, measured through ComfyUI's own loaders.

    .venv/bin/python -P bench/quantized_bytes.py            # prints a markdown table (README "Quantized models")

One model shape (the tiny Wan 2.1 of devtools/tiny_dits.py: 4 blocks, dim 256, ffn 512), written in each format
and loaded the way a user loads it: bf16 and fp8 mixed precision through ``comfy.sd.load_diffusion_model``
(UNETLoader), GGUF through ComfyUI-GGUF's ``UnetLoaderGGUF`` (unmodified, from shared/peers). The node streams every
block (resident_layers 0) on the CPU loopback; the figure is the manager's own counter of host-to-device bytes in
the last forward, next to the bytes the same blocks would stream unquantized in bf16.
A second table gives, for the Wan 2.1 14B block shape (dim 5120, ffn 13824), the bytes ``plan_layout`` packs for
one block from the shapes and dtypes of the parts each format stores (computed, not run: such a block does not fit
this machine's CPU benchmark budget).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORMATS = ("bf16", "fp8_mixed", "F16", "Q8_0", "Q5_0", "Q4_0")
GGML_BYTES_PER_32 = {"F16": 64, "Q8_0": 34, "Q5_0": 22, "Q4_0": 18}


def _import_pack():
    spec = importlib.util.spec_from_file_location("_lwo_comfy_env", REPO / "devtools" / "comfy_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register_pack(REPO)
    return module


def measure_tiny(workdir: Path):
    import torch
    import comfy.model_management as mm
    import comfy.sd
    import folder_paths
    from layerwise_offload.devtools import peers, tiny_dits
    from layerwise_offload.devtools.quantized_models import save_tiny_wan21_fp8_mixed, save_tiny_wan21_gguf
    from layerwise_offload.nodes.offload_node import offload_model
    from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin

    os.environ["LAYERWISE_OFFLOAD_CPU_LOOPBACK"] = "1"
    models = workdir / "diffusion_models"
    plain = tiny_dits.save_tiny_wan21(models / "tiny_wan21.safetensors", seed=0)
    loaders = {
        "bf16": lambda: comfy.sd.load_diffusion_model(plain, model_options={"dtype": torch.bfloat16}),
        "fp8_mixed": lambda: comfy.sd.load_diffusion_model(save_tiny_wan21_fp8_mixed(models / "fp8.safetensors")),
    }
    if peers.peer_tarball() is not None:
        gguf = peers.import_comfyui_gguf(workdir / "custom_nodes")
        folder_paths.add_model_folder_path("diffusion_models", str(models))
        for qtype in GGML_BYTES_PER_32:
            save_tiny_wan21_gguf(models / f"tiny_{qtype}.gguf", qtype)
            loaders[qtype] = lambda q=qtype: gguf.nodes.UnetLoaderGGUF().load_unet(f"tiny_{q}.gguf")[0]
    rows = []
    for name, load in loaders.items():
        offloaded = offload_model(load(), 0, 1, "leading", True)
        tiny_dits.sample(offloaded, seed=3, family="wan21", steps=2)
        stats = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager.stats()
        rows.append((name, stats.streamed_blocks, stats.bytes_copied_last_forward))
        mm.unload_all_models()
    return rows


def wan14b_block_parts(fmt: str):
    """(name, shape, dtype) of what the host store packs for one Wan 2.1 14B block in ``fmt``."""
    import torch

    dim, ffn = 5120, 13824
    linears = [(f"{a}.{p}", (dim, dim)) for a in ("self_attn", "cross_attn") for p in "qkvo"]
    linears += [("ffn.0", (ffn, dim)), ("ffn.2", (dim, ffn))]
    vectors = [(f"{n}.bias", (o,)) for n, (o, _) in linears]
    vectors += [(f"{a}.norm_{x}.weight", (dim,)) for a in ("self_attn", "cross_attn") for x in "qk"]
    vectors += [("norm3.weight", (dim,)), ("norm3.bias", (dim,)), ("modulation", (1, 6, dim))]
    parts = []
    for name, (out_f, in_f) in linears:
        if fmt == "bf16":
            parts.append((name, (out_f, in_f), torch.bfloat16))
        elif fmt == "fp8_mixed":
            parts += [(name + ":qdata", (out_f, in_f), torch.float8_e4m3fn), (name + ":scale", (), torch.float32)]
        else:
            parts.append((name, (out_f, in_f // 32 * GGML_BYTES_PER_32[fmt]), torch.uint8))
    # 1-D tensors: bf16 (bf16, fp8 mixed: the compute dtype), float32 in GGUF files (as ComfyUI-GGUF's convert keeps)
    vector_dtype = torch.bfloat16 if fmt in ("bf16", "fp8_mixed") else torch.float32
    return parts + [(name, shape, vector_dtype) for name, shape in vectors]


def wan14b_rows():
    import torch
    from torch import nn
    from layerwise_offload.offload.host.packing import plan_layout

    rows = []
    for fmt in FORMATS:
        named = [(n, nn.Parameter(torch.empty(s, dtype=d, device="meta"), requires_grad=False))
                 for n, s, d in wan14b_block_parts(fmt)]
        rows.append((fmt, plan_layout(named).nbytes))
    return rows


def main() -> int:
    comfy_env = _import_pack()
    comfy_env.import_comfyui(cpu=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = measure_tiny(Path(tmp))
    base = dict((name, nbytes) for name, _, nbytes in tiny)["bf16"]
    print("Tiny Wan 2.1 (4 blocks, dim 256), every block streamed, measured (manager stats, last forward):\n")
    print("| format | blocks streamed | bytes per forward | vs bf16 |\n| --- | --- | --- | --- |")
    for name, streamed, nbytes in tiny:
        print(f"| {name} | {streamed} | {nbytes:,} | {nbytes / base:.2f} |")
    rows = wan14b_rows()
    base = dict(rows)["bf16"]
    print("\nWan 2.1 14B block shape (dim 5120, ffn 13824), bytes one streamed block puts on the wire "
          "(plan_layout of the stored parts):\n")
    print("| format | bytes per block | MiB | vs bf16 |\n| --- | --- | --- | --- |")
    for fmt, nbytes in rows:
        print(f"| {fmt} | {nbytes:,} | {nbytes / 2**20:.1f} | {nbytes / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
