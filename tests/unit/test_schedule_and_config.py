"""Resident-count semantics, policies, prefetch order, and a property test over random plans."""

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerwise_offload.devtools.toy_transformer import toy_and_reference
from layerwise_offload.offload import OffloadConfig, Schedule, apply_layerwise_offload, choose_resident_blocks


@pytest.mark.parametrize("value, blocks, expected", [
    (0, 10, 0), (3, 10, 3), (3.9, 10, 3), (10, 10, 10), (0.5, 10, 5), (0.25, 10, 2), (0.34, 60, 20),
    (0.99, 4, 4), (1, 4, 1), (1.0, 4, 1),
])
def test_resident_count_and_fraction(value, blocks, expected):
    assert OffloadConfig(resident_layers=value).resident_count(blocks) == expected


def test_counts_above_the_block_count_clamp_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="layerwise_offload"):
        assert OffloadConfig(resident_layers=99).resident_count(12) == 12
    assert len(caplog.records) == 1
    assert "resident_layers=99 exceeds the 12 blocks" in caplog.records[0].getMessage()


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "3", None, [1]])
def test_bad_resident_values_are_value_errors(bad):
    with pytest.raises(ValueError, match="resident_layers"):
        OffloadConfig(resident_layers=bad)


def test_leading_and_strided_choices():
    assert choose_resident_blocks(5, 2, "leading") == (True, True, False, False, False)
    strided = Schedule(choose_resident_blocks(10, 7, "strided"))
    assert strided.streamed_blocks == (1, 5, 8)
    assert Schedule(choose_resident_blocks(10, 0, "strided")).streamed_blocks == tuple(range(10))
    assert Schedule(choose_resident_blocks(10, 10, "strided")).streamed_blocks == ()
    with pytest.raises(ValueError, match="unknown residency policy 'middle'"):
        choose_resident_blocks(4, 1, "middle")


def test_a_config_schedules_its_resident_count_by_its_policy():
    assert Schedule.for_config(OffloadConfig(resident_layers=0.7, policy="strided"), 10) == Schedule(
        choose_resident_blocks(10, 7, "strided"))
    assert Schedule.for_config(OffloadConfig(resident_layers=99), 4).resident == (True,) * 4


def test_upcoming_streamed_wraps_into_the_next_step():
    schedule = Schedule(choose_resident_blocks(6, 2, "leading"))  # streamed: 2, 3, 4, 5
    assert schedule.upcoming_streamed(0, 2) == [2, 3]
    assert schedule.upcoming_streamed(3, 2) == [4, 5]
    assert schedule.upcoming_streamed(5, 2) == [2, 3]
    assert schedule.upcoming_streamed(4, 9) == [5, 2, 3]  # never the block itself, never twice
    assert Schedule(choose_resident_blocks(3, 3, "leading")).upcoming_streamed(0, 1) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    double=st.integers(1, 3),
    single=st.integers(0, 4),
    resident=st.one_of(st.integers(0, 8), st.floats(0.01, 0.99)),
    prefetch=st.integers(1, 4),
    policy=st.sampled_from(["leading", "strided"]),
    data=st.data(),
)
def test_random_plans_and_call_patterns(double, single, resident, prefetch, policy, data):
    count = double + single
    order = data.draw(st.lists(st.integers(0, count - 1), min_size=0, max_size=2 * count), label="order")
    model, x, want = toy_and_reference(order, double, single)
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model,
                                      resident_layers=resident, prefetch_size=prefetch, policy=policy)
    blocks = model.blocks_in_call_order()
    residents = OffloadConfig(resident_layers=resident).resident_count(count)
    peak = []

    def check(module, args):
        for index, block in enumerate(blocks):
            real = all(p.numel() > 0 for p in block.parameters())
            assert real == manager.points_at_device(index)
        peak.append(len(manager.materialized_blocks()))
    watchers = [block.register_forward_pre_hook(check) for block in blocks]
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert max(peak, default=0) <= residents + prefetch + 1
    manager.release_all()
    assert manager.device_bytes() == 0 and not manager.materialized_blocks()
    manager.detach()
    for watcher in watchers:
        watcher.remove()
    with torch.no_grad():
        assert torch.equal(model(x), want)
