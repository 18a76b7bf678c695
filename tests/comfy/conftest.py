"""Fixtures shared by the in-process ComfyUI tests (tests/conftest.py imports ComfyUI before their modules)."""

import pytest

CPU_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_CPU_LOOPBACK"


@pytest.fixture
def comfy_loopback(monkeypatch):
    """Run the real offload manager on ComfyUI's CPU device, with nothing loaded before or after a test."""
    import comfy.model_management as mm  # this conftest loads before ComfyUI is importable
    monkeypatch.setenv(CPU_LOOPBACK_ENV, "1")
    mm.unload_all_models()
    yield
    mm.unload_all_models()
