"""Find a real ComfyUI and import it in-process, the way tests, demos and benchmarks need it.

ComfyUI has top-level modules called ``nodes``, ``utils``, ``server``, ... and this repository has a ``nodes/``
folder, so the repository root never goes on ``sys.path``: the repository is registered as the package
``layerwise_offload`` (:func:`register_pack`), as ComfyUI itself imports it, and ComfyUI's folder goes first on
``sys.path`` (:func:`import_comfyui`, which also keeps ComfyUI from parsing pytest's argv and picks the CPU).

This file has no relative imports, so it runs before the package exists. Every entry point (tests/conftest.py,
a devtools/ file run by path) starts the same way, with :func:`enter_pack`::

    runpy.run_path(str(REPO / "devtools" / "comfy_env.py"))["enter_pack"](globals())
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types
from pathlib import Path
from typing import Optional, Union

PACK_NAME = "layerwise_offload"

PathLike = Union[str, os.PathLike]


def repo_root() -> Path:
    """The repository root (the folder holding ``offload/``, ``nodes/``, ``devtools/``)."""
    return Path(__file__).resolve().parents[1]


def comfyui_path(path: Optional[PathLike] = None) -> Path:
    """The ComfyUI folder to use: ``path`` if given, else ``$COMFYUI_PATH``, else ``<repo>/.comfyui/ComfyUI``
    (installed by ``scripts/setup_env.sh``). Raises ``FileNotFoundError`` with the fix if it is not a ComfyUI."""
    if path is None:
        path = os.environ.get("COMFYUI_PATH") or (repo_root() / ".comfyui" / "ComfyUI")
    p = Path(path).expanduser().resolve()
    if not (p / "main.py").is_file() or not (p / "comfy").is_dir():
        raise FileNotFoundError(
            f"[layerwise-offload] no ComfyUI at {p} (expected main.py and comfy/). "
            "Run `bash scripts/setup_env.sh` to install the vendored ComfyUI 0.3.75 into .comfyui/ComfyUI, "
            "or set COMFYUI_PATH to your own ComfyUI checkout."
        )
    return p


def register_pack(root: Optional[PathLike] = None) -> types.ModuleType:
    """Register the repository as the package ``layerwise_offload`` WITHOUT running its root ``__init__.py``
    (ComfyUI's entry point, which imports ComfyUI). Afterwards ``import layerwise_offload.offload`` / ``.nodes`` /
    ``.devtools`` work with their relative imports. Idempotent; returns the package module."""
    root = Path(root).resolve() if root is not None else repo_root()
    existing = sys.modules.get(PACK_NAME)
    if existing is not None:
        paths = [str(Path(p).resolve()) for p in getattr(existing, "__path__", [])]
        if str(root) not in paths:
            raise RuntimeError(f"[layerwise-offload] sys.modules[{PACK_NAME!r}] already points at {paths}, not {root}")
        return existing
    if str(root) in [str(Path(p).resolve()) for p in sys.path if p]:
        raise RuntimeError(f"[layerwise-offload] the repository root {root} is on sys.path; remove it: its nodes/ "
                           "folder would clash with ComfyUI's top-level module `nodes`.")
    pkg = types.ModuleType(PACK_NAME)
    pkg.__spec__ = importlib.machinery.ModuleSpec(PACK_NAME, None, is_package=True)
    pkg.__spec__.submodule_search_locations = pkg.__path__ = [str(root)]
    pkg.__package__, pkg.__file__ = PACK_NAME, None
    sys.modules[PACK_NAME] = pkg
    return pkg


def import_pack_modules(*submodules: str, root: Optional[PathLike] = None):
    """For scripts: take the repository root off ``sys.path``, register the pack, import ``submodules``
    (e.g. ``"offload"``, ``"devtools.toy_transformer"``) and return them in order."""
    root_path = Path(root).resolve() if root is not None else repo_root()
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root_path]
    register_pack(root_path)
    return tuple(importlib.import_module(f"{PACK_NAME}.{name}") for name in submodules)


def enter_pack(module_globals: Optional[dict] = None) -> None:
    """The start of every entry point: take the repository root off ``sys.path`` and register the pack. Given the
    globals of a file of this repository run by path (``python -P devtools/x.py``), also set its ``__package__``
    (``layerwise_offload.devtools``), so its relative imports work."""
    import_pack_modules()
    if module_globals is not None:
        folder = Path(module_globals["__file__"]).resolve().parent.relative_to(repo_root())
        module_globals["__package__"] = ".".join((PACK_NAME, *folder.parts))


def import_comfyui(path: Optional[PathLike] = None, *, cpu: bool = True,
                   import_nodes: bool = True) -> types.SimpleNamespace:
    """Import ComfyUI in this process (idempotent) and return its commonly used modules as a namespace: ComfyUI's
    folder (:func:`comfyui_path`) goes first on ``sys.path``, argument parsing is turned off (ComfyUI must not parse
    pytest's argv), ``args.cpu = cpu`` is set before ``comfy.model_management`` is imported (on a GPU machine pass
    ``cpu=False`` before anything else imports ComfyUI), and ComfyUI's ``nodes`` is imported unless
    ``import_nodes=False``. Raises ``RuntimeError`` if another ComfyUI, or this one with another device choice, is
    already imported."""
    comfy_dir = comfyui_path(path)
    loaded = sys.modules.get("comfy.model_management") or sys.modules.get("comfy.options")
    loaded = Path(loaded.__file__).resolve().parents[1] if getattr(loaded, "__file__", None) else None
    if loaded is not None and loaded != comfy_dir:
        raise RuntimeError(f"[layerwise-offload] ComfyUI from {loaded} is already imported; cannot also import "
                           f"{comfy_dir} in the same process.")
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))

    first_time = "comfy.model_management" not in sys.modules
    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    args = comfy.cli_args.args
    if first_time:
        args.cpu = bool(cpu)
    elif bool(args.cpu) != bool(cpu):
        raise RuntimeError(f"[layerwise-offload] ComfyUI is already imported with cpu={args.cpu}; "
                           f"import_comfyui(cpu={cpu}) cannot change the device any more (call it before anything "
                           "imports comfy.model_management).")
    mods = {name.rsplit(".", 1)[-1]: importlib.import_module(name) for name in (
        "comfy.model_management", "comfy.utils", "comfy.ops", "comfy.model_patcher", "comfy.patcher_extension",
        "comfy.model_base", "comfy.supported_models", "comfy.sd", "comfy.samplers", "comfy.sample", "folder_paths")}
    comfy_nodes = None
    if import_nodes:
        comfy_nodes = importlib.import_module("nodes")
        nodes_file = Path(getattr(comfy_nodes, "__file__", "") or "").resolve()
        if nodes_file != comfy_dir / "nodes.py":
            raise RuntimeError(
                f"[layerwise-offload] `import nodes` gave {nodes_file}, not ComfyUI's {comfy_dir / 'nodes.py'}: "
                "something put another folder with a `nodes` module ahead of ComfyUI on sys.path "
                "(never put the layerwise-offload repository root on sys.path)."
            )

    return types.SimpleNamespace(path=comfy_dir, comfy=sys.modules["comfy"], args=args, nodes=comfy_nodes, **mods)


#: Model-config fields that newer ComfyUIs require and older ones reject, per ``image_model``, with the value
#: ComfyUI's own detector gives a checkpoint of that family: (module, params dataclass, {field: value}).
_NEWER_REQUIRED_FIELDS = {
    "flux": ("comfy.ldm.flux.model", "FluxParams", {"txt_ids_dims": []}),  # 0.14.1: Flux.1 has none
    "flux2": ("comfy.ldm.flux.model", "FluxParams", {"txt_ids_dims": [3]}),
    "hunyuan_video": ("comfy.ldm.hunyuan_video.model", "HunyuanVideoParams",
                      {"meanflow_sum": False, "use_cond_type_embedding": False, "vision_in_dim": None}),
}


def with_fields_this_comfyui_needs(unet_config: dict) -> dict:
    """``unet_config`` plus the fields the imported ComfyUI's model classes need for its family (see
    ``_NEWER_REQUIRED_FIELDS``), so one hand-written tiny config builds on 0.3.75 and on 0.14.1."""
    import dataclasses

    entry = _NEWER_REQUIRED_FIELDS.get(unet_config.get("image_model"))
    if entry is None:
        return unet_config
    module_name, class_name, extras = entry
    names = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module_name), class_name))}
    return {**{k: v for k, v in extras.items() if k in names}, **unet_config}
