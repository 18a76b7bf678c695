"""End-to-end fixtures: ONE real ComfyUI server per test session, with this pack installed.

The server (``python main.py --cpu``, loopback, a free port) runs with ``--base-directory`` set to a temporary
folder, so models/, custom_nodes/, input/, output/, temp/ and user/ are all private to the session; the pack is a
symlink ``custom_nodes/layerwise-offload -> <repo>`` (see devtools/server.py), next to the peer packs that shipped
workflows use (ComfyUI-GGUF, unmodified from shared/peers, where it is there). ``LAYERWISE_OFFLOAD_CPU_LOOPBACK=1``
makes the node run the real offload manager on the CPU instead of passing the model through.

The session server's base folder gets the tiny demo the way the README says a user installs it
(``python demo/install_tiny_demo.py`` run from the pack's folder in its custom_nodes). The tiny assets
(devtools/e2e_assets.py) are built once into ``<repo>/.comfyui/e2e-assets/<run label>`` (git-ignored, rebuilt
when their recipe changes) and linked or copied into the other servers' base folders (``e2e_assets.copy_cond``
puts the saved conditioning where each ComfyUI reads it); the session's takes its tiny SD1.5 UNet from there.

Environment: ``LAYERWISE_OFFLOAD_E2E_KEEP=1`` keeps the base folder (and prints where), ``COMFYUI_PATH`` as usual,
``LAYERWISE_OFFLOAD_FRONTEND_ROOT`` serves another frontend (ComfyUI's ``--front-end-root``),
``LAYERWISE_OFFLOAD_E2E_LOOPBACK=0`` starts the server WITHOUT the CPU loopback (the node then passes the model
through): a diagnostic, to tell the offload from the plumbing when a test fails (the tests that check the offload
really ran fail in that mode, as they should).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerwise_offload.devtools import e2e_assets, peers
from layerwise_offload.devtools.server import PACK_FOLDER, ComfyServer, prepare_base_dir

REPO = Path(__file__).resolve().parents[2]
CPU_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_CPU_LOOPBACK"
# A frontend other than the one ComfyUI pins, e.g. the static/ folder of PyPI's comfyui-frontend-package 1.58.1.
FRONTEND_ROOT_ENV = "LAYERWISE_OFFLOAD_FRONTEND_ROOT"


def run_label() -> str:
    """This run's ComfyUI folder name (and its other frontend's), e.g. ``ComfyUI-0.14.1+frontend-1.58.1``:
    scripts/test.sh runs the versions side by side, so what a run writes (assets, screenshots) is its own."""
    label = Path(os.environ.get("COMFYUI_PATH") or REPO / ".comfyui" / "ComfyUI").name
    front = os.environ.get(FRONTEND_ROOT_ENV)
    if front:
        label += "+" + next((p for p in Path(front).parts if p.startswith("frontend")), "other-frontend")
    return label


ASSET_CACHE = REPO / ".comfyui" / "e2e-assets" / run_label()


def server_args() -> list:
    """What every e2e server gets: no API nodes (they talk to api.comfy.org; the machine may be offline), and
    ComfyUI's --front-end-root where LAYERWISE_OFFLOAD_FRONTEND_ROOT names another frontend."""
    root = os.environ.get(FRONTEND_ROOT_ENV)
    return ["--disable-api-nodes"] + (["--front-end-root", root] if root else [])


@pytest.fixture(scope="session")
def tiny_assets():
    """``{kind: path}`` of the cached tiny assets (built on first use)."""
    return e2e_assets.install_demo_assets(ASSET_CACHE / "models", ASSET_CACHE / "output")


def install_tiny_demo_as_the_readme_says(base: Path) -> str:
    """The README's one step, in the base folder ``base``: ``python demo/install_tiny_demo.py`` run from the pack's
    folder in its custom_nodes (the session's Python: the venv that runs the server). A --base-directory holds no
    ComfyUI code, so the script writes the conditioning where every ComfyUI reads it. Returns its output."""
    pack = base / "custom_nodes" / PACK_FOLDER
    r = subprocess.run([sys.executable, "demo/install_tiny_demo.py"], cwd=str(pack), capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PWD": str(pack)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (base / "models" / "diffusion_models" / e2e_assets.TINY_WAN21_NAME).is_file(), r.stdout
    return r.stdout


@pytest.fixture(scope="session")
def comfy_base(tmp_path_factory, tiny_assets) -> Path:
    """The session server's base folder: the tiny demo installed by the README's step (the tests' tiny SD1.5 UNet
    linked from the asset cache beside it)."""
    base = prepare_base_dir(tmp_path_factory.mktemp("comfy_base"))
    src = Path(tiny_assets["sd15"])
    (base / "models" / "diffusion_models" / src.name).symlink_to(src)
    install_tiny_demo_as_the_readme_says(base)
    return base


@pytest.fixture(scope="session")
def missing_peers(comfy_base):
    """Installs the peer packs into the session's custom_nodes (before the server starts); returns
    ``{peer folder: why it is not installed}`` (empty: every peer pack is there)."""
    return peers.install_available_peers(comfy_base / "custom_nodes")


@pytest.fixture(scope="session")
def comfy_server(comfy_base, missing_peers):
    """The session's running :class:`ComfyServer` (CPU, CPU loopback on)."""
    loopback = os.environ.get("LAYERWISE_OFFLOAD_E2E_LOOPBACK", "1")
    srv = ComfyServer(comfy_base, cpu=True, env={CPU_LOOPBACK_ENV: loopback}, extra_args=server_args())
    srv.start(timeout=240)
    try:
        yield srv
    finally:
        srv.stop()
        if os.environ.get("LAYERWISE_OFFLOAD_E2E_KEEP") == "1":
            print(f"\n[layerwise-offload] e2e base folder kept: {comfy_base} (log: {srv.log_path})")


@pytest.fixture(scope="session")
def object_info(comfy_server):
    return comfy_server.object_info()
