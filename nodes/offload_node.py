"""The LayerwiseOffload node: what it checks and what it hands back. Node classes stay thin over this."""

from __future__ import annotations

import logging
import os

import comfy.model_management

from ..offload import POLICIES, OffloadConfig, resolve_resident_count
from .discovery import SUPPORTED_FAMILIES, discover_blocks
from .dynamic_vram import non_dynamic_patcher, watch_clones
from .controller import AUTO_RESIDENT, OffloadController
from .patcher import make_offloaded_clone

log = logging.getLogger("layerwise_offload")

NODE_ID = "LayerwiseOffload"
DISPLAY_NAME = "Layerwise Offload (DiT)"
CATEGORY = "model_patches/layerwise_offload"
CPU_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_CPU_LOOPBACK"

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
        "hidden behind compute; each extra block costs one block of VRAM."),
    "residency_policy": (
        "leading: the first blocks stay resident. strided: the streamed blocks are spread evenly over "
        "the step, so each copy overlaps resident compute (can help when PCIe is shared)."),
    "pin_memory": (
        "Page-lock the host copy of the blocks for fast asynchronous copies. Turn off when system RAM "
        "is short; copies get slower."),
}

DEFAULTS = {"resident_layers": AUTO_RESIDENT, "prefetch_size": 1, "residency_policy": "leading", "pin_memory": True}
MAX_RESIDENT_LAYERS = 4096
MAX_PREFETCH = 64
MIN_RESIDENT_LAYERS = AUTO_RESIDENT

STATS_NODE_ID = "LayerwiseOffloadStats"
STATS_DISPLAY_NAME = "Layerwise Offload Stats"
STATS_DESCRIPTION = (
    "Shows the last sampling run of an offloaded model: blocks resident and streamed, bytes copied per step, "
    "GB/s, time waited for copies, peak VRAM, pinned RAM, and what to change.")
STATS_TOOLTIPS = {
    "model": "The MODEL output of a Layerwise Offload node.",
    "after": "Connect the sampler's LATENT output so the figures are read after that sampler ran.",
}


def offload_stats_text(model) -> str:
    """The stats node's text: the last run's figures and a recommendation in words."""
    from .patcher import LayerwiseOffloadPatcherMixin
    controller = getattr(model, "attachments", {}).get(LayerwiseOffloadPatcherMixin.ATTACHMENT)
    if controller is None:
        return "This MODEL is not offloaded: connect the output of a Layerwise Offload node."
    if controller.last_report is None:
        return "No sampling run finished yet with this model: queue the prompt, then read this again."
    text = f"{controller.last_report.figures()}\n{controller.last_recommendation}"
    return text if not controller.auto else f"{auto_plan_text(controller)}\n{text}"


def auto_plan_text(controller) -> str:
    """The auto plan in the words of its log line, without the log prefix."""
    from ..offload.planner import describe, format_bytes
    if controller.last_plan is None:
        return "auto plan: not made yet"
    line = describe(controller.last_plan).replace("[layerwise-offload] ", "", 1)
    activations = getattr(controller, "last_activations", None)
    if activations is not None:
        line += f"; activations {format_bytes(activations.nbytes)} ({activations.source})"
    return line


def residency_policy_problem(value) -> "str | None":
    """Why ``value`` is not a residency policy (for ComfyUI's validation when the prompt is queued), or None."""
    if value is None or value in POLICIES:  # None: fed by a link, checked when the node runs
        return None
    return f"residency_policy must be one of {', '.join(map(repr, POLICIES))}, got {value!r}"


def cpu_loopback_requested() -> bool:
    return os.environ.get(CPU_LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def offload_model(model, resident_layers=AUTO_RESIDENT, prefetch_size=1, residency_policy="leading", pin_memory=True):
    """The node's work: a clone of ``model`` whose transformer blocks are managed by the offload."""
    # Page-locking only speeds up copies to an accelerator; on the CPU loopback it would only warn.
    auto = resident_layers == AUTO_RESIDENT
    if auto:
        resident_layers = 0  # until the first forward, when the free VRAM and the latent are known
    pin = bool(pin_memory) and not comfy.model_management.is_device_cpu(model.load_device)
    config = OffloadConfig(resident_layers=resident_layers, prefetch_size=prefetch_size,
                           policy=residency_policy, pin_memory=pin)
    discover_blocks(model.get_model_object("diffusion_model"))  # a non-DiT fails here, before anything else
    if comfy.model_management.is_device_cpu(model.load_device) and not cpu_loopback_requested():
        log.info("[layerwise-offload] ComfyUI computes on the CPU: offload has no effect, passing the model "
                 "through (set %s=1 to run the offload on the CPU anyway)", CPU_LOOPBACK_ENV)
        return model.clone()
    model = non_dynamic_patcher(model)
    base_model = model.model
    diffusion_model = model.get_model_object("diffusion_model")
    discovered = discover_blocks(diffusion_model)
    controller = OffloadController(base_model, discovered, model.load_device, config, auto=auto)
    refusal = controller.manager.host_memory_shortfall(
        f"{DISPLAY_NAME}: resident_layers={-1 if auto else resident_layers}, prefetch_size={prefetch_size}, "
        f"residency_policy={residency_policy}, pin_memory={pin_memory}")
    if refusal is not None:  # here, so ComfyUI reports it against this node and its settings, not the sampler
        raise MemoryError(refusal)
    log.info("[layerwise-offload] %s (%s): %d blocks in %s; plan: %s resident, prefetch %d, %s, pin_memory=%s",
             type(diffusion_model).__name__, discovered.family, len(discovered), "+".join(discovered.attributes),
             "auto" if auto else resolve_resident_count(config.resident_layers, len(discovered)), prefetch_size,
             residency_policy, pin)
    offloaded = make_offloaded_clone(model, controller)
    watch_clones(offloaded)
    return offloaded


__all__ = ["offload_model", "offload_stats_text", "residency_policy_problem", "NODE_ID", "DISPLAY_NAME", "CATEGORY", "DESCRIPTION", "TOOLTIPS", "DEFAULTS",
           "POLICIES", "CPU_LOOPBACK_ENV"]
