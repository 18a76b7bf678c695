"""Newer ComfyUI (2026) on NVIDIA loads weights through "dynamic VRAM" (comfy-aimdo).

There weights are faulted in on demand by ComfyUI's own ops, pin/unpin calls raise, and LoRA
lives in ``weight_lowvram_function``, which ComfyUI only applies on its VBAR cast path: a block
the manager already placed would silently run without its LoRA. So the node takes the model over
as an ordinary (non-dynamic) patcher, the way ComfyUI itself demotes a dynamic model for hooked
conditioning, and says so in the log; when that is impossible it stops with an error that tells
what to do. It never streams under dynamic VRAM silently.

ComfyUI's ways to get an ordinary patcher, best first:
- ``clone(disable_dynamic=True, model_override=<this model>)`` (0.33+): an ordinary patcher over
  the very model the loader built. Its weights are the ones ComfyUI already holds (mapped from the
  file by aimdo, loaded by assignment), so nothing is read again and nothing is copied;
- ``get_non_dynamic_delegate()``: ComfyUI reloads the weights once without dynamic VRAM (a copy in
  RAM) and keeps that model for the next call; it needs the loader's ``cached_patcher_init``;
- ``clone(disable_dynamic=True)``: reloads the checkpoint from disk on every call;
- neither (ComfyUI 0.14.1, where dynamic VRAM is opt-in): the user has to start ComfyUI without it.
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger("layerwise_offload")

DISABLE_FLAG = "--disable-dynamic-vram"
OPT_IN_FLAG = "--fast dynamic_vram"


def is_dynamic(patcher) -> bool:
    check = getattr(patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def how_to_turn_off() -> str:
    """The advice that matches the running ComfyUI: a flag to turn dynamic VRAM off, or to drop the opt-in."""
    try:
        from comfy.cli_args import PerformanceFeature, args
    except ImportError:
        return f"start ComfyUI with {DISABLE_FLAG}"
    opt_in = hasattr(PerformanceFeature, "DynamicVRAM") and not hasattr(args, "disable_dynamic_vram")
    if opt_in:  # ComfyUI 0.14: dynamic VRAM only with --fast dynamic_vram (or a bare --fast)
        return f"start ComfyUI without {OPT_IN_FLAG} (or a bare --fast)"
    return f"start ComfyUI with {DISABLE_FLAG}"


def non_dynamic_patcher(patcher):
    """``patcher`` itself when it is an ordinary ModelPatcher; a non-dynamic one of the same model otherwise."""
    if not is_dynamic(patcher):
        return patcher
    delegate = getattr(patcher, "get_non_dynamic_delegate", None)
    clone = getattr(patcher, "clone")
    clone_takes = inspect.signature(clone).parameters
    override = getattr(patcher, "get_clone_model_override", None)
    if "model_override" in clone_takes and "disable_dynamic" in clone_takes and callable(override):
        take_over = lambda: clone(disable_dynamic=True, model_override=override())  # noqa: E731
        how = "the same model and weights, nothing reloaded or copied"
    elif callable(delegate):
        take_over, how = delegate, "ComfyUI reloads its weights once and keeps them for the next runs"
    elif "disable_dynamic" in clone_takes:
        take_over, how = (lambda: clone(disable_dynamic=True)), "ComfyUI reloads its weights at each run of the node"
    else:
        raise RuntimeError(
            f"[layerwise-offload] this ComfyUI loads the model with dynamic VRAM but offers no way to turn it "
            f"off for one model; {how_to_turn_off()} to use Layerwise Offload")
    try:
        demoted = take_over()
    except RuntimeError as error:
        raise RuntimeError(
            f"[layerwise-offload] the model was loaded with ComfyUI's dynamic VRAM and could not be reloaded "
            f"without it ({error}). Load it with a core loader node (Load Diffusion Model, Load Checkpoint) "
            f"or {how_to_turn_off()}") from error
    if demoted.model is patcher.model:
        log.info("[layerwise-offload] the model was loaded with ComfyUI's dynamic VRAM; the offload streams it "
                 "as an ordinary model (%s)", how)
    else:
        log.warning("[layerwise-offload] the model was loaded with ComfyUI's dynamic VRAM; the offload takes it "
                    "over as an ordinary model (%s). To skip the reload, %s", how, how_to_turn_off())
    return demoted


ATTACHMENT = "layerwise_offload"  # the key of the controller in a patcher's attachments (patcher.py)


def rebind_on_clone(parent, clone) -> None:
    """ComfyUI's ON_CLONE callback. Newer ComfyUI clones with ``model_override`` (multi-GPU copies, the
    non-dynamic delegate): the clone holds another model object, while the attachment it copied still
    drives the parent's blocks. Such a clone gets an offload of its own over its own blocks."""
    controller = getattr(clone, "attachments", {}).get(ATTACHMENT)
    if controller is None or clone.model is controller.base_model:
        return
    clone.attachments[ATTACHMENT] = controller.rebound(clone)


def watch_clones(patcher) -> None:
    """Register :func:`rebind_on_clone` on an offloaded patcher, once (clones inherit it)."""
    from comfy.patcher_extension import CallbacksMP
    if rebind_on_clone not in patcher.get_callbacks(CallbacksMP.ON_CLONE, ATTACHMENT):
        patcher.add_callback_with_key(CallbacksMP.ON_CLONE, ATTACHMENT, rebind_on_clone)
