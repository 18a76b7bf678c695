"""ComfyUI's own DiT classes at the released models' dimensions, one block per block list, and the resolutions a
user samples at: what bench/activation_memory.py and bench/timing_table.py run one meta-device forward of."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Tuple

import torch

from ..devtools.comfy_env import with_fields_this_comfyui_needs


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
