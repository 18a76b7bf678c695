"""Other custom node packs the tests run next to this one, from their unmodified sources.

The sources live in the project's shared folder (``shared/peers/*.tar.gz``, beside the repository: ``../shared``
for the main checkout, ``../../shared`` for a worktree under ``wt/``; ``LAYERWISE_OFFLOAD_SHARED`` overrides).
On a machine without it the tests that need a peer skip, saying so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tarfile
import types
from pathlib import Path
from typing import Dict, Optional

from .comfy_env import repo_root

GGUF_TARBALL = "ComfyUI-GGUF-795e451.tar.gz"
GGUF_FOLDER = "ComfyUI-GGUF"
_GGUF_MODULE = "comfyui_gguf_peer"
#: Node types that shipped workflows take from another pack -> (that pack's folder, its tarball, the Python module
#: it needs beyond ComfyUI's own requirements).
PEER_NODES = {"UnetLoaderGGUF": (GGUF_FOLDER, GGUF_TARBALL, "gguf")}


def shared_dir() -> Optional[Path]:
    env = os.environ.get("LAYERWISE_OFFLOAD_SHARED")
    candidates = [Path(env)] if env else [repo_root().parent / "shared", repo_root().parent.parent / "shared"]
    return next((c for c in candidates if (c / "peers").is_dir()), None)


def peer_tarball(name: str = GGUF_TARBALL) -> Optional[Path]:
    shared = shared_dir()
    path = shared / "peers" / name if shared else None
    return path if path is not None and path.is_file() else None


def unpack_peer(dest: "os.PathLike | str", name: str = GGUF_TARBALL, folder: str = GGUF_FOLDER) -> Path:
    """Unpack a peer pack's tarball into ``dest`` (a custom_nodes folder); returns the pack's folder."""
    tarball = peer_tarball(name)
    if tarball is None:
        raise FileNotFoundError(f"{name} not found under shared/peers (set LAYERWISE_OFFLOAD_SHARED)")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if not (dest / folder).is_dir():
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
    return dest / folder


def install_available_peers(dest: "os.PathLike | str") -> Dict[str, str]:
    """Unpack into ``dest`` (a custom_nodes folder) every peer pack of :data:`PEER_NODES` whose source is in
    shared/peers and whose Python dependency this interpreter can import. Returns ``{folder: why not}`` for the
    peers left out (empty when all are installed)."""
    missing: Dict[str, str] = {}
    for folder, tarball, module in sorted(set(PEER_NODES.values())):
        if peer_tarball(tarball) is None:
            missing[folder] = f"no shared/peers/{tarball} beside the repository (set LAYERWISE_OFFLOAD_SHARED)"
        elif importlib.util.find_spec(module) is None:
            missing[folder] = f"{folder} needs the {module!r} package, which this Python lacks"
        else:
            unpack_peer(dest, tarball, folder)
    return missing


def import_comfyui_gguf(dest: "os.PathLike | str") -> types.ModuleType:
    """Import ComfyUI-GGUF in-process (ComfyUI already imported), as ComfyUI would load the custom node."""
    if _GGUF_MODULE in sys.modules:
        return sys.modules[_GGUF_MODULE]
    folder = unpack_peer(dest)
    spec = importlib.util.spec_from_file_location(_GGUF_MODULE, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[_GGUF_MODULE] = module
    spec.loader.exec_module(module)
    return module
