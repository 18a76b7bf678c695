"""layerwise-offload: ComfyUI entry point. Registers the LayerwiseOffload and LayerwiseOffloadStats nodes.

V3 schema (comfy_api.latest) where ComfyUI has it; NODE_CLASS_MAPPINGS on older versions. Only one
of the two is defined, because ComfyUI ignores comfy_entrypoint when NODE_CLASS_MAPPINGS exists.
"""

import importlib.util

# Frontend extension (web/js/stats_text.js): draws the Stats node's report on the node after each run.
WEB_DIRECTORY = "./web"

if importlib.util.find_spec("comfy") is None:
    # Imported outside ComfyUI (pytest collecting this folder as a package, tools): nothing to register.
    __all__ = []
elif importlib.util.find_spec("comfy_api.latest") is None:
    from .nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
else:
    from .nodes.v3 import comfy_entrypoint

    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
