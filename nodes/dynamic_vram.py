"""Newer ComfyUI (2026) on NVIDIA loads weights through "dynamic VRAM" (comfy-aimdo).

There weights are faulted in on demand by ComfyUI's own ops, pin/unpin calls raise, and LoRA
lives in ``weight_lowvram_function``, which ComfyUI only applies while the weight is *not* on the
device yet: a block the manager already placed would silently run without its LoRA. So the node
takes the model over as an ordinary (non-dynamic) patcher, the way ComfyUI itself demotes a
dynamic model for torch.compile, and says so in the log; when that is impossible it stops with an
error that tells what to do. It never streams under dynamic VRAM silently.
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger("layerwise_offload")

DISABLE_FLAG = "--disable-dynamic-vram"


def is_dynamic(patcher) -> bool:
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def non_dynamic_patcher(patcher):
    """``patcher`` itself when it is an ordinary ModelPatcher; a non-dynamic clone otherwise."""
    if not is_dynamic(patcher):
        return patcher
    clone = getattr(patcher, "clone")
    if "disable_dynamic" not in inspect.signature(clone).parameters:
        raise RuntimeError(
            f"[layerwise-offload] this ComfyUI loads the model with dynamic VRAM but offers no way to turn it "
            f"off for one model; start ComfyUI with {DISABLE_FLAG} to use Layerwise Offload")
    try:
        demoted = clone(disable_dynamic=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"[layerwise-offload] the model was loaded with ComfyUI's dynamic VRAM and could not be reloaded "
            f"without it ({error}). Load it with a core loader node (Load Diffusion Model, Load Checkpoint) "
            f"or start ComfyUI with {DISABLE_FLAG}") from error
    log.warning("[layerwise-offload] the model was loaded with ComfyUI's dynamic VRAM; the offload takes it over "
                "as an ordinary model (ComfyUI reloads its weights once). Start ComfyUI with %s to skip the "
                "reload", DISABLE_FLAG)
    return demoted
