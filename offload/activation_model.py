"""Activation memory of one DiT forward, from the table bench/activation_memory.py measured.

Pure data and arithmetic (no ComfyUI): per model family (keyed by the diffusion model's class name and the
width of its first block, see :func:`block_width`), a line ``bytes = batch * (base + per_token * tokens)`` at
bf16, fitted to the measured rows of ``bench/results/activation_memory.csv``. Activations scale with the
compute dtype's size (float32 doubles them). Tokens are latent elements per channel divided by the family's
patch area.
"""

from __future__ import annotations

from torch import nn


def block_width(block: nn.Module) -> int:
    """The narrowest input width of a block's linear layers: its hidden size for every supported family."""
    widths = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
    return min(widths) if widths else 1
