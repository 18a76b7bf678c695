"""Finding a DiT's transformer blocks, in the order the model runs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from torch import nn

from ..offload import weight_units

# (families, block-list attributes on the diffusion model in call order). The first entry whose
# first attribute is a non-empty ModuleList wins; later attributes are taken when present.
BLOCK_LAYOUTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Flux, Flux 2, Chroma, HunyuanVideo", ("double_blocks", "single_blocks")),
    ("HiDream", ("double_stream_blocks", "single_stream_blocks")),
    ("SD3, SD3.5", ("joint_blocks",)),
    ("Qwen-Image, LTXV", ("transformer_blocks",)),
    ("Lumina 2, Z-Image", ("context_refiner", "noise_refiner", "layers")),
    # VACE blocks run interleaved with the main ones; listing them after keeps them managed, and
    # the manager copes with the order differing from the list.
    ("Wan 2.1, Wan 2.2 (VACE included)", ("blocks", "vace_blocks")),
)

SUPPORTED_FAMILIES = ", ".join(family for family, _ in BLOCK_LAYOUTS)


# Models that use their blocks' weights without calling the blocks, so the blocks' hooks never fire: their weights
# would be read where they were released (on a GPU: the host copy, a device mismatch or a copy per call).
BLOCKS_USED_WITHOUT_CALLS = {
    "WanAnimate2Model": "calls block.forward_pose, block.kv_from_input and block.forward_gen, never the blocks",
}


class UnsupportedModelError(ValueError):
    pass


def streaming_refusal(diffusion_model: nn.Module) -> Optional[str]:
    """Why this model's blocks cannot be streamed by their hooks, or None."""
    how = BLOCKS_USED_WITHOUT_CALLS.get(type(diffusion_model).__name__)
    if how is None:
        return None
    return f"passed through: {type(diffusion_model).__name__} {how}, so its blocks cannot be streamed"


@dataclass(frozen=True)
class DiscoveredBlocks:
    family: str
    attributes: Tuple[str, ...]
    blocks: Tuple[nn.Module, ...]
    prefixes: Tuple[str, ...]  # state-dict prefix of each block inside the diffusion model
    # With residency_policy weights, ``blocks`` are the weight units of the transformer blocks (offload/units.py),
    # and these the transformer blocks themselves
    transformer_blocks: Tuple[nn.Module, ...] = ()
    block_of: Tuple[int, ...] = ()  # with weight units: per unit, the index of its transformer block

    @property
    def streams_weights(self) -> bool:
        return bool(self.transformer_blocks)

    @property
    def whole_blocks(self) -> Tuple[nn.Module, ...]:
        """The transformer blocks, whatever is streamed."""
        return self.transformer_blocks or self.blocks

    def __len__(self) -> int:
        return len(self.blocks)


def _module_list(model: nn.Module, name: str):
    value = getattr(model, name, None)
    return value if isinstance(value, nn.ModuleList) and len(value) > 0 else None


def discover_blocks(diffusion_model: nn.Module) -> DiscoveredBlocks:
    """The transformer blocks of a supported DiT, as one call-ordered list."""
    for family, attributes in BLOCK_LAYOUTS:
        if _module_list(diffusion_model, attributes[0]) is None:
            continue
        blocks: List[nn.Module] = []
        prefixes: List[str] = []
        found = []
        for name in attributes:
            module_list = _module_list(diffusion_model, name)
            if module_list is None:
                continue
            found.append(name)
            for index, block in enumerate(module_list):
                blocks.append(block)
                prefixes.append(f"{name}.{index}.")
        return DiscoveredBlocks(family, tuple(found), tuple(blocks), tuple(prefixes))
    raise UnsupportedModelError(
        f"{type(diffusion_model).__name__} is not a supported diffusion transformer: none of its "
        f"attributes is a transformer block list this pack knows. Supported families: {SUPPORTED_FAMILIES}. "
        f"UNet models (SD1.5, SDXL) have no block list to stream; use ComfyUI's own memory management for them.")


def as_weight_units(discovered: DiscoveredBlocks) -> DiscoveredBlocks:
    """``discovered`` with its blocks' weight units in place of the blocks (residents first, as the planner wants
    them); each unit's state-dict prefix is its block's and its path in the block."""
    units = weight_units(discovered.blocks).residents_first()
    prefixes = tuple(discovered.prefixes[block] + (name.split(".", 1)[1] + "." if "." in name else "")
                     for name, block in zip(units.names, units.block_of))
    return DiscoveredBlocks(discovered.family, discovered.attributes, units.units, prefixes,
                            transformer_blocks=discovered.blocks, block_of=units.block_of)
