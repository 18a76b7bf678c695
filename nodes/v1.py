"""The node for ComfyUI versions without the V3 schema (NODE_CLASS_MAPPINGS)."""

from __future__ import annotations

from .offload_node import (CATEGORY, DESCRIPTION, DISPLAY_NAME, INPUTS, NODE_ID, STATS_DESCRIPTION, STATS_DISPLAY_NAME,
                           STATS_NODE_ID, STATS_TOOLTIPS, NodeInput, host_store_problem, stats_ui)
from .controller import offload_model
from .loader import (LOADER_CATEGORY, LOADER_DESCRIPTION, LOADER_DISPLAY_NAME, LOADER_NODE_ID, LOADER_TOOLTIPS,
                     WEIGHT_DTYPES, diffusion_model_names, load_layerwise)


def v1_input(spec: NodeInput) -> tuple:
    """``spec`` in the V1 form: (type, options), a combo's type being its list of choices."""
    options = {"tooltip": spec.tooltip}
    if spec.default is not None:
        options["default"] = spec.default
    if spec.minimum is not None:
        options.update(min=spec.minimum, max=spec.maximum)
    return (list(spec.options) if spec.kind == "COMBO" else spec.kind, options)


class LayerwiseOffloadV1:
    DESCRIPTION = DESCRIPTION
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {spec.name: v1_input(spec) for spec in INPUTS if not spec.optional},
                "optional": {spec.name: v1_input(spec) for spec in INPUTS if spec.optional}}

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
