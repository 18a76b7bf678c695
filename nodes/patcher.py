"""The ModelPatcher side of the offload: placement, accounting, LoRA and ComfyUI's unload paths.

ComfyUI plans VRAM from ``model_size()`` / ``loaded_size()`` and places weights in
``partially_load``. A small subclass of the input patcher's own class overrides exactly those, so
ComfyUI sees the true footprint (non-block weights + resident blocks + streaming slots), places only
non-block weights itself, and leaves block weights to the manager instead of copying them to the GPU
and having them thrown away. Clones of the output (a LoRA loader after this node) keep the subclass.
"""

from __future__ import annotations

import logging
import uuid
from typing import Dict, Type

import comfy.model_management
import comfy.patcher_extension
from comfy.patcher_extension import CallbacksMP

log = logging.getLogger("layerwise_offload")

_SUBCLASSES: Dict[type, type] = {}


def offload_weights_uuid(patches_uuid, baked: bool = False, weight_units: bool = False) -> uuid.UUID:
    """What the model's ``current_weight_patches_uuid`` says after this pack placed it with these patches.

    Never equal to a patcher's own ``patches_uuid``, so ComfyUI treats the weights as foreign and unpatches
    them before loading a clone the ordinary way; the same for every offloaded output of those patches that
    leaves the weights in the same state. Other states:

    - ``baked``: every block patch baked into the host store (ComfyUI's force_patch_weights);
    - ``weight_units``: streamed by weight units (residency_policy weights). The parameters no unit streams (a
      block's norm scales) are then patched in the module by ComfyUI's ``patch_weight_to_device``, where whole
      blocks patch them on each device copy and keep the module's unpatched. Each way reads the other's state
      wrongly (a backup taken for "patched on the device" reads as "patched in the module", and a patched module
      weight is packed as an original), so going from one to the other restores ComfyUI's backups first.
    """
    state = (":baked" if baked else "") + (":units" if weight_units else "")
    return uuid.uuid5(uuid.NAMESPACE_URL, f"layerwise-offload:{patches_uuid}{state}")


def offload_patcher_class(base: type) -> Type:
    """A subclass of ``base`` with the offload overrides, one per base class."""
    if issubclass(base, LayerwiseOffloadPatcherMixin):
        return base
    subclass = _SUBCLASSES.get(base)
    if subclass is None:
        subclass = _SUBCLASSES[base] = type(f"LayerwiseOffload{base.__name__}", (LayerwiseOffloadPatcherMixin, base), {})
    return subclass


class LayerwiseOffloadPatcherMixin:
    """Overrides on the cloned patcher; the controller lives in ``attachments`` and is shared by clones.

    The controller (``nodes/controller.py``'s ``OffloadController``) makes this clone (``make_offloaded_clone``), so
    this file does not import it: the overrides only hand ComfyUI's calls on to it."""

    ATTACHMENT = "layerwise_offload"

    @property
    def offload_controller(self):
        return self.attachments[self.ATTACHMENT]

    def model_size(self):
        controller = self.attachments.get(self.ATTACHMENT) if hasattr(self, "attachments") else None
        if controller is None:  # during ModelPatcher.__init__, before the attachment exists
            return super().model_size()
        return controller.planned_footprint()

    def get_ram_usage(self):
        # ComfyUI's RAM-pressure cache (0.14.1+) reads this, by default model_size(): here the VRAM plan.
        return self.offload_controller.host_ram_bytes()

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        controller = self.offload_controller
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            placed = offload_weights_uuid(self.patches_uuid, baked=force_patch_weights,
                                          weight_units=controller.discovered.streams_weights)
            current_uuid = self.model.current_weight_patches_uuid
            before = self.model.model_loaded_weight_memory
            if current_uuid != placed:
                # The weights are not what this offload placed with these patches: a fresh model, another
                # LoRA, or ComfyUI's own (possibly partial) load of a sibling clone. ComfyUI undoes everything it
                # did (LowVramPatch functions, pinned weights, LoRA backups) while the weights are still the ones
                # it knows; only then does the manager give the device back and re-point its blocks. The new
                # patches are baked below.
                self.unpatch_model(self.offload_device, unpatch_weights=True)
                controller.release_device_memory()
            else:
                self.unpatch_model(self.offload_device, unpatch_weights=False)
            self.patch_model(load_weights=False)
            controller.place(self, device_to, extra_memory, loaded_before=before, bake_all=force_patch_weights)
            self.model.model_lowvram = True
            self.model.device = device_to
            # Not self.patches_uuid: ComfyUI's own load of a sibling clone must see that the weights are not
            # in a state it made (LoRA baked by us, not by its load()), and restore its backups first.
            self.model.current_weight_patches_uuid = placed
            self.model.model_loaded_weight_memory = controller.loaded_bytes()
            controller.loaded_by = id(self)
            for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
                callback(self, device_to, extra_memory, force_patch_weights, False)
        return max(0, self.model.model_loaded_weight_memory - before)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        freed = self.offload_controller.free_device_memory(memory_to_free)
        self.model.model_loaded_weight_memory = self.offload_controller.loaded_bytes()
        return freed

    def detach(self, unpatch_all=True):
        controller = self.attachments.get(self.ATTACHMENT)
        if unpatch_all and controller is not None:
            # A full eviction (ComfyUI unloading the model): every device byte goes back. A detach
            # without unpatch_all is ComfyUI re-listing a model it keeps loaded; residents stay.
            controller.release_device_memory()
            controller.put_non_block_weights(self, self.offload_device)
            if controller.loaded_by == id(self):
                # Unloaded: this patcher's collection later must not set the model's loaded figure again. On the
                # CPU loopback the non-block weights stay on the "device", and a figure above 0 makes ComfyUI's
                # next load of a plain clone return early, without patching anything.
                controller.loaded_by = None
        return super().detach(unpatch_all)

    def __del__(self):
        # ComfyUI keeps a loaded model listed after its patcher is garbage collected, re-pointed at the
        # patcher's parent, which knows nothing of the manager. The patcher that loaded the model gives
        # the device memory back as it goes, so nothing stays on the device that ComfyUI cannot unload.
        controller = getattr(self, "attachments", {}).get(self.ATTACHMENT)
        if controller is not None and controller.loaded_by == id(self):
            controller.loaded_by = None
            controller.release_device_memory()
            self.model.model_loaded_weight_memory = controller.loaded_bytes()
        super().__del__()

    def clone(self, *args, **kwargs):
        clone = super().clone(*args, **kwargs)
        if not isinstance(clone, LayerwiseOffloadPatcherMixin):
            clone.__class__ = offload_patcher_class(type(clone))
        return clone


def apply_model_wrapper(executor, *args, **kwargs):
    """Installs the block hooks for exactly one forward of this model, then removes them."""
    patcher = getattr(executor.class_obj, "current_patcher", None)
    controller = getattr(patcher, "attachments", {}).get(LayerwiseOffloadPatcherMixin.ATTACHMENT)
    if controller is None:
        return executor(*args, **kwargs)
    controller.note_steps(args[5] if len(args) > 5 else kwargs.get("transformer_options"))  # BaseModel.apply_model's
    with controller.forward(patcher, args[0] if args else kwargs.get("x")):
        return executor(*args, **kwargs)


WEIGHT_HOOKS_REFUSED = (
    "[layerwise-offload] this sampler's conditioning carries ComfyUI weight hooks (Create Hook LoRA, Create Hook "
    "LoRA (MO), hook keyframes, per-conditioning LoRA); they rewrite weights in place during sampling, which the "
    "offload's host copy and streaming slots cannot follow, so the output would be silently wrong. Apply the LoRA to "
    "the MODEL with a LoRA loader node (LoraLoaderModelOnly or LoraLoader) before or after Layerwise Offload, or "
    "sample this conditioning without Layerwise Offload")


def refuse_weight_hooks(patcher, *args) -> None:
    """ComfyUI's hooks patch weights in place per conditioning group: refuse them before anything runs."""
    if getattr(patcher, "hook_patches", None) or getattr(patcher, "forced_hooks", None):
        raise RuntimeError(WEIGHT_HOOKS_REFUSED)


def on_pre_run(patcher):
    controller = patcher.attachments.get(LayerwiseOffloadPatcherMixin.ATTACHMENT)
    if controller is not None:
        refuse_weight_hooks(patcher)
        controller.begin_run(patcher)


def on_cleanup(patcher):
    controller = patcher.attachments.get(LayerwiseOffloadPatcherMixin.ATTACHMENT)
    if controller is not None:
        controller.end_run(patcher)


_CALLBACKS = ((CallbacksMP.ON_PRE_RUN, on_pre_run), (CallbacksMP.ON_CLEANUP, on_cleanup),
              (CallbacksMP.ON_REGISTER_ALL_HOOK_PATCHES, refuse_weight_hooks))


def make_offloaded_clone(model, controller):
    patcher = model.clone()
    patcher.__class__ = offload_patcher_class(type(patcher))
    key = LayerwiseOffloadPatcherMixin.ATTACHMENT
    patcher.attachments[key] = controller
    # The node applied again down the chain replaces its own wrapper and callbacks instead of adding a second set
    # (which would run every forward through the manager twice).
    patcher.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, key)
    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, key, apply_model_wrapper)
    for call_type, callback in _CALLBACKS:
        patcher.remove_callbacks_with_key(call_type, key)
        patcher.add_callback_with_key(call_type, key, callback)
    return patcher


def load_device_is_cpu(model) -> bool:
    return comfy.model_management.is_device_cpu(model.load_device)
