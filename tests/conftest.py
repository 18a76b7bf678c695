"""Test-wide setup for layerwise-offload.

1. Registers the repository as the package ``layerwise_offload`` without running its root ``__init__.py`` (that is
   ComfyUI's entry point and imports ComfyUI). Tests import ``layerwise_offload.offload``,
   ``layerwise_offload.nodes`` and ``layerwise_offload.devtools``. The repository root is never put on sys.path:
   ComfyUI has a top-level module ``nodes`` that our nodes/ folder would clash with.
2. Imports ComfyUI in-process (CPU mode, via ``devtools/comfy_env.py``) before any module under tests/comfy/ or
   tests/e2e/ is collected, so those modules may import ComfyUI or ``layerwise_offload.nodes`` at module level.
   tests/unit/ never triggers the import.

Fixtures: ``comfyui_path`` (Path of the ComfyUI folder: $COMFYUI_PATH or .comfyui/ComfyUI) and ``comfy`` (the
namespace returned by ``import_comfyui``: ``comfy.sd``, ``comfy.sample``, ``comfy.model_management``, ``comfy.nodes``
(ComfyUI's nodes.py), ...).

Environment: COMFYUI_PATH (use another ComfyUI checkout), LAYERWISE_OFFLOAD_TEST_CPU=0 (import ComfyUI on its
default device, e.g. a GPU, instead of forcing --cpu).
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# The strict loopback (offload/strict.py) for every test and every ComfyUI server the tests start: a block's weights
# read from its host copy during a model call fail here as they would on a GPU, instead of computing on the CPU.
os.environ.setdefault("LAYERWISE_OFFLOAD_STRICT_LOOPBACK", "1")

# Tests whose modules may touch ComfyUI at import time.
_COMFY_TEST_DIRS = (REPO_ROOT / "tests" / "comfy", REPO_ROOT / "tests" / "e2e")

# `python -m pytest` run from the repo root puts the root on sys.path, where `import nodes` would find our nodes/
# folder instead of ComfyUI's nodes.py: devtools/comfy_env.py (no relative imports, loaded by path) takes it off
# and registers the pack.
runpy.run_path(str(REPO_ROOT / "devtools" / "comfy_env.py"))["enter_pack"]()

from layerwise_offload.devtools import comfy_env  # noqa: E402


def _want_cpu() -> bool:
    return os.environ.get("LAYERWISE_OFFLOAD_TEST_CPU", "1") != "0"


def _import_comfyui():
    try:
        return comfy_env.import_comfyui(cpu=_want_cpu())
    except FileNotFoundError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_collectstart(collector):
    path = getattr(collector, "path", None)
    if path is None or not isinstance(collector, pytest.Module):
        return
    p = Path(path).resolve()
    if any(d == p or d in p.parents for d in _COMFY_TEST_DIRS):
        _import_comfyui()


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    """The ComfyUI folder the tests use ($COMFYUI_PATH, else .comfyui/ComfyUI)."""
    try:
        return comfy_env.comfyui_path()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI imported in-process (CPU unless LAYERWISE_OFFLOAD_TEST_CPU=0); see devtools/comfy_env.py."""
    return _import_comfyui()


def pytest_report_header(config):
    try:
        where = str(comfy_env.comfyui_path())
    except FileNotFoundError:
        where = "not installed (run scripts/setup_env.sh)"
    return [f"layerwise-offload: ComfyUI at {where}; ComfyUI tests on {'CPU' if _want_cpu() else 'default device'}"]
