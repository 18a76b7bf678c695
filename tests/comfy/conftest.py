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


@pytest.fixture
def weights_replan(monkeypatch):
    """``replan(offloaded, want, sample)`` for a ``residency_policy = weights`` output: a first run with room for
    every unit (all resident, nothing streamed: it tells the activations the plan counts), unloaded (what is held
    would count as free to the plan), then a run with 60% of the units' bytes beside them; each run's output must
    equal ``want`` bitwise. Returns the controller and the second plan."""
    import torch
    import comfy.model_management as mm
    from layerwise_offload.nodes import run_planning
    from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
    free = [2 ** 40]
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (
        (free[0], free[0]) if torch_free_too else free[0]))
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)

    def replan(offloaded, want, sample):
        controller = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]
        manager = controller.manager
        assert torch.equal(sample(offloaded), want)
        first = controller.planner.last_plan
        assert first.resident_count == manager.num_blocks and first.streamed_bytes == 0
        mm.unload_all_models()
        assert manager.device_bytes() == 0
        free[0] = first.reserve_bytes + first.activation_bytes + int(0.6 * sum(manager.block_nbytes()))
        assert torch.equal(sample(offloaded), want)
        plan = controller.planner.last_plan
        assert plan.fits and 0 < plan.streamed_bytes == manager.stats().bytes_copied_last_forward
        return controller, plan
    return replan
