"""Streaming weight by weight through ComfyUI's own model classes (issue 28, G5): the manager over the weight units
of every tiny family's blocks samples bitwise what ComfyUI alone samples, holds what the planner computed, moves
only the planned tails each step, and at the same room moves fewer bytes than the best whole-tail plan."""

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.offload import apply_layerwise_offload, plan_streamed_tails, plan_weight_units
from layerwise_offload.offload.host.packing import block_parameters, plan_layout
from layerwise_offload.offload.units import weight_units

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def geometry(modules):
    layouts = [plan_layout(block_parameters(module)) for module in modules]
    return [layout.nbytes for layout in layouts], [layout.tail_sizes for layout in layouts]


def blocks_of(patcher):
    return [block for blocks in tiny_dits.block_lists(patcher).values() for block in blocks]


@pytest.mark.parametrize("family", sorted(tiny_dits.TINY_FAMILIES))
def test_weight_units_sample_bitwise_and_move_fewer_bytes_than_whole_tails(family):
    want = tiny_dits.sample(tiny_dits.build_tiny(family), seed=5, steps=3)
    mm.unload_all_models()
    patcher = tiny_dits.build_tiny(family)
    blocks = blocks_of(patcher)
    units = weight_units(blocks).residents_first()
    unit_sizes, unit_options = units.geometry()
    block_sizes, block_options = geometry(blocks)
    def nbytes(modules):
        return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())
    assert nbytes(units.units) + units.left_out_nbytes() == nbytes(blocks)
    room = int(0.6 * sum(block_sizes)) - units.left_out_nbytes()
    plan = plan_weight_units(unit_sizes, unit_options, room)
    whole_tails = plan_streamed_tails(block_sizes, block_options, room + units.left_out_nbytes(), tries=64)
    assert plan is not None and plan.fits
    if whole_tails is not None:
        assert plan.streamed_bytes < whole_tails.streamed_bytes  # the point of streaming weight by weight
    manager = apply_layerwise_offload(list(units.units), "cpu", root=patcher.get_model_object("diffusion_model"),
                                      resident_layers=plan.resident_count, prefetch_size=1,
                                      streamed_tail_bytes=plan.tails)
    try:
        units.place_rest("cpu")
        # three forwards: the first learns the call order (the units' definition order is not it: Flux runs both
        # modulations first), the second ends by prefetching the first units of the third, as every later one does
        assert torch.equal(tiny_dits.sample(patcher, seed=5, steps=3), want)
        stats = manager.stats()
        streamed = [tail for tail, keep in zip(manager.block_tails(), plan.resident) if not keep]
        assert stats.bytes_copied_last_forward == plan.streamed_bytes == sum(streamed)
        assert manager.device_bytes() == manager.planned_device_bytes() <= room
    finally:
        manager.detach()


@pytest.mark.parametrize("prefetch", [1, 3])
@pytest.mark.parametrize("policy", ["leading", "strided"])
def test_weight_units_of_flux_bitwise_for_whole_units(policy, prefetch):
    """Whole units streamed (no tails), at several resident counts: the same output as ComfyUI alone."""
    want = tiny_dits.sample(tiny_dits.build_tiny("flux"), seed=2, steps=2)
    mm.unload_all_models()
    patcher = tiny_dits.build_tiny("flux")
    units = weight_units(blocks_of(patcher))
    manager = apply_layerwise_offload(list(units.units), "cpu", root=patcher.get_model_object("diffusion_model"),
                                      resident_layers=0, prefetch_size=prefetch, policy=policy)
    try:
        for resident in (0, len(units) // 3, len(units) - 1):
            manager.replan(resident_layers=resident)
            assert torch.equal(tiny_dits.sample(patcher, seed=2, steps=2), want), resident
            mm.unload_all_models()
    finally:
        manager.detach()
