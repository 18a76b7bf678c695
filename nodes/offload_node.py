"""The LayerwiseOffload node: what it checks and what it hands back. Node classes stay thin over this."""

from __future__ import annotations

import logging
import os

import comfy.model_management

from ..offload import POLICIES, OffloadConfig
from .discovery import SUPPORTED_FAMILIES, discover_blocks
from .dynamic_vram import non_dynamic_patcher
from .controller import OffloadController
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
        "is never copied again; the rest are copied in every step. 0 streams every block. Raise it until "
        "VRAM is nearly full; values above the block count keep everything resident."),
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

DEFAULTS = {"resident_layers": 0, "prefetch_size": 1, "residency_policy": "leading", "pin_memory": True}
MAX_RESIDENT_LAYERS = 4096
MAX_PREFETCH = 64


def cpu_loopback_requested() -> bool:
    return os.environ.get(CPU_LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def offload_model(model, resident_layers=0, prefetch_size=1, residency_policy="leading", pin_memory=True):
    """The node's work: a clone of ``model`` whose transformer blocks are managed by the offload."""
    # Page-locking only speeds up copies to an accelerator; on the CPU loopback it would only warn.
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
    controller = OffloadController(base_model, discovered, model.load_device, config)
    log.info("[layerwise-offload] %s (%s): %d blocks in %s; plan: %d resident, prefetch %d, %s, pin_memory=%s",
             type(diffusion_model).__name__, discovered.family, len(discovered),
             "+".join(discovered.attributes), controller.manager.resident_count(), prefetch_size,
             residency_policy, bool(pin_memory))
    return make_offloaded_clone(model, controller)


__all__ = ["offload_model", "NODE_ID", "DISPLAY_NAME", "CATEGORY", "DESCRIPTION", "TOOLTIPS", "DEFAULTS",
           "POLICIES", "CPU_LOOPBACK_ENV"]
