"""A small multi-list transformer for engine tests, the demo and the micro-benchmark.

It mixes dtypes inside a block (a bf16 gate beside fp32 weights), holds one weight that is a
transposed (non-contiguous) view, a registered buffer, and two block lists run one after the
other, like Flux's double and single blocks.
"""

from __future__ import annotations

import torch
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, transposed_out: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        if transposed_out:
            self.down.weight = nn.Parameter(torch.randn(hidden, dim).t() / hidden ** 0.5)
        self.gate = nn.Parameter(torch.randn(dim).to(torch.bfloat16))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = torch.tanh(self.mix(h)) * self.scale
        h = self.down(torch.nn.functional.gelu(self.up(h)))
        return x + h * torch.sigmoid(self.gate.float())


class ToyTransformer(nn.Module):
    """``double_blocks`` then ``single_blocks``; ``blocks_in_call_order()`` lists them as the model runs them."""

    def __init__(self, dim: int = 32, hidden: int = 64, double: int = 3, single: int = 4, seed: int = 0):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.embed = nn.Linear(dim, dim)
        self.double_blocks = nn.ModuleList(ToyBlock(dim, hidden, transposed_out=(i == 1)) for i in range(double))
        self.single_blocks = nn.ModuleList(ToyBlock(dim, hidden) for _ in range(single))
        self.head = nn.Linear(dim, dim)
        torch.random.set_rng_state(generator_state)
        self.skip = set()  # block indices (call order) to skip, as cache-style packs do
        self.order = None  # optional explicit call order

    def blocks_in_call_order(self):
        return list(self.double_blocks) + list(self.single_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        blocks = self.blocks_in_call_order()
        order = self.order if self.order is not None else range(len(blocks))
        for index in order:
            if index not in self.skip:
                x = blocks[index](x)
        return self.head(x)


def toy_and_reference(order, double: int, single: int, dim: int = 16, hidden: int = 24):
    """A fresh :class:`ToyTransformer` that runs its blocks in ``order``, an input, and the output the same model
    gives for it without any offload (the bitwise reference): ``(model, x, want)``."""
    x = torch.randn(1, 3, dim, generator=torch.Generator().manual_seed(0))
    reference = ToyTransformer(dim=dim, hidden=hidden, double=double, single=single)
    reference.order = order
    with torch.no_grad():
        want = reference(x)
    model = ToyTransformer(dim=dim, hidden=hidden, double=double, single=single)
    model.order = order
    return model, x, want
