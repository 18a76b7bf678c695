"""Weight units (offload/units.py) and their planner: which modules become units, what is left out and placed, the
plan's arithmetic (what it holds fits the room, what it streams covers the deficit), and the manager running it
bitwise with only the planned tails moving."""

import pytest
import torch
from torch import nn

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import (apply_layerwise_offload, footprint, plan_streamed_tails, plan_weight_units,
                                       weight_units)
from layerwise_offload.offload.host.packing import block_parameters, plan_layout


def test_units_are_the_modules_that_own_weights_and_the_rest_is_left_out():
    model = ToyTransformer()
    blocks = model.blocks_in_call_order()
    units = weight_units(blocks)
    assert units.names[:3] == ("0.mix", "0.up", "0.down") and len(units) == 3 * len(blocks)
    assert units.block_of == tuple(i for i in range(len(blocks)) for _ in range(3))
    # the gate is read by the block's own forward, around its children's: no unit covers it; the norm's weights are
    # vectors (a fused kernel of a parent may read them without calling the norm)
    assert [name for name, _ in units.left_out] == [f"{i}{name}" for i in range(len(blocks))
                                                   for name in (".gate", ".norm.weight", ".norm.bias")]
    owned = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    in_units = sum(p.numel() * p.element_size() for unit in units.units for p in unit.parameters())
    assert in_units + units.left_out_nbytes() == owned
    assert all(size >= nbytes for size, nbytes in zip(units.geometry()[0],  # packed: each weight 256-aligned
                                                       (sum(p.numel() * p.element_size() for p in unit.parameters())
                                                        for unit in units.units)))


def test_residents_first_puts_the_largest_smallest_tail_first_and_keeps_the_modules():
    units = weight_units(ToyTransformer().blocks_in_call_order())
    ordered = units.residents_first()
    smallest = [options[0] for options in ordered.geometry()[1]]
    assert smallest == sorted(smallest, reverse=True)
    assert set(map(id, ordered.units)) == set(map(id, units.units))
    assert dict(zip(map(id, ordered.units), ordered.names)) == dict(zip(map(id, units.units), units.names))


def test_place_rest_moves_the_blocks_buffers_and_keeps_what_is_placed():
    block = nn.Sequential(nn.Linear(4, 4), nn.Sequential())
    block[1].register_buffer("table", torch.ones(4))
    units = weight_units([block])
    assert len(units) == 1 and not units.left_out
    units.place_rest("meta")  # a device of its own, as a GPU would be
    assert block[1].table.device.type == "meta" and block[0].weight.device.type == "cpu"
    toy = ToyTransformer()
    toy_units = weight_units(toy.blocks_in_call_order())
    gates = [param.data_ptr() for _, param in toy_units.left_out]
    toy_units.place_rest("cpu")  # already there: the same storage
    assert [param.data_ptr() for _, param in toy_units.left_out] == gates


def test_blocks_without_units_and_modules_in_two_blocks_are_refused():
    with pytest.raises(ValueError, match="block 1 .*has no module"):
        weight_units([nn.Linear(2, 2), nn.ReLU()])
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="belongs to two blocks"):
        weight_units([nn.Sequential(shared), nn.Sequential(shared)])


def unit_geometry():
    units = weight_units(ToyTransformer().blocks_in_call_order()).residents_first()
    return units, *units.geometry()


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7, 0.9])
def test_the_plan_fits_covers_the_deficit_and_streams_less_than_whole_tails(fraction):
    units, sizes, options = unit_geometry()
    room = int(fraction * sum(sizes))
    plan = plan_weight_units(sizes, options, room)
    assert plan.fits and plan.required_bytes <= room
    held = footprint(sizes, plan.resident, 1, plan.tails)
    assert held.total == plan.required_bytes and held.streamed_bytes == plan.streamed_bytes
    streamed = [tail for tail, keep in zip(plan.tails, plan.resident) if not keep]
    assert plan.streamed_bytes >= sum(sizes) - room + 2 * max(streamed) - 2 * max(streamed)  # covers the deficit
    assert plan.streamed_bytes >= sum(sizes) - room
    assert all(tail in opts for tail, opts, keep in zip(plan.tails, options, plan.resident) if not keep)
    # the residents lead: every unit that cannot stream within the largest tail is among them
    assert plan.resident == tuple(i < plan.resident_count for i in range(len(sizes)))
    assert all(opts[0] <= max(streamed) for opts, keep in zip(options, plan.resident) if not keep)
    blocks = ToyTransformer().blocks_in_call_order()
    block_layouts = [plan_layout(block_parameters(b)) for b in blocks]
    whole = plan_streamed_tails([l.nbytes for l in block_layouts], [l.tail_sizes for l in block_layouts],
                                room + units.left_out_nbytes(), tries=1000)
    if whole is not None:
        assert plan.streamed_bytes < whole.streamed_bytes


def test_no_plan_when_nothing_fits_and_lengths_must_match():
    _, sizes, options = unit_geometry()
    assert plan_weight_units(sizes, options, 0) is None
    with pytest.raises(ValueError, match="tail_options has 1 units"):
        plan_weight_units(sizes, options[:1], 10**6)


@pytest.mark.parametrize("fraction", [0.4, 0.8])
def test_the_manager_runs_the_plan_bitwise_and_moves_only_its_tails(fraction):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ToyTransformer()(x)
    model = ToyTransformer()
    units = weight_units(model.blocks_in_call_order()).residents_first()
    sizes, options = units.geometry()
    plan = plan_weight_units(sizes, options, int(fraction * sum(sizes)))
    manager = apply_layerwise_offload(list(units.units), "cpu", root=model, resident_layers=plan.resident_count,
                                      streamed_tail_bytes=plan.tails)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(model(x), want)
        assert manager.stats().bytes_copied_last_forward == plan.streamed_bytes
        assert manager.device_bytes() == plan.required_bytes
    finally:
        manager.detach()


def test_the_plan_trades_weights_of_two_sizes_to_leave_almost_no_room_unused():
    """Ten FFN-like units (a 141-byte weight, a 1-byte bias) and twenty attention-like ones (52 + 1): the tails can
    sum only to 30 + 141a + 52b. Greedy lowering leaves up to a weight of room unused; trading one FFN weight for
    attention weights gets within 3 bytes of the room (a = 9, b = 9), the best any choice can do."""
    options = [(1, 142)] * 10 + [(1, 53)] * 20
    sizes = [opts[-1] for opts in options]
    plan = plan_weight_units(sizes, options, 1000)
    assert plan.fits and plan.resident_count == 0
    assert 0 <= plan.headroom_bytes <= 3
    streamed = sorted(plan.tails)
    assert streamed.count(142) * 141 + streamed.count(53) * 52 + 30 == plan.streamed_bytes


def test_a_room_for_everything_keeps_every_unit_resident():
    _, sizes, options = unit_geometry()
    plan = plan_weight_units(sizes, options, sum(sizes))
    assert plan.fits and plan.resident_count == len(sizes) and plan.streamed_bytes == 0 and plan.slot_bytes == 0
