"""The LayerwiseOffload node's words, defaults and checks, and the Stats node's output. Node classes stay thin over
this and over :func:`nodes.controller.offload_model`, the node's work."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ..offload import DISK_DIR_ENV, HOST_STORES, POLICIES, disk_tier_unsupported, remove_stale_files
from .discovery import SUPPORTED_FAMILIES
from .device_support import CPU_LOOPBACK_ENV

NODE_ID = "LayerwiseOffload"
DISPLAY_NAME = "Layerwise Offload (DiT)"
CATEGORY = "model_patches/layerwise_offload"

DESCRIPTION = (
    "Keeps the first resident_layers transformer blocks of a diffusion transformer in VRAM and streams "
    "the rest from (pinned) host memory, copying prefetch_size blocks ahead on a side stream. Output "
    "is bitwise identical to running without it. Supported: " + SUPPORTED_FAMILIES + ".")

#: One to three short sentences each: what the input does, its default, where to read more (docs/nodes.md in the
#: pack's folder); no measured figures and no environment variables (they change; the docs carry them).
TOOLTIPS = {
    "model": "A diffusion transformer from a loader (Load Diffusion Model, Load Checkpoint, Unet Loader (GGUF)), "
             "before or after LoRA loaders.",
    "resident_layers": (
        "How many of the first transformer blocks stay in VRAM; the rest stream from RAM every step. "
        "Default -1 = auto: as many as fit. 0 streams every block. More: docs/nodes.md"),
    "prefetch_size": (
        "How many streamed blocks are copied ahead of the one computing; each costs one block of VRAM. "
        "Default 1 (auto may copy further ahead)."),
    "residency_policy": (
        "auto (default) picks the plan predicted fastest on this GPU. leading: first blocks stay. strided: streamed "
        "blocks spread out. weights: stream layer by layer, least VRAM. More: docs/nodes.md"),
    "pin_memory": (
        "Page-lock the RAM copy of streamed blocks for fast asynchronous copies. Default on; turn off when system RAM "
        "is short (copies get slower)."),
    "host_store": (
        "Where streamed blocks wait. auto (default): RAM, and disk for what RAM cannot hold. ram: all in RAM. "
        "disk: all read from disk, for models bigger than RAM. More: docs/nodes.md"),
}

AUTO_RESIDENT = -1  # resident_layers value that asks for the automatic plan
AUTO_POLICY = "auto"
WEIGHTS_POLICY = "weights"  # stream weight by weight (offload/units.py): the fewest bytes a step, auto-planned
NODE_POLICIES = (AUTO_POLICY,) + tuple(POLICIES) + (WEIGHTS_POLICY,)
DEFAULTS = {"resident_layers": AUTO_RESIDENT, "prefetch_size": 1, "residency_policy": AUTO_POLICY, "pin_memory": True,
            "host_store": "auto"}
MAX_RESIDENT_LAYERS = 4096
MAX_PREFETCH = 64
MIN_RESIDENT_LAYERS = AUTO_RESIDENT


@dataclass(frozen=True)
class NodeInput:
    """One input of the node, declared once; nodes/v1.py and nodes/v3.py each write it in their schema's form."""

    name: str
    kind: str  # MODEL, INT, BOOLEAN or COMBO
    default: object = None
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    options: Tuple[str, ...] = ()
    # Optional: API prompts written before the input existed still validate, with its default.
    optional: bool = False

    @property
    def tooltip(self) -> str:
        return TOOLTIPS[self.name]


INPUTS = (
    NodeInput("model", "MODEL"),
    NodeInput("resident_layers", "INT", DEFAULTS["resident_layers"], MIN_RESIDENT_LAYERS, MAX_RESIDENT_LAYERS),
    NodeInput("prefetch_size", "INT", DEFAULTS["prefetch_size"], 1, MAX_PREFETCH),
    NodeInput("residency_policy", "COMBO", DEFAULTS["residency_policy"], options=NODE_POLICIES),
    NodeInput("pin_memory", "BOOLEAN", DEFAULTS["pin_memory"]),
    NodeInput("host_store", "COMBO", DEFAULTS["host_store"], options=tuple(HOST_STORES), optional=True),
)

STATS_NODE_ID = "LayerwiseOffloadStats"
STATS_DISPLAY_NAME = "Layerwise Offload Stats"
STATS_DESCRIPTION = (
    "Draws the last sampling run of an offloaded model: which blocks stayed in VRAM and which were streamed, "
    "VRAM and RAM used, copy time against compute time per step, and what to change.")
STATS_TOOLTIPS = {
    "model": "The MODEL output of a Layerwise Offload node.",
    "after": "Connect the sampler's LATENT output so the figures are read after that sampler ran.",
}


def offload_stats(model, after_connected: bool = True):
    """The Stats node's text and its picture data (nodes/stats_view.py)."""
    from .stats_view import stats_view
    return stats_view(model, after_connected)


def stats_ui(model, after_connected: bool):
    """The Stats node's UI output (the text, as core's Preview Any sends it, and the picture data) and its text."""
    from .stats_view import UI_KEY
    text, data = offload_stats(model, after_connected)
    return {"text": [text], UI_KEY: [data]}, text


def residency_policy_problem(value) -> "str | None":
    """Why ``value`` is not a residency policy (for ComfyUI's validation when the prompt is queued), or None."""
    if value is None or value in NODE_POLICIES:  # None: fed by a link, checked when the node runs
        return None
    return f"residency_policy must be one of {', '.join(map(repr, NODE_POLICIES))}, got {value!r}"


def host_store_problem(value) -> "str | None":
    """Why ``value`` is not a host_store choice (checked when the prompt is queued), or None."""
    if value == "disk" and disk_tier_unsupported() is not None:
        return f"host_store = disk: {disk_tier_unsupported()}; use auto or ram"
    if value is None or value in HOST_STORES:
        return None
    return f"host_store must be one of {', '.join(map(repr, HOST_STORES))}, got {value!r}"


def remove_stale_disk_files() -> int:
    """At ComfyUI's start: the cache files a killed server left in $LAYERWISE_OFFLOAD_DISK_DIR (ComfyUI empties
    its own temp folder, the default, itself). Returns how many were removed."""
    chosen = os.environ.get(DISK_DIR_ENV)
    return remove_stale_files(chosen) if chosen else 0


__all__ = ["offload_stats", "stats_ui", "residency_policy_problem", "host_store_problem", "HOST_STORES", "NODE_ID",
           "DISPLAY_NAME", "CATEGORY", "DESCRIPTION", "TOOLTIPS", "DEFAULTS", "INPUTS", "NodeInput", "POLICIES",
           "NODE_POLICIES", "AUTO_POLICY", "WEIGHTS_POLICY", "AUTO_RESIDENT", "CPU_LOOPBACK_ENV"]
