"""One planner run for every shipped template: the DiT's bytes, the system RAM it needs, and the resident count
that ``resident_layers = -1`` (auto) picks on 8/12/16/24 GB cards, written to ``devtools/template_plans.json``:
the README's memory table, each template's note and card picture come from it (devtools/make_workflows.py;
tests/e2e/test_workflows.py fails when any of them drifts).

Block sizes come from ComfyUI's own model classes at their released size, built on the ``meta`` device, in the
dtype of the file each template loads. The count is the node's own planner's (``offload/planner.py``), fed as the
node feeds it at the first step: free VRAM after the non-block weights, ComfyUI's reserve
(``minimum_inference_memory``: 0.8 GiB + 0.4 GiB on Linux), and the activation model for the template's latent
(batch 2 when CFG runs cond and uncond). Assumptions: the desktop and CUDA context take 0.5 GiB of the card, the
text encoder and VAE files have their published sizes, ComfyUI and Python take about 3 GB of RAM.

    .venv/bin/python -P devtools/template_memory.py            # Markdown table of a fresh run
    .venv/bin/python -P devtools/template_memory.py --write    # ... and rewrite devtools/template_plans.json
    .venv/bin/python -P devtools/template_memory.py --cards 10,20
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).with_name("comfy_env.py")))["enter_pack"](globals())

GiB = 2**30
GB = 10**9
CONTEXT_AND_DESKTOP = int(0.5 * GiB)
COMFY_RESERVE = int(0.8 * GiB) + 400 * 2**20  # minimum_inference_memory() on Linux, no --reserve-vram
PROCESS_RAM = 3 * GB
COMPUTE_BYTES = 2  # bf16 and fp8 checkpoints compute in 16 bits; the node sizes activations by that
# QuantStack's Wan 2.2 A14B Q4_K_M files: about 9.84 GB for 14.3 B weights. K-quants mix 4- and 6-bit blocks and
# keep 1-D tensors in float32, so the file's average stands in for every weight.
GGUF_Q4_K_M_BYTES = 9.84e9 / 14.29e9
CARDS = (8, 12, 16, 24)
PLANS_FILE = Path(__file__).with_name("template_plans.json")


@dataclass(frozen=True)
class Template:
    key: str  # the workflow's builder in devtools/make_workflows.py
    name: str
    comfy_config: str  # class in comfy.supported_models
    unet_config: Dict
    stored_bytes: float  # bytes per weight in the file the template loads (GGUF: the file's average)
    latent: Tuple[int, ...]  # one latent, as the sampler passes it (batch first)
    cfg_batch: int  # 2 when CFG > 1 runs cond and uncond together
    experts: int  # diffusion models in the graph (Wan 2.2: high + low noise)
    other_files_gb: float  # text encoder(s) + VAE, published file sizes
    prefetch: int = 1  # the template's prefetch_size (the slot ring holds prefetch + 1 blocks)


def _templates(presets) -> List[Template]:
    hunyuan = dict(image_model="hunyuan_video", in_channels=16, out_channels=16, patch_size=[1, 2, 2],
                   vec_in_dim=768, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=4096, hidden_size=3072,
                   mlp_ratio=4.0, num_heads=24, depth=20, depth_single_blocks=40, theta=256, qkv_bias=True,
                   byt5=False, guidance_embed=True)
    return [
        Template("flux1_dev", "Flux.1 dev, 1024x1024", "Flux", {**presets.FLUX_DEV, "depth": 19, "depth_single_blocks": 38},
                 2, (1, 16, 128, 128), 1, 1, 9.79 + 0.25 + 0.34),
        Template("wan21_t2v_14b", "Wan 2.1 T2V 14B, 832x480x33", "WAN21_T2V", {**presets.WAN21_14B, "num_layers": 40},
                 2, (1, 16, 9, 60, 104), 2, 1, 6.74 + 0.25),
        Template("wan22_t2v_a14b", "Wan 2.2 T2V A14B, 640x640x81 (per expert)", "WAN21_T2V", {**presets.WAN21_14B, "num_layers": 40},
                 2, (1, 16, 21, 80, 80), 2, 2, 6.74 + 0.25),
        Template("wan22_t2v_a14b_fp8", "Wan 2.2 T2V A14B fp8, 640x640x81 (per expert)", "WAN21_T2V",
                 {**presets.WAN21_14B, "num_layers": 40}, 1, (1, 16, 21, 80, 80), 2, 2, 6.74 + 0.25),
        Template("wan22_t2v_a14b_gguf", "Wan 2.2 T2V A14B GGUF Q4_K_M, 640x640x81 (per expert)", "WAN21_T2V",
                 {**presets.WAN21_14B, "num_layers": 40}, GGUF_Q4_K_M_BYTES, (1, 16, 21, 80, 80), 2, 2, 6.74 + 0.25),
        Template("qwen_image", "Qwen-Image (fp8), 1328x1328", "QwenImage", {**presets.QWEN_IMAGE, "num_layers": 60},
                 1, (1, 16, 1, 166, 166), 2, 1, 9.38 + 0.25),
        Template("hunyuan_video", "HunyuanVideo T2V, 848x480x73 (prefetch 2)", "HunyuanVideo", hunyuan, 2,
                 (1, 16, 19, 60, 106), 1, 1, 9.09 + 0.25 + 0.49, prefetch=2),
    ]


def _sizes(t: Template, discovery):
    import comfy.supported_models
    import torch
    from torch import nn

    from .comfy_env import with_fields_this_comfyui_needs

    cfg_cls = getattr(comfy.supported_models, t.comfy_config)
    unet_config = with_fields_this_comfyui_needs({**cfg_cls.unet_config, **t.unet_config})
    if not cfg_cls.matches(unet_config):
        raise AssertionError(f"{t.comfy_config}.matches() rejects {unet_config}")
    model_config = cfg_cls(unet_config)
    model_config.set_inference_dtype(torch.bfloat16, None)
    with torch.device("meta"):
        dit = model_config.get_model({}, "").diffusion_model
    found = discovery.discover_blocks(dit)
    blocks = [int(sum(p.numel() for p in b.parameters()) * t.stored_bytes) for b in found.blocks]
    total = int(sum(p.numel() for p in dit.parameters()) * t.stored_bytes)
    widths = [m.in_features for m in found.blocks[0].modules() if isinstance(m, nn.Linear)]
    return blocks, total - sum(blocks), min(widths), type(dit).__name__


def plan_templates(cards_gb: Sequence[int] = CARDS) -> Dict:
    """Run the planner for every template and card (imports ComfyUI, builds on meta): what template_plans.json
    holds. ``resident`` per card is the count auto keeps, or None where even streaming every block does not fit."""
    from .comfy_env import import_comfyui, import_pack_modules

    import_comfyui(cpu=True, import_nodes=False)
    planner, discovery, presets = import_pack_modules("offload.planner", "nodes.discovery", "devtools.dit_presets")
    out = []
    for t in _templates(presets):
        blocks, non_block, hidden, model_class = _sizes(t, discovery)
        latent = (t.cfg_batch,) + t.latent[1:]
        activations = planner.forward_activation_bytes(  # what the node computes from x
            model_class, hidden, math.prod(latent[2:]), batch=latent[0], dtype_bytes=COMPUTE_BYTES,
            latent_channels=latent[1]).nbytes
        resident = []
        for card in cards_gb:
            free = card * GiB - CONTEXT_AND_DESKTOP - non_block
            plan = planner.plan_residency(blocks, max(free, 0), reserve_bytes=COMFY_RESERVE,
                                          activation_bytes=activations, prefetch_size=t.prefetch)
            resident.append(plan.resident_count if plan.fits else None)
        dit_bytes = (sum(blocks) + non_block) * t.experts
        out.append({"key": t.key, "name": t.name, "block_bytes": blocks, "non_block_bytes": non_block,
                    "experts": t.experts, "prefetch": t.prefetch, "dit_bytes": dit_bytes,
                    "ram_bytes": int(dit_bytes + t.other_files_gb * GB + PROCESS_RAM),
                    "activation_bytes": activations, "resident": resident})
    return {"cards_gib": list(cards_gb), "context_and_desktop_bytes": CONTEXT_AND_DESKTOP,
            "comfy_reserve_bytes": COMFY_RESERVE, "process_ram_bytes": PROCESS_RAM, "templates": out}


def load_plans(path: Path = PLANS_FILE) -> Dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def dump_plans(plans: Dict) -> str:
    # One template per line: a diff shows which template's plan changed.
    head = json.dumps({k: v for k, v in plans.items() if k != "templates"})
    return head[:-1] + ', "templates": [\n' + ",\n".join(json.dumps(t) for t in plans["templates"]) + "\n]}\n"


def plan_for(plans: Dict, key: str) -> Dict:
    return next(t for t in plans["templates"] if t["key"] == key)


def disk_tier_ram_bytes(plans: Dict, t: Dict) -> int:
    """System RAM with every streamed block on disk (host_store disk, the weights left in the file by Load
    Diffusion Model (Layerwise)): each expert's non-block weights and the disk tier's staging ring (a few fixed
    chunks whatever the block size: the engine's own ``staging_ring_bytes``), the text encoder, VAE and ComfyUI.
    Residents are read from the file when the plan is armed, so they need no RAM of their own."""
    from ..offload.disk.tier import staging_ring_bytes

    ring = staging_ring_bytes(max(t["block_bytes"]))
    other = t["ram_bytes"] - t["dit_bytes"]  # text encoder + VAE + the process
    return t["experts"] * (t["non_block_bytes"] + ring) + other


def markdown_table(plans: Dict) -> List[str]:
    """The README's table from a plans dict (imports no ComfyUI)."""
    cards = plans["cards_gib"]
    lines = ["| template | blocks (avg size) | DiT in RAM | RAM needed | RAM needed with the disk tier | activations | "
             + " | ".join(f"-1 on {c} GB" for c in cards) + " |",
             "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in cards) + " |"]
    for t in plans["templates"]:
        n, picks = len(t["block_bytes"]), ["0*" if r is None else str(r) for r in t["resident"]]
        lines.append(f"| {t['name']} | {n} ({sum(t['block_bytes']) / n / GB:.2f} GB) | {t['dit_bytes'] / GB:.1f} GB | "
                     f"{t['ram_bytes'] / GB:.0f} GB | {disk_tier_ram_bytes(plans, t) / GB:.0f} GB | "
                     f"{t['activation_bytes'] / GB:.1f} GB | " + " | ".join(picks) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cards", default=",".join(map(str, CARDS)),
                    help="card sizes in GB (GiB of VRAM), comma separated")
    ap.add_argument("--write", action="store_true", help=f"rewrite {PLANS_FILE.name} (the default cards only)")
    a = ap.parse_args(argv)
    cards = [int(c) for c in a.cards.split(",")]
    plans = plan_templates(cards)
    if a.write:
        if tuple(cards) != CARDS:
            ap.error(f"--write keeps the cards the README and notes use ({CARDS})")
        PLANS_FILE.write_text(dump_plans(plans), encoding="utf-8")
        print(f"wrote {PLANS_FILE}; now run devtools/make_workflows.py (notes, pictures, README table)")
    print("\n".join(markdown_table(plans)))
    print(f"\nCards: N GiB total, {CONTEXT_AND_DESKTOP / GiB:.1f} GiB for the desktop and CUDA context, the non-block "
          f"weights, ComfyUI's reserve ({COMFY_RESERVE / GiB:.1f} GiB) and the activation estimate come off first. "
          f"RAM needed: the DiT(s) + text encoder + VAE files + ~{PROCESS_RAM / GB:.0f} GB for ComfyUI itself. "
          "0*: even with every block streamed the estimate does not fit; auto streams everything, and a smaller "
          "latent (resolution, frames) is the fix if it runs out of memory.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
