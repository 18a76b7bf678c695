"""Benchmark-size DiTs built from ComfyUI's OWN model classes, with random weights: real-size blocks (the released
models' hidden size, heads and MLP) and real latent and text sizes, but fewer blocks, so a run fits in minutes while
each block's copy and compute is what a user's GPU sees.

``build`` returns a ``ModelPatcher`` as ``comfy.sd.load_diffusion_model`` would (weights on ComfyUI's offload device,
in the preset's dtype). Unlike devtools/tiny_dits.py it works for whichever device ComfyUI was imported for, and it
draws the random weights on the compute device when that is a GPU (a few GiB of ``torch.randn`` on one CPU core
would take minutes). ComfyUI must already be imported (``devtools/comfy_env.import_comfyui``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from .comfy_env import with_fields_this_comfyui_needs

__all__ = ["Preset", "PRESETS", "build", "conditioning", "sample"]


@dataclass(frozen=True)
class Preset:
    """One benchmark model: a ComfyUI config class, its unet_config, and what sampling feeds it. ``block_keys`` set
    the block counts (in call order), ``blocks`` their defaults here (fewer than the released ``full_blocks``)."""

    name: str
    comfy_config: str  # class name in comfy.supported_models
    unet_config: Dict[str, Any]
    block_keys: Tuple[str, ...]
    blocks: Tuple[int, ...]
    full_blocks: Tuple[int, ...]
    latent_shape: Tuple[int, ...]
    context_shape: Tuple[int, ...]  # (batch, tokens, dim) of the text conditioning
    pooled_dim: Optional[int] = None
    guidance: Optional[float] = None
    cfg: float = 1.0  # cfg == 1 runs one forward per step (cond only); > 1 runs cond and uncond
    dtype: torch.dtype = torch.bfloat16
    notes: str = ""

    def config_with_blocks(self, blocks: Optional[Sequence[int]] = None) -> Dict[str, Any]:
        counts = tuple(blocks) if blocks is not None else self.blocks
        if len(counts) != len(self.block_keys):
            raise ValueError(f"preset {self.name} takes {len(self.block_keys)} block counts "
                             f"({', '.join(self.block_keys)}), got {list(counts)}")
        if any(c < 0 for c in counts) or sum(counts) < 1:
            raise ValueError(f"block counts must be >= 0 with at least one block, got {list(counts)}")
        return {**self.unet_config, **dict(zip(self.block_keys, counts))}


FLUX_DEV = dict(
    image_model="flux", guidance_embed=True, in_channels=16, out_channels=16, vec_in_dim=768,
    context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24, axes_dim=[16, 56, 56], theta=10000,
    patch_size=2, qkv_bias=True,
)

WAN21_14B = dict(
    image_model="wan2.1", model_type="t2v", dim=5120, num_heads=40, ffn_dim=13824, text_dim=4096,
    in_dim=16, out_dim=16, freq_dim=256, patch_size=(1, 2, 2), window_size=(-1, -1), qk_norm=True,
    cross_attn_norm=True, eps=1e-6,
)

QWEN_IMAGE = dict(
    image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
)

# A Flux-shaped model small enough for the CPU (float32): 2 double + 4 single blocks, hidden 128.
TINY_FLUX = dict(
    image_model="flux", guidance_embed=True, in_channels=16, out_channels=16, vec_in_dim=32,
    context_in_dim=64, hidden_size=128, mlp_ratio=4.0, num_heads=2, axes_dim=[16, 24, 24], theta=10000,
    patch_size=2, qkv_bias=True,
)

# A Wan 2.1 small enough for the CPU, in the shapes ComfyUI's detector reads back from a file (heads of 128,
# text_dim 4096), so the weight-format comparison (bench_formats.py) can reload it as fp8 mixed or GGUF.
TINY_WAN = dict(WAN21_14B, dim=256, num_heads=2, ffn_dim=512)

PRESETS: Dict[str, Preset] = {p.name: p for p in (
    Preset("flux", "Flux", FLUX_DEV, ("depth", "depth_single_blocks"), (4, 8), (19, 38),
           latent_shape=(1, 16, 128, 128), context_shape=(1, 512, 4096), pooled_dim=768, guidance=3.5, cfg=1.0,
           notes="Flux.1 dev blocks (hidden 3072, 24 heads); 1024x1024 = 4096 image + 512 text tokens; "
                 "cfg 1 (distilled guidance), one forward per step"),
    Preset("wan21_14b", "WAN21_T2V", WAN21_14B, ("num_layers",), (8,), (40,),
           latent_shape=(1, 16, 9, 60, 104), context_shape=(1, 512, 4096), cfg=5.0,
           notes="Wan 2.1 T2V 14B blocks (dim 5120, 40 heads, ffn 13824); 832x480, 33 frames = 14040 tokens; "
                 "cfg 5: cond + uncond"),
    Preset("qwen_image", "QwenImage", QWEN_IMAGE, ("num_layers",), (12,), (60,),
           latent_shape=(1, 16, 1, 128, 128), context_shape=(1, 256, 3584), cfg=2.5,
           notes="Qwen-Image blocks (24 heads of 128, text 3584); 1024x1024 = 4096 image + 256 text tokens; "
                 "cfg 2.5: cond + uncond"),
    Preset("tiny_wan", "WAN21_T2V", TINY_WAN, ("num_layers",), (4,), (4,),
           latent_shape=(1, 16, 2, 8, 8), context_shape=(1, 8, 4096), cfg=2.0,
           notes="Wan 2.1 T2V shaped, dim 256 (2 heads of 128), ffn 512, 4 blocks, 32 image tokens; for the CPU"),
    Preset("tiny", "Flux", TINY_FLUX, ("depth", "depth_single_blocks"), (2, 4), (2, 4),
           latent_shape=(1, 16, 16, 16), context_shape=(1, 8, 64), pooled_dim=32, guidance=3.5, cfg=2.0,
           dtype=torch.float32,
           notes="Flux-shaped, hidden 128, 2 double + 4 single blocks, 64 image tokens; for the CPU"),
)}


def _comfy():
    mm = sys.modules.get("comfy.model_management")
    if mm is None:
        raise RuntimeError("[layerwise-offload bench] import ComfyUI first (devtools/comfy_env.import_comfyui)")
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return mm, comfy.supported_models, comfy.model_patcher, comfy.sample


@torch.no_grad()
def init_random_weights(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Fill every parameter from ``seed``: matrices ~ N(0, 1/fan_in), 1-D norm scales ~ 1 + N(0, 0.02),
    other 1-D parameters ~ N(0, 0.02). Drawn on ``device`` (fast on a GPU) in sorted name order, then
    copied into the parameters where they live. Deterministic for a given seed and device type."""
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, param in sorted(module.named_parameters()):
        if param.ndim >= 2:
            values = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32)
            values.mul_(math.prod(param.shape[1:]) ** -0.5)
        else:
            values = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
            if name.rsplit(".", 1)[-1] in ("weight", "scale"):
                values.add_(1.0)
        param.copy_(values.to(param.dtype))


def build(preset: "Preset | str", seed: int = 0, dtype: Optional[torch.dtype] = None,
          blocks: Optional[Sequence[int]] = None, patcher_class=None):
    """A ModelPatcher of ``preset`` with random weights, built the way
    ``comfy.sd.load_diffusion_model_state_dict`` builds one (config class -> ``get_model`` -> patcher).
    ``patcher_class``: e.g. ComfyUI 0.14.1's ``CoreModelPatcher`` once dynamic VRAM is on (default ModelPatcher)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    mm, supported_models, model_patcher, _ = _comfy()
    cfg_cls = getattr(supported_models, preset.comfy_config)
    unet_config = with_fields_this_comfyui_needs({**cfg_cls.unet_config, **preset.config_with_blocks(blocks)})
    if not cfg_cls.matches(unet_config):
        raise AssertionError(f"{preset.comfy_config}.matches() rejects {unet_config}")
    model_config = cfg_cls(unet_config)
    model_config.set_inference_dtype(dtype or preset.dtype, None)
    load_device = mm.get_torch_device()
    offload_device = mm.unet_offload_device()
    with _ordinary_modules():
        model = model_config.get_model({}, "").to(offload_device)
    init_random_weights(model.diffusion_model, seed, load_device)
    model.eval()
    patcher_class = patcher_class or model_patcher.ModelPatcher
    if issubclass(patcher_class, getattr(model_patcher, "ModelPatcherDynamic", ())):
        # Dynamic VRAM's modules take their weights from a state dict at load (comfy.sd does the same), so the
        # random weights are handed over as one.
        weights = model.diffusion_model.state_dict()
        model = model_config.get_model({}, "")
        patcher = patcher_class(model, load_device=load_device, offload_device=offload_device)
        model.diffusion_model.load_state_dict(weights, strict=False, assign=True)  # as comfy.sd loads it
        model.eval()
        return patcher
    return patcher_class(model, load_device=load_device, offload_device=offload_device)


class _ordinary_modules:
    """ComfyUI 0.33+ with comfy-aimdo builds its layers without weights, to be filled from a state dict at load
    (``comfy.memory_management.aimdo_enabled``); random weights need them built as ordinary layers."""

    def __enter__(self):
        self.memory = sys.modules.get("comfy.memory_management")
        self.enabled = getattr(self.memory, "aimdo_enabled", False)
        if self.enabled:
            self.memory.aimdo_enabled = False
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.memory.aimdo_enabled = True


def conditioning(preset: "Preset | str", seed: int = 0):
    """``(positive, negative)`` CONDITIONING lists of the preset's text size, random from ``seed``."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + 1_000_003)
    out = []
    for _ in range(2):
        extra: Dict[str, Any] = {}
        context = torch.randn(preset.context_shape, generator=gen, dtype=torch.float32)
        if preset.pooled_dim is not None:
            extra["pooled_output"] = torch.randn((1, preset.pooled_dim), generator=gen, dtype=torch.float32)
        if preset.guidance is not None:
            extra["guidance"] = preset.guidance
        out.append([[context, extra]])
    return out[0], out[1]


def sample(patcher, preset: "Preset | str", seed: int = 0, steps: int = 4, callback: Optional[Callable] = None):
    """``comfy.sample.sample`` (what the KSampler node runs) from an empty latent of the preset's shape, Euler /
    simple, noise and conditioning from ``seed``. Returns the output latent (on ComfyUI's intermediate device)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    comfy_sample = _comfy()[3]
    positive, negative = conditioning(preset, seed)
    latent = comfy_sample.fix_empty_latent_channels(patcher, torch.zeros(preset.latent_shape, dtype=torch.float32))
    return comfy_sample.sample(patcher, comfy_sample.prepare_noise(latent, seed), steps, preset.cfg, "euler", "simple",
                               positive, negative, latent, callback=callback, disable_pbar=True, seed=seed)
