"""Auto-sizing the resident count: synthetic block sizes against synthetic budgets."""

import csv
import itertools
import random
from pathlib import Path

import pytest

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import LayerwiseOffloadManager, choose_resident_blocks
from layerwise_offload.offload.activation_model import LINES
from layerwise_offload.offload.planner import (
    ResidencyPlan, describe, estimate_activation_bytes, forward_activation_bytes, plan_residency)

MiB = 2**20
GiB = 2**30


def footprint(sizes, count, prefetch, policy):
    """The device bytes a manager holds for ``count`` residents, computed the long way."""
    resident = choose_resident_blocks(len(sizes), count, policy)
    streamed = [s for s, keep in zip(sizes, resident) if not keep]
    slots = min(prefetch + 1, len(streamed)) * max(streamed, default=0)
    return sum(s for s, keep in zip(sizes, resident) if keep) + slots


def brute_force_count(sizes, free, prefetch, policy, overhead=0):
    fitting = [r for r in range(len(sizes) + 1) if footprint(sizes, r, prefetch, policy) + overhead <= free]
    return max(fitting) if fitting else None


# ----------------------------------------------------------------- uniform blocks, exact numbers
def test_uniform_blocks_exact_boundary():
    sizes = [100] * 10
    # r residents + 2 slots (prefetch 1) of 100 bytes each, plus 50 of overhead.
    for r in range(0, 8):
        need = 100 * r + 200 + 50
        at = plan_residency(sizes, need, reserve_bytes=20, activation_bytes=20, non_block_bytes=10)
        assert at.fits and at.resident_count == r and at.headroom_bytes == 0
        below = plan_residency(sizes, need - 1, reserve_bytes=20, activation_bytes=20, non_block_bytes=10)
        if r == 0:
            assert not below.fits and below.resident_count == 0 and below.headroom_bytes == -1
        else:
            assert below.fits and below.resident_count == r - 1
    # 8 and 9 residents need as much as all 10 (their slots cost what the streamed blocks would), so the
    # next step after 7 is straight to everything resident.
    assert plan_residency(sizes, 1049, reserve_bytes=50).resident_count == 7
    assert plan_residency(sizes, 1050, reserve_bytes=50).resident_count == 10


def test_plan_fields_add_up():
    sizes = [3 * MiB, 5 * MiB, 4 * MiB, 2 * MiB, 6 * MiB, 1 * MiB]
    plan = plan_residency(sizes, 30 * MiB, reserve_bytes=7 * MiB, activation_bytes=3 * MiB,
                          non_block_bytes=2 * MiB, prefetch_size=1)
    assert isinstance(plan, ResidencyPlan)
    assert plan.resident_bytes + plan.streamed_bytes == sum(sizes)
    assert plan.required_bytes == plan.resident_bytes + plan.slot_bytes + 12 * MiB
    assert plan.headroom_bytes == plan.free_bytes - plan.required_bytes >= 0
    assert plan.device_bytes == plan.resident_bytes + plan.slot_bytes
    assert plan.streamed_count == len(sizes) - plan.resident_count
    assert sum(plan.resident) == plan.resident_count
    # 18 MiB left for blocks. 1 resident: 3 + 2 slots of 6 = 15 MiB; 2 resident: 8 + 12 = 20 MiB.
    assert plan.resident_count == 1 and plan.headroom_bytes == 3 * MiB
    assert plan.resident_count == brute_force_count(sizes, 30 * MiB, 1, "leading", overhead=12 * MiB)
    with pytest.raises(Exception):
        plan.resident_count = 3  # frozen


def test_all_fit_drops_the_slots():
    sizes = [10] * 8
    # Everything resident needs exactly 80 bytes: no slots at all.
    plan = plan_residency(sizes, 80)
    assert plan.fits and plan.resident_count == 8
    assert plan.slot_bytes == 0 and plan.slot_count == 0 and plan.streamed_bytes == 0
    assert plan.headroom_bytes == 0
    # One byte less: 7 residents need 70 + 1 slot (only one block streams) = 80 > 79, so 6 + 2 slots = 80 > 79,
    # ... 5 residents + 2 slots = 70 fits.
    plan = plan_residency(sizes, 79)
    assert plan.resident_count == 5 and plan.slot_count == 2


def test_fewer_streamed_blocks_than_window_need_fewer_slots():
    # The manager makes min(prefetch + 1, streamed) slots: 3 blocks, window 5, so 3 slots.
    plan = plan_residency([10, 20, 10], 39, prefetch_size=4)
    assert not plan.fits and plan.slot_count == 3 and plan.slot_bytes == 60
    # Streaming fewer blocks than the window holds never needs less than keeping them all.
    assert plan_residency([10, 20, 10], 40, prefetch_size=4).resident_count == 3


def test_nothing_fits():
    sizes = [100] * 4
    plan = plan_residency(sizes, 500, reserve_bytes=400)
    # Zero residents still need 2 slots (200) + 400 reserve = 600 > 500.
    assert not plan.fits
    assert plan.resident_count == 0 and plan.resident == (False,) * 4
    assert plan.headroom_bytes == -100
    line = describe(plan)
    assert line.startswith("[layerwise-offload] auto plan: 0/4 blocks resident")
    assert "does not fit" in line and "short by 100 B" in line


def test_zero_free_memory_and_empty_block_list():
    assert not plan_residency([1], 0).fits
    empty = plan_residency([], 0)
    assert empty.fits and empty.resident_count == 0 and empty.slot_bytes == 0
    assert not plan_residency([], 5, reserve_bytes=6).fits


def test_slots_sized_by_largest_streamed_block_leading():
    # The big block is first: keeping it resident shrinks every slot.
    sizes = [50, 10, 10, 10, 10]
    # r=0: 2 slots of 50 = 100; r=1: 50 + 2*10 = 70; r=2: 80; r=3..5: 90.
    assert footprint(sizes, 0, 1, "leading") > footprint(sizes, 1, 1, "leading")
    assert plan_residency(sizes, 90).resident_count == 5
    assert plan_residency(sizes, 89).resident_count == 2
    assert plan_residency(sizes, 79).resident_count == 1
    at_69 = plan_residency(sizes, 69)
    assert not at_69.fits and at_69.resident_count == 0 and at_69.slot_bytes == 100


def test_largest_count_wins_even_when_a_smaller_one_needs_more():
    # The last block is huge: streaming it forces huge slots, keeping it resident costs it once.
    sizes = [10, 10, 10, 100]
    # All resident: 130. r=3 (leading): 30 + 1 slot of 100 = 130, too; r=0: 2 slots of 100 = 200.
    plan = plan_residency(sizes, 130)
    assert plan.resident_count == 4 and plan.slot_bytes == 0
    assert plan_residency(sizes, 129).resident_count == 0 and not plan_residency(sizes, 129).fits


@pytest.mark.parametrize("policy", ["leading", "strided"])
def test_matches_choose_resident_blocks(policy):
    sizes = [7, 3, 9, 1, 4, 8, 2, 6, 5]
    for free in range(0, sum(sizes) + 20):
        plan = plan_residency(sizes, free, prefetch_size=2, policy=policy)
        assert plan.resident == choose_resident_blocks(len(sizes), plan.resident_count, policy)
        assert plan.resident_bytes == sum(s for s, k in zip(sizes, plan.resident) if k)


def test_strided_and_leading_differ_in_slot_size():
    # Block sizes grow along the step: leading keeps the small ones and streams the big tail,
    # strided spreads the streamed blocks and keeps some big ones.
    sizes = [10, 20, 30, 40, 50, 60, 70, 80]
    leading = plan_residency(sizes, 300, policy="leading")
    strided = plan_residency(sizes, 300, policy="strided")
    for plan in (leading, strided):
        assert plan.fits and 0 < plan.resident_count < len(sizes)
        assert plan.required_bytes == footprint(sizes, plan.resident_count, 1, plan.policy)
        assert plan.resident_count == brute_force_count(sizes, 300, 1, plan.policy)
    assert leading.resident != strided.resident
    # Leading streams the tail, so its slots hold the largest block: 4 resident = 100 + 2 * 80.
    assert leading.resident_count == 4 and leading.slot_bytes == 2 * 80 and leading.headroom_bytes == 40


@pytest.mark.parametrize("prefetch", [1, 2, 3, 8])
def test_prefetch_sizes(prefetch):
    sizes = [100] * 12
    plan = plan_residency(sizes, 1000, prefetch_size=prefetch)
    streamed = 12 - plan.resident_count
    assert plan.slot_count == min(prefetch + 1, streamed)
    assert plan.slot_bytes == plan.slot_count * 100
    assert plan.resident_count == brute_force_count(sizes, 1000, prefetch, "leading")
    # A deeper window never lets more blocks stay.
    if prefetch > 1:
        assert plan.resident_count <= plan_residency(sizes, 1000, prefetch_size=prefetch - 1).resident_count


@pytest.mark.parametrize("policy,prefetch", list(itertools.product(["leading", "strided"], [1, 2, 4])))
def test_random_sizes_match_brute_force_and_are_monotonic_in_free_memory(policy, prefetch):
    rng = random.Random(f"{policy}{prefetch}")
    for _ in range(25):
        n = rng.randint(1, 14)
        sizes = [rng.choice([0, 1, 2, 5, 8, 13, 40]) for _ in range(n)]
        overhead = rng.randint(0, 20)
        previous = -1
        for free in range(0, sum(sizes) + 3 * max(sizes) + overhead + 3):
            plan = plan_residency(sizes, free, reserve_bytes=overhead, prefetch_size=prefetch, policy=policy)
            expected = brute_force_count(sizes, free, prefetch, policy, overhead)
            assert plan.fits == (expected is not None)
            assert plan.resident_count == (expected or 0)
            assert plan.resident_count >= previous, "more free memory never keeps fewer blocks"
            if plan.fits:
                previous = plan.resident_count
                assert plan.headroom_bytes >= 0
        assert previous == n, "with enough memory every block stays"


def test_agrees_with_the_manager_footprint():
    model = ToyTransformer(dim=24, hidden=40, double=3, single=5)
    blocks = model.blocks_in_call_order()
    probe = LayerwiseOffloadManager(blocks, "cpu")
    sizes = probe.block_nbytes()
    for policy, prefetch in itertools.product(["leading", "strided"], [1, 2]):
        for free in (0, sizes[0] * 3, sum(sizes) // 2, sum(sizes) - 1, sum(sizes)):
            plan = plan_residency(sizes, free, prefetch_size=prefetch, policy=policy)
            manager = LayerwiseOffloadManager(blocks, "cpu", resident_layers=plan.resident_count,
                                              prefetch_size=prefetch, policy=policy)
            assert manager.device_bytes(manager.config) == plan.device_bytes
            if plan.fits:
                assert manager.device_bytes(manager.config) <= free


@pytest.mark.parametrize("bad", [
    dict(block_bytes=[1, -1], free_bytes=10),
    dict(block_bytes=[1.5], free_bytes=10),
    dict(block_bytes=[1], free_bytes=-1),
    dict(block_bytes=[1], free_bytes=10, reserve_bytes=-2),
    dict(block_bytes=[1], free_bytes=10, prefetch_size=0),
    dict(block_bytes=[1], free_bytes=10, prefetch_size=True),
    dict(block_bytes=[1], free_bytes=10, policy="trailing"),
    dict(block_bytes=[True], free_bytes=10),
])
def test_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        plan_residency(**bad)


# ----------------------------------------------------------------- activations and the log line
def test_estimate_activation_bytes():
    # 4096 tokens, hidden 3072, bf16: (6 + 4) * 3072 * 2 bytes per token.
    base = estimate_activation_bytes(4096, 3072, 2)
    assert base == 4096 * 10 * 3072 * 2
    assert estimate_activation_bytes(4096, 3072, 2, batch=2) == 2 * base
    assert estimate_activation_bytes(4096, 3072, 4) == 2 * base
    with_scores = estimate_activation_bytes(4096, 3072, 2, attention_heads=24)
    assert with_scores == base + 24 * 4096 * 4096 * 2 * 4
    assert estimate_activation_bytes(0, 3072, 2) == 0
    with pytest.raises(ValueError):
        estimate_activation_bytes(-1, 3072, 2)
    with pytest.raises(ValueError):
        estimate_activation_bytes(10, 10, 2, mlp_ratio=-1)


def test_describe_matches_the_documented_line():
    sizes = [int(0.4667 * GiB)] * 60
    plan = plan_residency(sizes, int(13.4 * GiB), prefetch_size=1)
    line = describe(plan)
    assert line.startswith(f"[layerwise-offload] auto plan: {plan.resident_count}/60 blocks resident (")
    assert f"{plan.streamed_count} streamed (" in line and "slots 0.9 GiB" in line and "headroom" in line


# ----------------------------------------------------------------- the measured activation model
ACTIVATION_TABLE = Path(__file__).resolve().parents[2] / "bench" / "results" / "activation_memory.csv"


def _table_rows():
    with open(ACTIVATION_TABLE, newline="") as f:
        return list(csv.DictReader(f))


def test_activation_model_matches_every_row_of_the_measured_table():
    rows = _table_rows()
    families = {row["family"] for row in rows}
    assert families == {line.family for line in LINES}, "a table family without a fitted line, or the reverse"
    line_of = {line.family: line for line in LINES}
    for row in rows:
        line = line_of[row["family"]]
        latent_elements = int(row["tokens"]) * line.patch_area
        estimate = forward_activation_bytes(line.model_class, int(row["block_width"]), latent_elements,
                                            batch=int(row["batch"]), dtype_bytes=2,
                                            latent_channels=int(row["latent_channels"]))
        measured = int(row["peak_bytes"])
        assert estimate.source == f"measured {row['family']}"
        assert abs(estimate.nbytes - measured) <= 0.10 * measured, (row, estimate)


def test_activation_model_scales_with_dtype_batch_and_unknown_widths():
    one = forward_activation_bytes("WanModel", 5120, 21 * 60 * 104, batch=1, dtype_bytes=2)
    assert one.tokens == 32760
    assert forward_activation_bytes("WanModel", 5120, 21 * 60 * 104, batch=2, dtype_bytes=2).nbytes == 2 * one.nbytes
    assert forward_activation_bytes("WanModel", 5120, 21 * 60 * 104, batch=1, dtype_bytes=4).nbytes == 2 * one.nbytes
    wider = forward_activation_bytes("WanModel", 6000, 21 * 60 * 104)
    assert wider.source == "wan_14b scaled to width 6000" and wider.nbytes > one.nbytes
    # A Flux 2 of Flux.1's width (128 latent channels, patch 1) takes Flux 2's line, scaled to the width.
    small_flux2 = forward_activation_bytes("Flux", 3072, 64 * 64, latent_channels=128)
    assert small_flux2.source == "flux2 scaled to width 3072" and small_flux2.tokens == 4096
    assert forward_activation_bytes("Flux", 3072, 128 * 128, latent_channels=16).source == "measured flux1"
    other = forward_activation_bytes("SomeNewDiT", 1024, 64 * 64)
    assert other.source == "heuristic" and other.nbytes == estimate_activation_bytes(1024, 1024, 2, 1)
    with pytest.raises(ValueError, match="batch"):
        forward_activation_bytes("Flux", 3072, 4096, batch=0)
