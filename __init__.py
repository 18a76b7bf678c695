"""layerwise-offload: ComfyUI entry point. Registers the LayerwiseOffload node.

V3 schema (comfy_api.latest) where ComfyUI has it; NODE_CLASS_MAPPINGS on older versions. Only one
of the two is defined, because ComfyUI ignores comfy_entrypoint when NODE_CLASS_MAPPINGS exists.
"""

try:
    from comfy_api.latest import ComfyExtension, io  # noqa: F401  (probe for the V3 API)
except ImportError:
    from .nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
else:
    from .nodes.v3 import comfy_entrypoint

    __all__ = ["comfy_entrypoint"]
