"""A tiny SD1.5-family UNet from ComfyUI's own classes: a real model that is NOT a DiT, for the error paths.
``UNETLoader`` detects its file (devtools/e2e_assets.py) as ``SD15``: model_channels 320 and context_dim 768 are
fixed by ComfyUI's matcher; one level, one res block, one transformer block (~17M parameters), float16."""

from __future__ import annotations

import torch

from .tiny_dits import _build


def build_tiny_sd15(seed: int = 0):
    """A ModelPatcher around ``comfy.model_base.BaseModel`` with the tiny ``UNetModel``, weights from ``seed``."""
    return _build("SD15", {
        "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
        "in_channels": 4, "out_channels": 4, "num_res_blocks": [1], "channel_mult": [1], "transformer_depth": [1],
        "transformer_depth_output": [1, 1], "transformer_depth_middle": 1, "use_temporal_resblock": False,
    }, seed, torch.float16)
