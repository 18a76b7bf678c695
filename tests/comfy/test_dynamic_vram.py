"""What the node does with newer ComfyUI's dynamic-VRAM patchers (ModelPatcherDynamic).

ComfyUI 0.3.75 has no dynamic VRAM (it needs NVIDIA and comfy-aimdo), so these patchers are the one
thing faked here: subclasses of the real ModelPatcher with the two methods newer ComfyUI adds.
"""

import logging

import pytest
import torch

import comfy.model_management as mm
from comfy.model_patcher import ModelPatcher

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.offload_node import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin


class DynamicPatcher(ModelPatcher):
    """Newer ComfyUI: ``is_dynamic()`` and ``clone(disable_dynamic=...)`` that reloads an ordinary one."""

    def is_dynamic(self):
        return True

    def clone(self, disable_dynamic=False):
        if disable_dynamic:
            fresh = tiny_dits.build_tiny("wan21")  # the loader runs again, without dynamic VRAM
            return fresh
        clone = super().clone()
        clone.__class__ = DynamicPatcher
        return clone


class DynamicPatcherWithoutLoader(DynamicPatcher):
    def clone(self, disable_dynamic=False):
        if disable_dynamic:
            raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
        return super().clone()


class OldDynamicPatcher(ModelPatcher):
    def is_dynamic(self):
        return True


def as_class(patcher, cls):
    patcher.__class__ = cls
    return patcher


pytestmark = pytest.mark.usefixtures("comfy_loopback")


def test_a_dynamic_model_is_taken_over_as_an_ordinary_one(caplog):
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    dynamic = as_class(tiny_dits.build_tiny("wan21"), DynamicPatcher)
    with caplog.at_level(logging.WARNING, logger="layerwise_offload"):
        offloaded = offload_model(dynamic, 2, 1, "leading", True)
    assert isinstance(offloaded, LayerwiseOffloadPatcherMixin) and not isinstance(offloaded, DynamicPatcher)
    assert offloaded.model is not dynamic.model
    assert any("dynamic VRAM" in r.getMessage() and "--disable-dynamic-vram" in r.getMessage()
               for r in caplog.records)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)


@pytest.mark.parametrize("cls, message", [
    (DynamicPatcherWithoutLoader, "could not be reloaded without it.*--disable-dynamic-vram"),
    (OldDynamicPatcher, "start ComfyUI with --disable-dynamic-vram"),
])
def test_when_takeover_is_impossible_the_error_says_what_to_do(cls, message):
    dynamic = as_class(tiny_dits.build_tiny("wan21"), cls)
    with pytest.raises(RuntimeError, match=message):
        offload_model(dynamic, 2, 1, "leading", True)
