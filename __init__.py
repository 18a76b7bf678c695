"""layerwise-offload: ComfyUI entry point. Registers the LayerwiseOffload, LayerwiseOffloadStats and
LayerwiseOffloadLoadDiffusionModel nodes.

V3 schema (comfy_api.latest) where ComfyUI has it; NODE_CLASS_MAPPINGS on older versions. Only one
of the two is defined, because ComfyUI ignores comfy_entrypoint when NODE_CLASS_MAPPINGS exists.
"""

import importlib.util
import logging

# Frontend extension (web/js/stats.js): draws the Stats node's picture of the run on the node after each run.
WEB_DIRECTORY = "./web"


def _log_startup() -> None:
    """One line when ComfyUI loads the pack: the device it found and what the node will do there."""
    try:
        import comfy.model_management

        from .nodes.device_support import startup_line
        line = startup_line(comfy.model_management.get_torch_device())
    except Exception as e:  # noqa: BLE001 - the line must never keep the nodes from registering
        line = f"[layerwise-offload] loaded; the device could not be read ({type(e).__name__}: {e})"
    logging.getLogger("layerwise_offload").info(line)


def _remove_stale_disk_files() -> None:
    try:
        from .nodes.offload_node import remove_stale_disk_files
        remove_stale_disk_files()
    except Exception as e:  # noqa: BLE001 - a folder we cannot read must never keep the nodes from registering
        logging.getLogger("layerwise_offload").warning("[layerwise-offload] could not look for stale disk-tier "
                                                       "files: %s: %s", type(e).__name__, e)


if importlib.util.find_spec("comfy") is None:
    # Imported outside ComfyUI (pytest collecting this folder as a package, tools): nothing to register.
    __all__ = []
elif importlib.util.find_spec("comfy_api.latest") is None:
    from .nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    _log_startup()
    _remove_stale_disk_files()
    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
else:
    from .nodes.v3 import comfy_entrypoint

    _log_startup()
    _remove_stale_disk_files()
    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
