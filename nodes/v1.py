"""The node for ComfyUI versions without the V3 schema (NODE_CLASS_MAPPINGS)."""

from __future__ import annotations

from .offload_node import (CATEGORY, DEFAULTS, DESCRIPTION, DISPLAY_NAME, MAX_PREFETCH, MAX_RESIDENT_LAYERS,
                           MIN_RESIDENT_LAYERS, NODE_ID, NODE_POLICIES, STATS_DESCRIPTION, STATS_DISPLAY_NAME, STATS_NODE_ID,
                           STATS_TOOLTIPS, TOOLTIPS, HOST_STORES, host_store_problem, stats_ui)
from .controller import offload_model
from .loader import (LOADER_CATEGORY, LOADER_DESCRIPTION, LOADER_DISPLAY_NAME, LOADER_NODE_ID, LOADER_TOOLTIPS,
                     WEIGHT_DTYPES, diffusion_model_names, load_layerwise)


class LayerwiseOffloadV1:
    DESCRIPTION = DESCRIPTION
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": TOOLTIPS["model"]}),
            "resident_layers": ("INT", {"default": DEFAULTS["resident_layers"], "min": MIN_RESIDENT_LAYERS, "max": MAX_RESIDENT_LAYERS,
                                        "tooltip": TOOLTIPS["resident_layers"]}),
            "prefetch_size": ("INT", {"default": DEFAULTS["prefetch_size"], "min": 1, "max": MAX_PREFETCH,
                                      "tooltip": TOOLTIPS["prefetch_size"]}),
            "residency_policy": (list(NODE_POLICIES), {"default": DEFAULTS["residency_policy"],
                                                  "tooltip": TOOLTIPS["residency_policy"]}),
            "pin_memory": ("BOOLEAN", {"default": DEFAULTS["pin_memory"], "tooltip": TOOLTIPS["pin_memory"]}),
        }, "optional": {  # optional: API prompts written before it existed still validate (default: auto)
            "host_store": (list(HOST_STORES), {"default": DEFAULTS["host_store"], "tooltip": TOOLTIPS["host_store"]}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, host_store=None):
        # host_store = disk is refused when queued where the disk tier cannot run. Only host_store is named
        # (ComfyUI reports a failure under every input named here, and checks the others' lists itself).
        return host_store_problem(host_store) or True

    def apply(self, model, resident_layers, prefetch_size, residency_policy, pin_memory, host_store="auto"):
        return (offload_model(model, resident_layers, prefetch_size, residency_policy, pin_memory, host_store),)


class LayerwiseOffloadStatsV1:
    DESCRIPTION = STATS_DESCRIPTION
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    FUNCTION = "show"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": STATS_TOOLTIPS["model"]})},
                "optional": {"after": ("LATENT", {"tooltip": STATS_TOOLTIPS["after"]})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # the figures change with every run

    def show(self, model, after=None):
        ui, text = stats_ui(model, after_connected=after is not None)
        return {"ui": ui, "result": (text,)}


class LayerwiseOffloadLoadDiffusionModelV1:
    DESCRIPTION = LOADER_DESCRIPTION
    CATEGORY = LOADER_CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "unet_name": (diffusion_model_names(), {"tooltip": LOADER_TOOLTIPS["unet_name"]}),
            "weight_dtype": (list(WEIGHT_DTYPES), {"default": "default", "tooltip": LOADER_TOOLTIPS["weight_dtype"]}),
        }}

    def load(self, unet_name, weight_dtype="default"):
        return (load_layerwise(unet_name, weight_dtype),)


NODE_CLASS_MAPPINGS = {NODE_ID: LayerwiseOffloadV1, STATS_NODE_ID: LayerwiseOffloadStatsV1,
                       LOADER_NODE_ID: LayerwiseOffloadLoadDiffusionModelV1}
NODE_DISPLAY_NAME_MAPPINGS = {NODE_ID: DISPLAY_NAME, STATS_NODE_ID: STATS_DISPLAY_NAME,
                              LOADER_NODE_ID: LOADER_DISPLAY_NAME}
