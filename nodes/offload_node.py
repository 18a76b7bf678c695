"""The LayerwiseOffload node's words, defaults and checks, and the Stats node's output. Node classes stay thin over
this and over :func:`nodes.controller.offload_model`, the node's work."""

from __future__ import annotations

import os

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

TOOLTIPS = {
    "model": "A diffusion transformer from a model loader (Load Diffusion Model / Load Checkpoint).",
    "resident_layers": (
        "How many of the first blocks the model runs stay in VRAM for the whole run. Each resident block "
        "is never copied again; the rest are copied in every step. -1 (auto, the default) keeps as many as "
        "fit in the free VRAM at the first step of each run, after room for this latent's activations and "
        "ComfyUI's reserve. A number of your own wins: 0 streams every block; values above the block count "
        "keep everything resident."),
    "prefetch_size": (
        "How many streamed blocks are copied ahead of the one computing. 1 is enough when copies are "
        "hidden behind compute; each extra block costs one block of VRAM. With residency_policy auto, the "
        "least it copies ahead."),
    "residency_policy": (
        "auto (the default): at the first step of each run, the policy and prefetch depth this card is predicted "
        "to run fastest with (a timing model of its copies and compute; on an unknown device, leading). leading: "
        "the first blocks stay resident. strided: the streamed blocks are spread evenly over the step, so each "
        "copy overlaps resident compute. weights: each layer's weights stream on their own instead of whole "
        "blocks, planned at each run's first step from the free VRAM (resident_layers must be -1): the fewest "
        "bytes a step of all, in less VRAM than whole blocks need. Predicted as fast for Wan, HunyuanVideo and on "
        "smaller cards; up to 1.4x slower for Flux and Qwen-Image on fast cards, where copies take about as long "
        "as the compute."),
    "pin_memory": (
        "Page-lock the host copy of the blocks for fast asynchronous copies. Turn off when system RAM "
        "is short; copies get slower."),
    "host_store": (
        "Where the blocks' host copies live. auto (the default): in RAM while it keeps a safety margin free, "
        "the rest (the blocks latest in the step) in a cache file on disk, read back ahead of use every step; on a "
        "disk too slow for that (its read rate is measured at first use, or set by $LAYERWISE_OFFLOAD_DISK_READ_RATE) "
        "only the blocks RAM cannot hold go there. "
        "ram: all in RAM (fastest; refused when RAM is short). disk: all on disk, RAM holds only a small "
        "staging ring (for models bigger than free RAM; needs a fast SSD). The file goes in ComfyUI's temp "
        "folder (or $" + DISK_DIR_ENV + ") and is deleted when the model is unloaded or ComfyUI exits."),
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


__all__ = ["offload_stats", "stats_ui", "residency_policy_problem", "host_store_problem", "HOST_STORES", "NODE_ID", "DISPLAY_NAME", "CATEGORY", "DESCRIPTION", "TOOLTIPS", "DEFAULTS",
           "POLICIES", "NODE_POLICIES", "AUTO_POLICY", "WEIGHTS_POLICY", "AUTO_RESIDENT", "CPU_LOOPBACK_ENV"]
