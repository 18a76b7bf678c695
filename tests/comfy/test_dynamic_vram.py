"""What the node does with newer ComfyUI: dynamic-VRAM patchers, clones of another model, its allocation
recorder and its free-memory figure.

ComfyUI 0.14.1 has the real ``ModelPatcherDynamic`` (dynamic VRAM is opt-in there, and needs NVIDIA and
comfy-aimdo, so on a CPU ComfyUI would never make one: the tests build it directly). The newest ComfyUI
adds ``get_non_dynamic_delegate()`` and ``clone(disable_dynamic=..., model_override=...)``, readable in its
source but not runnable here; those methods are the one thing stood in, on top of the real classes. On
0.3.75, which has no dynamic VRAM at all, the dynamic patcher is a ModelPatcher that says it is dynamic.
"""

import logging

import pytest
import torch

import comfy.model_management as mm
import comfy.model_patcher
from comfy.model_patcher import ModelPatcher
from comfy.patcher_extension import CallbacksMP

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.tests import dynamic_vram_standin
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin

REAL_DYNAMIC = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
needs_real_dynamic = pytest.mark.skipif(REAL_DYNAMIC is None, reason="this ComfyUI has no ModelPatcherDynamic")

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


def make_dynamic(cls, seed=0):
    """A tiny Wan 2.1 under a dynamic patcher class, built the way ComfyUI's loader builds one."""
    ordinary = tiny_dits.build_tiny("wan21", seed=seed)
    if cls is not SaysDynamic and dynamic_vram_standin.available():
        dynamic_vram_standin.init_library()  # 0.33's ModelPatcherDynamic keeps aimdo host buffers from the start
    patcher = object.__new__(cls)  # ModelPatcherDynamic.__new__ hands back a classic patcher on a CPU
    patcher.__init__(ordinary.model, ordinary.load_device, ordinary.offload_device)
    return patcher


class SaysDynamic(ModelPatcher):
    def is_dynamic(self):
        return True


DYNAMIC_BASE = REAL_DYNAMIC or SaysDynamic


class NewestDynamic(DYNAMIC_BASE):
    """A ComfyUI with the delegate but no ``clone(model_override=)``: the loader runs again once, and ComfyUI keeps
    that model for later calls. (0.33's real path, the same model taken over, is tests/comfy/test_dynamic_vram_033.)"""

    reloads = 0

    def clone(self, *args, **kwargs):
        return super().clone(*args, **kwargs)

    def get_non_dynamic_delegate(self):
        cached = getattr(self, "delegate_model", None)
        if cached is None:
            NewestDynamic.reloads += 1
            cached = self.delegate_model = tiny_dits.build_tiny("wan21").model
        return ModelPatcher(cached, self.load_device, self.offload_device)


class DisableDynamicClone(SaysDynamic):
    """ComfyUI between 0.14 and the delegate: ``clone(disable_dynamic=True)`` reloads at every call."""

    def clone(self, disable_dynamic=False):
        if disable_dynamic:
            return tiny_dits.build_tiny("wan21")
        return super().clone()


class DisableDynamicCloneWithoutLoader(SaysDynamic):
    def clone(self, disable_dynamic=False):
        if disable_dynamic:
            raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
        return super().clone()


def test_the_non_dynamic_delegate_is_used_and_reloads_once(caplog):
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    dynamic = make_dynamic(NewestDynamic)
    NewestDynamic.reloads = 0
    with caplog.at_level(logging.WARNING, logger="layerwise_offload"):
        first = offload_model(dynamic, 2, 1, "leading", True)
        second = offload_model(dynamic, 1, 1, "leading", True)  # the node runs again (a changed input)
    assert NewestDynamic.reloads == 1
    assert first.model is second.model is dynamic.delegate_model
    assert isinstance(first, LayerwiseOffloadPatcherMixin) and not isinstance(first, DYNAMIC_BASE)
    assert any("dynamic VRAM" in r.getMessage() and "keeps them" in r.getMessage() for r in caplog.records)
    assert torch.equal(tiny_dits.sample(first, seed=3), want)
    assert torch.equal(tiny_dits.sample(second, seed=3), want)


def test_a_clone_with_disable_dynamic_is_the_fallback():
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    dynamic = tiny_dits.build_tiny("wan21")
    dynamic.__class__ = DisableDynamicClone
    offloaded = offload_model(dynamic, 2, 1, "leading", True)
    assert offloaded.model is not dynamic.model and not isinstance(offloaded, SaysDynamic)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)


@needs_real_dynamic
@pytest.mark.skipif(dynamic_vram_standin.available() if REAL_DYNAMIC else True,
                    reason="ComfyUI 0.33+ demotes one model (clone(model_override=)): no error there")
def test_on_comfyui_0_14_the_error_says_to_drop_the_opt_in():
    dynamic = make_dynamic(REAL_DYNAMIC)
    assert dynamic.is_dynamic()
    with pytest.raises(RuntimeError, match="without --fast dynamic_vram"):
        offload_model(dynamic, 2, 1, "leading", True)


def test_when_the_reload_fails_the_error_says_what_to_do():
    dynamic = tiny_dits.build_tiny("wan21")
    dynamic.__class__ = DisableDynamicCloneWithoutLoader
    with pytest.raises(RuntimeError, match="could not be reloaded without it.*core loader node"):
        offload_model(dynamic, 2, 1, "leading", True)


def test_a_clone_holding_another_model_object_gets_its_own_offload():
    """Newest ComfyUI's ``clone(model_override=...)``: the clone's model is another object. Stood in by an
    ON_CLONE callback that runs before the node's and swaps the clone's model, as model_override does."""
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    model = tiny_dits.build_tiny("wan21")
    other = tiny_dits.build_tiny("wan21")  # same weights, another object (a fresh load for another GPU)
    override = {}

    def model_override(parent, clone):
        if "model" in override:
            clone.model = override["model"]
    model.add_callback_with_key(CallbacksMP.ON_CLONE, "test_model_override", model_override)
    offloaded = offload_model(model, 2, 1, "leading", True)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)
    override["model"] = other.model
    copy = offloaded.clone()
    assert copy.model is other.model
    assert controller_of(copy).base_model is other.model
    assert controller_of(copy).manager is not controller_of(offloaded).manager
    assert torch.equal(tiny_dits.sample(copy, seed=3), want)
    assert controller_of(copy).manager.stats().forwards > 0  # the clone's own blocks streamed
    override.clear()
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)


def test_buffers_are_allocated_outside_the_models_forward():
    """Newer ComfyUI records the allocations a diffusion model's forward makes (its model compiler); the
    offload's slots and resident buffers outlive the forward, so they are allocated before it starts."""
    model = offload_model(tiny_dits.build_tiny("wan21"), 2, 1, "leading", True)
    manager = controller_of(model).manager
    diffusion_model = model.model.diffusion_model
    inside = []

    def leave(module, args, output):
        inside.pop()
    diffusion_model.register_forward_pre_hook(lambda module, args: inside.append(True))
    diffusion_model.register_forward_hook(leave)
    allocate, allocations = manager.engine.device_memory.allocate, []

    def watched(nbytes):
        allocations.append(bool(inside))
        return allocate(nbytes)
    manager.engine.device_memory.allocate = watched  # looks inside: every device allocation, to see when it happens
    tiny_dits.sample(model, seed=3)
    assert allocations and not any(allocations)


def test_auto_mode_asks_the_patcher_for_free_memory(monkeypatch):
    """Newer ComfyUI's ``patcher.get_free_memory(device)`` counts what dynamic models would give back."""
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False:
                        (0, 0) if torch_free_too else 0)
    model = offload_model(tiny_dits.build_tiny("wan21"), -1, 1, "leading", True)
    asked = []

    def get_free_memory(device):
        asked.append(device)
        return 2**40
    model.get_free_memory = get_free_memory
    tiny_dits.sample(model, seed=3)
    assert asked
    assert controller_of(model).planner.last_plan.resident_count == 4
