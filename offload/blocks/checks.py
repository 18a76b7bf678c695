"""What the manager checks and fixes on the blocks it is given, outside its per-step work."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn


def check_no_shared_parameters(named_params: Sequence[List[Tuple[str, nn.Parameter]]]) -> None:
    """Blocks that share a parameter cannot be streamed separately: one release would take it from the other."""
    owner: Dict[int, int] = {}
    for index, named in enumerate(named_params):
        for name, param in named:
            first = owner.setdefault(id(param), index)
            if first != index:
                raise ValueError(
                    f"parameter {name!r} of block {index} is shared with block {first}; "
                    f"blocks that share weights cannot be offloaded separately")


def move_block_buffers(blocks: Sequence[nn.Module], device: torch.device) -> None:
    """Buffers (not parameters) stay with their modules: small, and read by the model's own code as they are."""
    for block in blocks:
        for module in block.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[key] = buffer.to(device)
