"""Prefetch follows the order the model really runs its blocks in, learned from its forwards."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerwise_offload.devtools.toy_transformer import ToyTransformer, toy_and_reference
from layerwise_offload.offload import apply_layerwise_offload
from layerwise_offload.offload.call_order import CallOrder

VACE_LIKE = [0, 4, 1, 2, 5, 3, 6]  # main blocks 0-3, "vace" blocks 4-6 run after main blocks 0, 2, 3


def run(order, resident, prefetch, forwards, policy="leading", double=3, single=4):
    model, x, want = toy_and_reference(order, double, single)
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=resident,
                                      prefetch_size=prefetch, policy=policy)
    per_forward = []
    with torch.no_grad():
        for _ in range(forwards):
            demand = manager.stats().demand_copies
            assert torch.equal(model(x), want)
            stats = manager.stats()
            per_forward.append((stats.demand_copies - demand, stats.bytes_copied_last_forward))
    return manager, per_forward


def streamed_bytes(manager, order, prefetch):
    """What one forward must move: each streamed block it runs, once; nothing when they all fit in the slots."""
    streamed = [i for i in dict.fromkeys(order) if not manager.schedule.resident[i]]
    if len(streamed) <= prefetch:
        return 0
    sizes = manager.block_nbytes()
    return sum(sizes[i] for i in streamed)


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("resident", [0, 2])
def test_an_interleaved_order_makes_no_demand_copies_after_the_first_forward(resident, prefetch):
    manager, per_forward = run(VACE_LIKE, resident, prefetch, forwards=4)
    assert manager.engine.calls.learned_calls == tuple(VACE_LIKE)
    for demand, moved in per_forward[2:]:
        assert demand == 0
        assert moved == streamed_bytes(manager, VACE_LIKE, prefetch)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), resident=st.integers(0, 6), prefetch=st.integers(1, 3),
       policy=st.sampled_from(["leading", "strided"]))
def test_any_order_without_repeats_moves_exactly_the_streamed_bytes(data, resident, prefetch, policy):
    blocks = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=7, unique=True), label="order")
    manager, per_forward = run(blocks, resident, prefetch, forwards=3, policy=policy)
    demand, moved = per_forward[-1]
    assert demand == 0
    assert moved == streamed_bytes(manager, blocks, prefetch)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), resident=st.integers(0, 6), prefetch=st.integers(1, 3))
def test_orders_with_repeats_make_no_demand_copies_after_warmup(data, resident, prefetch):
    order = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=12), label="order")
    _, per_forward = run(order, resident, prefetch, forwards=3)
    assert per_forward[-1][0] == 0


def test_vace_contexts_run_a_block_twice_and_its_slot_keeps_it():
    order = [0, 4, 4, 1, 2, 5, 5, 3, 6, 6]  # two VACE contexts: each vace block runs twice in a row
    manager, per_forward = run(order, 0, 1, forwards=3)
    assert per_forward[-1] == (0, sum(manager.block_nbytes()))  # every block copied once, none on demand


def test_a_changed_order_is_learned_again():
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(0))
    model = ToyTransformer(dim=16, hidden=24)
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, prefetch_size=1)
    with torch.no_grad():
        for order in (VACE_LIKE, list(reversed(VACE_LIKE))):
            model.order = order
            for _ in range(3):
                demand = manager.stats().demand_copies
                model(x)
            assert manager.engine.calls.learned_calls == tuple(order)
            assert manager.stats().demand_copies == demand  # the last forward of each order
    manager.detach()


def test_an_interrupted_forward_is_not_learned():
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(0))
    model = ToyTransformer(dim=16, hidden=24)
    model.order = VACE_LIKE
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu")
    calls = 0

    def interrupt(module, args):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
    handle = model.blocks_in_call_order()[1].register_forward_pre_hook(interrupt)
    with torch.no_grad():
        with manager.engine.hooks.forward_scope():
            model(x)
        with pytest.raises(KeyboardInterrupt), manager.engine.hooks.forward_scope():
            model(x)  # ran blocks 0 and 4, then stopped
    handle.remove()
    assert manager.engine.calls.learned_calls == tuple(VACE_LIKE)


def test_call_order_look_ahead():
    resident = [True, False, False, True, False]
    order = CallOrder([0, 1, 3, 2, 1, 4], resident)
    assert order.window(0, 2) == [1, 2]
    assert order.window(2, 3) == [2, 1, 4]
    assert order.window(5, 2) == [1, 2]  # wraps into the next forward
    assert order.locate(1, 1) == 1
    assert order.locate(1, 2) == 4  # skipped 3 and 2: the next call of 1
    assert order.locate(3, 3) is None  # 3 ran once already: not in the rest of the record



def test_the_learned_order_survives_a_new_plan():
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(0))
    model = ToyTransformer(dim=16, hidden=24)
    model.order = VACE_LIKE
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, prefetch_size=1)
    with torch.no_grad():
        model(x)
        manager.replan(resident_layers=3)  # residency changes, the model's call order does not
        demand = manager.stats().demand_copies
        model(x)  # arms the new plan: prefetch follows the learned order from its first block on
    assert manager.schedule.resident_blocks == (0, 1, 2)
    assert manager.stats().demand_copies == demand
