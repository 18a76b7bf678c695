"""The node for ComfyUI versions without the V3 schema (NODE_CLASS_MAPPINGS)."""

from __future__ import annotations

from .offload_node import (CATEGORY, DEFAULTS, DESCRIPTION, DISPLAY_NAME, MAX_PREFETCH, MAX_RESIDENT_LAYERS, NODE_ID,
                           POLICIES, TOOLTIPS, offload_model)


class LayerwiseOffloadV1:
    DESCRIPTION = DESCRIPTION
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": TOOLTIPS["model"]}),
            "resident_layers": ("INT", {"default": DEFAULTS["resident_layers"], "min": 0, "max": MAX_RESIDENT_LAYERS,
                                        "tooltip": TOOLTIPS["resident_layers"]}),
            "prefetch_size": ("INT", {"default": DEFAULTS["prefetch_size"], "min": 1, "max": MAX_PREFETCH,
                                      "tooltip": TOOLTIPS["prefetch_size"]}),
            "residency_policy": (list(POLICIES), {"default": DEFAULTS["residency_policy"],
                                                  "tooltip": TOOLTIPS["residency_policy"]}),
            "pin_memory": ("BOOLEAN", {"default": DEFAULTS["pin_memory"], "tooltip": TOOLTIPS["pin_memory"]}),
        }}

    def apply(self, model, resident_layers, prefetch_size, residency_policy, pin_memory):
        return (offload_model(model, resident_layers, prefetch_size, residency_policy, pin_memory),)


NODE_CLASS_MAPPINGS = {NODE_ID: LayerwiseOffloadV1}
NODE_DISPLAY_NAME_MAPPINGS = {NODE_ID: DISPLAY_NAME}
