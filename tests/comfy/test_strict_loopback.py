"""The strict loopback (offload/strict.py): on the CPU a block's weights used outside its hooks would compute from
the host copy and pass; strict mode points them at empty placeholders during a model call, so that fails as on a GPU. tests/conftest.py turns it on for the suite.
A model whose forward uses its blocks without calling them is passed through with the reason; one that slips
through is named in the run's advice."""

from __future__ import annotations

import pytest
import torch

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.discovery import BLOCKS_USED_WITHOUT_CALLS
from layerwise_offload.nodes.stats_view import PASSTHROUGH_ATTACHMENT
from layerwise_offload.offload.strict import STRICT_LOOPBACK_ENV


@pytest.fixture
def loopback(monkeypatch):
    import comfy.model_management as mm
    monkeypatch.setenv("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    mm.unload_all_models()
    yield
    mm.unload_all_models()


def read_a_streamed_block_outside_its_hooks(patcher):
    """Inside the model call, before block 0 runs, read block 2's weights without calling block 2 (as a model that
    uses its blocks' weights through other methods does)."""
    blocks = patcher.get_model_object("diffusion_model").blocks

    def read(module, args):
        weight = blocks[2].self_attn.q.weight
        torch.ones(1, 256, dtype=weight.dtype) @ weight.t()  # tiny Wan's width: computes only with the real weight
    blocks[0].register_forward_pre_hook(read)


def test_weights_read_outside_the_hooks_fail_in_strict_mode(loopback, monkeypatch):
    monkeypatch.setenv(STRICT_LOOPBACK_ENV, "1")
    offloaded = offload_model(tiny_dits.build_wan21(), 1, 1, "leading", False)
    read_a_streamed_block_outside_its_hooks(offloaded)
    with pytest.raises(RuntimeError, match="size mismatch|cannot be multiplied|shape"):  # an empty placeholder
        tiny_dits.sample(offloaded, steps=2)
    controller = offloaded.attachments["layerwise_offload"]
    block = controller.discovered.blocks[2]
    assert all(p.numel() > 0 for p in block.parameters())  # after the call: its host copy again


def test_without_strict_mode_the_same_read_passes_on_the_cpu(loopback, monkeypatch):
    """What strict mode is for: the loopback alone cannot see it."""
    monkeypatch.delenv(STRICT_LOOPBACK_ENV, raising=False)
    reference = tiny_dits.sample(tiny_dits.build_wan21(), steps=2)
    offloaded = offload_model(tiny_dits.build_wan21(), 1, 1, "leading", False)
    read_a_streamed_block_outside_its_hooks(offloaded)
    assert torch.equal(tiny_dits.sample(offloaded, steps=2), reference)


def test_a_model_that_calls_no_block_is_named_in_the_advice(loopback, monkeypatch):
    """A forward in which no block ran through its hooks is counted and the run's advice says so."""
    monkeypatch.delenv(STRICT_LOOPBACK_ENV, raising=False)
    offloaded = offload_model(tiny_dits.build_wan21(), 1, 1, "leading", False)
    diffusion_model = offloaded.get_model_object("diffusion_model")
    blocks = list(diffusion_model.blocks)

    class Unhooked(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.forward = block.forward  # the block's own forward function: its hooks never fire

    def wrapper(apply_model, args):
        saved = diffusion_model.blocks
        diffusion_model.blocks = torch.nn.ModuleList(Unhooked(b) for b in blocks)
        try:
            return apply_model(args["input"], args["timestep"], **args["c"])
        finally:
            diffusion_model.blocks = saved
    offloaded.set_model_unet_function_wrapper(wrapper)
    tiny_dits.sample(offloaded, steps=2)
    controller = offloaded.attachments["layerwise_offload"]
    assert controller.last_report.forwards_without_blocks == controller.last_report.forwards > 0
    assert "ran none of the transformer blocks" in controller.last_recommendation


def test_wan_animate2_is_passed_through_with_its_reason(loopback):
    """ComfyUI 0.33's WanAnimate2Model calls block.forward_pose / kv_from_input / forward_gen, never the block."""
    patcher = tiny_dits.build_wan21()
    diffusion_model = patcher.get_model_object("diffusion_model")
    diffusion_model.__class__ = type("WanAnimate2Model", (type(diffusion_model),), {})
    assert "WanAnimate2Model" in BLOCKS_USED_WITHOUT_CALLS
    passed = offload_model(patcher, 1, 1, "leading", False)
    support = passed.attachments[PASSTHROUGH_ATTACHMENT]
    assert "passed through: WanAnimate2Model calls block.forward_pose" in support.reason
    assert "layerwise_offload" not in passed.attachments
