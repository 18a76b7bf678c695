"""A tiny SD1.5 UNet built from ComfyUI's own classes: a real model that is NOT a DiT, for error paths."""

from __future__ import annotations

import torch

from .comfy_env import import_comfyui

SD15_TINY_CONFIG = dict(
    use_checkpoint=False, image_size=32, in_channels=4, out_channels=4, model_channels=32,
    num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
    transformer_depth_middle=1, context_dim=32, num_heads=2, num_head_channels=-1, use_spatial_transformer=True,
    legacy=False, use_linear_in_transformer=False, adm_in_channels=None, use_temporal_attention=False,
    use_temporal_resblock=False, dtype=torch.float32,
)


def build_tiny_sd15(seed: int = 0):
    """A ModelPatcher around ``comfy.model_base.BaseModel`` with a tiny ``UNetModel`` (SD1.5 layout)."""
    env = import_comfyui()
    model_config = env.supported_models.SD15(dict(SD15_TINY_CONFIG))
    model = model_config.get_model({}, "")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    mm = env.model_management
    return env.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device())
