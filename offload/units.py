"""Weight units: the modules inside the blocks that own weights, for streaming weight by weight.

Streaming whole blocks, or whole tails of blocks, needs ring slots as large as the largest streamed piece, and with
``n`` streamed blocks a step then moves at least ``D * n / (n - 2)`` for a deficit ``D`` (docs/internals.md). The
slots stop costing whole blocks when what streams is a single module's weights: a Linear, a norm. Handed these
units instead of the blocks, the manager runs unchanged: its pre/post hooks fire around each unit's own forward,
which is the code that reads the unit's weights, and its call-order learning, prefetch window, slot ring and
streamed tails (a Linear streams its bias and keeps its weight, or streams both) work per unit.

Two kinds of weights are left out, to stay on the device with the model's non-block weights
(:meth:`WeightUnits.place_rest`):

- a parameter owned directly by a module that also has weighted children (Wan's ``modulation``, LTXV's
  ``scale_shift_table``): that module's forward reads it around its children's, where no unit's hooks are;
- a module whose weights are all vectors (a norm's scale): parents read these without calling the module, for a
  fused kernel (ComfyUI 0.33's Lumina reads its q/k norms' scales through ``cast_bias_weight`` inside the
  attention's forward), and they are a few KiB a block.

A module whose weights its parent reads in any other way than by calling it would read released weights: a unit
must be called to be used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torch import nn

from .host.packing import block_parameters, plan_layout


def _owns_weights(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _only_vectors(module: nn.Module) -> bool:
    return all(param.dim() <= 1 for param in module.parameters(recurse=False))


def _has_weighted_children(module: nn.Module) -> bool:
    return any(next(child.parameters(), None) is not None for child in module.children())


@dataclass(frozen=True)
class WeightUnits:
    """The weight units of some blocks, in the blocks' order and each block's module order (the order its
    forward usually runs them; the manager learns the real one at the first forward)."""

    units: Tuple[nn.Module, ...]
    names: Tuple[str, ...]  # "<block>.<module path>", for log lines and errors
    block_of: Tuple[int, ...]  # per unit, the index of its block
    left_out: Tuple[Tuple[str, nn.Parameter], ...]  # not streamed: see the module's docstring
    blocks: Tuple[nn.Module, ...]

    def __len__(self) -> int:
        return len(self.units)

    def geometry(self) -> Tuple[List[int], List[Tuple[int, ...]]]:
        """(each unit's bytes, each unit's tail options) as the manager will pack them: what
        :func:`~.planner.plan_weight_units` plans from."""
        layouts = [plan_layout(block_parameters(unit)) for unit in self.units]
        return [layout.nbytes for layout in layouts], [layout.tail_sizes for layout in layouts]

    def residents_first(self) -> "WeightUnits":
        """The same units, those whose smallest streamable tail is largest first (ties in module order): the ones
        a plan with a small bound on what streams must keep resident lead, as the planner expects. The call order
        the manager learns at the first forward is independent of this order."""
        smallest = [options[0] for options in self.geometry()[1]]
        order = sorted(range(len(self.units)), key=lambda i: -smallest[i])
        return dataclasses.replace(self, units=tuple(self.units[i] for i in order),
                                   names=tuple(self.names[i] for i in order),
                                   block_of=tuple(self.block_of[i] for i in order))

    def left_out_nbytes(self) -> int:
        return sum(param.numel() * param.element_size() for _, param in self.left_out)

    def place_rest(self, device) -> None:
        """Move what no unit streams to ``device``: the left-out parameters and every buffer of the blocks (the
        manager moves only its units' buffers)."""
        device = torch.device(device)
        with torch.no_grad():
            for _, param in self.left_out:
                if param.device != device:
                    param.data = param.data.to(device)
            for block in self.blocks:
                for module in block.modules():
                    for name, buffer in module.named_buffers(recurse=False):
                        if buffer is not None and buffer.device != device:
                            setattr(module, name, buffer.to(device))


def weight_units(blocks: Sequence[nn.Module]) -> WeightUnits:
    """The modules of ``blocks`` that own weights, not only vectors, and have no weighted children, one unit each.

    Raises ``ValueError`` when a block has no unit at all (a block whose only weights are its own: stream it
    whole instead) or when a module appears in two blocks."""
    units: List[nn.Module] = []
    names: List[str] = []
    block_of: List[int] = []
    left_out: List[Tuple[str, nn.Parameter]] = []
    seen = set()
    for index, block in enumerate(blocks):
        found = 0
        for path, module in block.named_modules():
            if not _owns_weights(module):
                continue
            if id(module) in seen:
                raise ValueError(f"[layerwise-offload] module {index}.{path or '<block>'} belongs to two blocks: "
                                 "pass each block once")
            seen.add(id(module))
            if _has_weighted_children(module) or _only_vectors(module):
                left_out.extend((f"{index}.{path + '.' if path else ''}{name}", param)
                                for name, param in module.named_parameters(recurse=False))
                continue
            units.append(module)
            names.append(f"{index}.{path}" if path else str(index))
            block_of.append(index)
            found += 1
        if not found:
            raise ValueError(f"[layerwise-offload] block {index} ({type(block).__name__}) has no module that owns "
                             "weights without weighted children: stream it as a whole block")
    return WeightUnits(tuple(units), tuple(names), tuple(block_of), tuple(left_out), tuple(blocks))
