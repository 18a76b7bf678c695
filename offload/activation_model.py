"""Activation memory of one DiT forward, from the table bench/activation_memory.py measured.

Pure data and arithmetic (no ComfyUI): per model family (keyed by the diffusion model's class name and the
width of its first block, see :func:`block_width`), a line ``bytes = batch * (base + per_token * tokens)`` at
bf16, fitted to the measured rows of ``bench/results/activation_memory.csv``. Activations scale with the
compute dtype's size (float32 doubles them). Tokens are latent elements per channel divided by the family's
patch area.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from torch import nn


def block_width(block: nn.Module) -> int:
    """The narrowest input width of a block's linear layers: its hidden size for every supported family."""
    widths = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
    return min(widths) if widths else 1


@dataclass(frozen=True)
class ActivationLine:
    """One family's fitted line: a forward's peak activation bytes per batch item at bf16 is
    ``base_bytes + bytes_per_token * tokens``."""

    family: str  # the row name in bench/results/activation_memory.csv
    model_class: str  # type(diffusion_model).__name__ in ComfyUI
    block_width: int
    latent_channels: int  # tells apart models of one class with different latents (Flux.1 / Flux 2)
    patch_area: int  # latent elements per channel that make one token
    base_bytes: int
    bytes_per_token: int


# Fitted (least relative squares) to bench/results/activation_memory.csv; refit when
# that table is remade. tests/unit/test_planner.py checks every row against these lines.
LINES: Tuple[ActivationLine, ...] = (
    ActivationLine("flux1", "Flux", 3072, 16, 4, 58_234_376, 99_989),
    ActivationLine("flux2", "Flux", 6144, 128, 1, 135_856_136, 223_516),
    ActivationLine("wan_14b", "WanModel", 5120, 16, 4, 9_570_403, 114_051),
    ActivationLine("wan_1_3b", "WanModel", 1536, 16, 4, 5_807_456, 46_461),
    ActivationLine("wan22_5b", "WanModel", 3072, 48, 4, 7_420_064, 78_462),
    ActivationLine("qwen_image", "QwenImageTransformer2DModel", 3072, 16, 4, 12_958_041, 68_666),
    ActivationLine("hunyuan_video", "HunyuanVideo", 3072, 16, 4, 29_127_176, 99_851),
    ActivationLine("sd35_large", "OpenAISignatureMMDITWrapper", 2432, 16, 4, 8_795_139, 97_792),
    ActivationLine("lumina2", "NextDiT", 2304, 16, 4, 24_994_308, 88_832),
    ActivationLine("z_image", "NextDiT", 3840, 16, 4, 30_447_620, 106_496),
    ActivationLine("ltxv", "LTXVModel", 2048, 128, 1, 1_626_371, 54_336),
)

MEASURED_DTYPE_BYTES = 2  # the table is bf16


def find_line(model_class: str, width: int, latent_channels: Optional[int] = None
              ) -> Optional[Tuple[ActivationLine, float]]:
    """The line for a model and the factor to scale it by: 1.0 for a measured width; for another width of a
    measured class (a variant with a different size), the nearest measured width scaled by the width ratio
    (activations are hidden-sized tensors per token); None for a class the table does not have. Lines with
    the model's latent channel count go first (its patch size, and so its tokens, follow the latent)."""
    same_class = [line for line in LINES if line.model_class == model_class]
    same_latent = [line for line in same_class if line.latent_channels == latent_channels]
    same_class = same_latent or same_class
    if not same_class:
        return None
    nearest = min(same_class, key=lambda line: abs(line.block_width - width))
    return nearest, (1.0 if nearest.block_width == width else width / nearest.block_width)


def tokens_for(line: ActivationLine, latent_elements_per_channel: int) -> int:
    return max(1, int(latent_elements_per_channel) // line.patch_area)


def line_bytes(line: ActivationLine, tokens: int, batch: int = 1, dtype_bytes: int = 2, scale: float = 1.0) -> int:
    per_item = line.base_bytes + line.bytes_per_token * int(tokens)
    return int(batch * per_item * scale * dtype_bytes / MEASURED_DTYPE_BYTES)
