"""A tiny SD1.5-family UNet from ComfyUI's own classes: a real model that is NOT a DiT, for the error paths.
``UNETLoader`` detects its file (devtools/e2e_assets.py) as ``SD15``: model_channels 320 and context_dim 768 are
fixed by ComfyUI's matcher; one level, one res block, one transformer block (~17M parameters), float16."""

from __future__ import annotations

import torch

from .comfy_env import import_comfyui
from .tiny_dits import init_tiny_weights


def build_tiny_sd15(seed: int = 0):
    """A ModelPatcher around ``comfy.model_base.BaseModel`` with the tiny ``UNetModel``, weights from ``seed``."""
    env = import_comfyui()
    cfg_cls = env.supported_models.SD15
    model_config = cfg_cls({
        **cfg_cls.unet_config, "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True,
        "legacy": False, "in_channels": 4, "out_channels": 4, "num_res_blocks": [1], "channel_mult": [1],
        "transformer_depth": [1], "transformer_depth_output": [1, 1], "transformer_depth_middle": 1,
        "use_temporal_resblock": False})
    model_config.set_inference_dtype(torch.float16, None)
    model = model_config.get_model({}, "")
    init_tiny_weights(model.diffusion_model, seed)
    mm = env.model_management
    return env.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                          offload_device=mm.unet_offload_device())
