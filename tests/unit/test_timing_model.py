"""The timing model (offload/timing/): hand-computed steps, the choice auto makes, and that the schedule it computes
from a plan is the one the real manager queues (bench/timing_replay.py records and times it).

The hand cases use a "unit GPU": 1 byte/s of H2D and one FLOP/s of DiT compute, so a block of 2 bytes copies in 2 s
and a block of 1 FLOP computes in 1 s; host costs and the copy latency are 0 unless a test sets them.
"""

import itertools

import pytest

from layerwise_offload.bench import timing_replay
from layerwise_offload.offload.timing import TIMING_GPU_ENV, choice, costs as tc, step, timing_for

UNIT = tc.GpuSpec("unit", 0, h2d_bytes_per_s=1.0, matmul_flops_per_s=1.0 / tc.DIT_EFFICIENCY, hbm_bytes_per_s=1.0)


@pytest.fixture
def no_copy_latency(monkeypatch):
    monkeypatch.setattr(step, "COPY_LATENCY_S", 0.0)


def costs(n, nbytes, flops, **kw):
    kw.setdefault("host_s_per_streamed_block", 0.0)
    kw.setdefault("launch_s_per_block", 0.0)
    return tc.ModelCosts((nbytes,) * n, (flops,) * n, **kw)


def test_streaming_every_block_with_no_compute_takes_the_bytes_over_the_bandwidth(no_copy_latency):
    p = step.predict(costs(6, 2.0, 0.0), UNIT, 0)
    assert p.step_s == pytest.approx(12.0)
    assert p.bound_s == pytest.approx(12.0) and p.ratio == pytest.approx(1.0)
    assert p.copy_idle_s == pytest.approx(0.0) and p.copies == 6


def test_copy_bound_streaming_hides_the_compute(no_copy_latency):
    p = step.predict(costs(6, 2.0, 1.0), UNIT, 0)
    assert p.step_s == pytest.approx(12.0) and p.compute_stall_s == pytest.approx(6.0)


def test_every_block_resident_takes_the_compute(no_copy_latency):
    p = step.predict(costs(5, 2.0, 1.0, outside_flops=0.5), UNIT, 5)
    assert p.step_s == pytest.approx(5.5) and p.bound_s == pytest.approx(5.5)
    assert p.copies == 0 and p.copy_idle_s == 0.0 and p.compute_stall_s == pytest.approx(0.0)


def test_leading_with_prefetch_1_leaves_the_copy_engine_idle_under_the_residents(no_copy_latency):
    """8 blocks, 4 resident, compute 1 s, copy 2 s: the bound is max(8, 4 x 2) = 8 s.

    leading, prefetch 1 (2 slots): the last block of a step prefetches only the first streamed block (4) of the
    next, during blocks 6-7. Blocks 0-3 compute [0, 4) while the engine is idle from 1; copy 5 may start only once
    block 7 of the last step freed its slot (0) and the engine is free (1): [1, 3); block 4 [4, 5); copy 6 waits
    for block 4's slot: [5, 7); block 5 [5, 6), block 6 [7, 8); copy 7 waits for block 5 (6) and the engine (7):
    [7, 9); block 7 [9, 10); copy 4 of the next step [9, 11), as the last one. Step: 10 s, 1.25 x the bound.
    strided puts streamed blocks 1, 3, 5, 7 between residents: each copy has 2 s of compute in front of it.
    """
    c = costs(8, 2.0, 1.0)
    leading = step.predict(c, UNIT, 4, "leading", 1)
    assert leading.step_s == pytest.approx(10.0) and leading.ratio == pytest.approx(1.25)
    assert leading.copy_idle_s == pytest.approx(2.0) and leading.compute_stall_s == pytest.approx(2.0)
    assert step.predict(c, UNIT, 4, "strided", 1).step_s == pytest.approx(8.0)
    assert step.predict(c, UNIT, 4, "leading", 2).step_s == pytest.approx(8.0)  # a third slot holds copy 5 early
    picked = choice.choose_plan(c, UNIT, [(policy, prefetch, 4) for policy, prefetch in choice.SETTINGS])
    assert (picked.policy, picked.prefetch) == ("strided", 1) and picked.prediction.ratio == pytest.approx(1.0)


def test_lora_on_a_stream_of_its_own_never_delays_the_next_copy(no_copy_latency):
    """Copy 2 s + LoRA 1 s per block, compute 1 s: the copy engine runs the copies back to back and the step is the
    copy bound (with the LoRA on the copy stream each slot would come 3 s apart: 18 s)."""
    p = step.predict(costs(6, 2.0, 1.0, lora_bytes=(1.0,) * 6), UNIT, 0)
    assert p.step_s == pytest.approx(12.0, rel=1e-3) and p.bound_s == pytest.approx(12.0)


def test_host_time_bounds_the_step_when_the_gpu_is_fast(no_copy_latency):
    p = step.predict(costs(4, 1e-3, 1e-3, host_s_per_streamed_block=1.0), UNIT, 0)
    assert p.step_s >= 4.0 and p.host_s == pytest.approx(4.0)


def test_streamed_blocks_that_fit_in_the_ring_keep_their_slots(no_copy_latency):
    p = step.predict(costs(6, 2.0, 1.0), UNIT, 4, "leading", 2)  # 2 streamed, 3 slots
    assert p.copies == 0 and p.step_s == pytest.approx(6.0)


def test_the_timeline_of_the_last_forward(no_copy_latency):
    """Per-block spans from the end of the forward before's last block (what a GPU run's CUDA events measure)."""
    resident = step.predict(costs(4, 2.0, 1.0), UNIT, 4)
    assert [t for span in resident.block_spans for t in span] == pytest.approx([0, 1, 1, 2, 2, 3, 3, 4])
    assert resident.copy_spans == ()
    streamed = step.predict(costs(4, 2.0, 1.0), UNIT, 0)  # copy-bound: each block waits for its copy
    for (start, end), (next_start, _) in zip(streamed.block_spans, streamed.block_spans[1:]):
        assert end - start == pytest.approx(1.0) and next_start >= end
    assert streamed.block_spans[-1][1] == pytest.approx(streamed.step_s)  # no outside work: the step ends there
    for block, (start, _) in enumerate(streamed.block_spans):  # each block's copy ends before its kernels start
        assert any(b == block and e <= start + 1e-9 for b, _, e in streamed.copy_spans)
    assert min(e for _, _, e in streamed.copy_spans) < 0  # block 0's copy: queued at the end of the forward before


def mixed_costs(n, lora=False, tails=False):
    """Blocks of uneven bytes and FLOPs on an H200, host costs as the product charges them."""
    gpu = tc.GPUS["H200 141GB"]
    return tc.ModelCosts(tuple((3 + i % 4) * 10**8 for i in range(n)),
                         tuple(gpu.dit_flops_per_s * (1 + (i * 7) % 5) * 1e-3 for i in range(n)),
                         outside_flops=gpu.dit_flops_per_s * 4e-3,
                         lora_bytes=tuple(2 * 10**9 for _ in range(n)) if lora else None,
                         tail_bytes=tuple((1 + i % 3) * 10**8 for i in range(n)) if tails else None)


PLANS = [(n, r, policy, prefetch) for n, r, policy, prefetch in itertools.product(
    (1, 5, 9), (0, 2, 4, 8), ("leading", "strided"), (1, 2, 3, 6, 16)) if r <= n]


@pytest.mark.parametrize("n, lora, tails", [(1, False, False), (5, True, False), (9, False, True)])
def test_the_model_times_the_managers_own_schedule(n, lora, tails):
    """The schedule computed from the plan is the one the real manager queues: the same steps as the manager's
    recorded schedule timed with the same costs, at every plan (a ring larger than the streamed blocks included)."""
    c, gpu = mixed_costs(n, lora, tails), tc.GPUS["H200 141GB"]
    for _, r, policy, prefetch in (plan for plan in PLANS if plan[0] == n):
        model = step.predict(c, gpu, r, policy, prefetch)
        replayed = timing_replay.predict(c, gpu, r, policy, prefetch)
        plan = (r, policy, prefetch)
        assert model.step_s == pytest.approx(replayed.step_s, rel=1e-9), plan
        assert model.compute_stall_s == pytest.approx(replayed.compute_stall_s, rel=1e-9, abs=1e-12), plan
        assert model.host_s == pytest.approx(replayed.host_s, rel=1e-9), plan
        assert model.copies == replayed.copies, plan


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="block_flops"):
        tc.ModelCosts((1, 2), (1.0,))
    with pytest.raises(ValueError, match="unknown residency policy"):
        step.predict(costs(3, 1.0, 1.0), UNIT, 1, "trailing")


def test_reference_gpus_say_where_their_figures_come_from():
    assert len(tc.GPUS) == 4
    for gpu in tc.GPUS.values():
        assert gpu.source and gpu.h2d_bytes_per_s > 1e10 and gpu.matmul_flops_per_s > 1e13


def test_choose_plan_picks_a_setting_at_the_bound_where_leading_misses_it():
    """Copies twice as long as compute with half the blocks resident: leading with prefetch 1 leaves the copy engine
    idle while the residents compute; the choice (what residency_policy auto runs) overlaps them."""
    gpu = tc.GPUS["H200 141GB"]
    n, resident = 16, 8
    c = tc.ModelCosts(tuple([600 * 10**6] * n), tuple([gpu.dit_flops_per_s * 5e-3] * n))
    assert step.predict(c, gpu, resident, "leading", 1).ratio > 1.1
    picked = choice.choose_plan(c, gpu, [(policy, prefetch, resident) for policy, prefetch in choice.SETTINGS])
    assert picked.prediction.ratio <= 1.05
    fastest = min(step.predict(c, gpu, resident, p, k).step_s for p, k in choice.SETTINGS)
    assert picked.prediction.step_s <= fastest * choice.CLOSE_STEP
    for policy, prefetch in choice.SETTINGS:  # of the plans as fast as it, none holds fewer device bytes
        other = choice.choose_plan(c, gpu, [(policy, prefetch, resident)])
        if other.prediction.step_s <= fastest * choice.CLOSE_STEP:
            assert picked.device_bytes <= other.device_bytes


def test_choose_plan_takes_a_deeper_ring_where_the_big_blocks_lead():
    """Flux's shape in small (8 blocks of 680 MB, then 16 of 283 MB, each 2.36 ms on an H200) with 13 resident:
    leading keeps the big blocks but a ring of up to 5 slots cannot take the copies of the residents' whole
    stretch; strided reaches its own bound but streams more bytes, so it is slower still. A deeper leading ring is
    faster than both and at its bound."""
    gpu = tc.GPUS["H200 141GB"]
    big, small, resident = 8, 16, 13
    c = tc.ModelCosts(tuple([680 * 10**6] * big + [283 * 10**6] * small),
                      tuple([gpu.dit_flops_per_s * 2.36e-3] * (big + small)))
    shallow = [step.predict(c, gpu, resident, p, k) for p, k in choice.SETTINGS if k <= 4]
    assert min(shallow, key=lambda p: p.step_s).ratio > 1.1
    picked = choice.choose_plan(c, gpu, [(policy, prefetch, resident) for policy, prefetch in choice.SETTINGS])
    assert picked.policy == "leading" and picked.prefetch > 4
    assert picked.prediction.ratio <= 1.05
    assert picked.prediction.step_s < min(p.step_s for p in shallow)


def test_block_flops_counts_linear_weights_and_attention():
    from torch import nn
    block = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    tokens, batch = 10, 2
    assert tc.block_flops(block, tokens, batch) == batch * (2.0 * 2 * 64 * 256 * tokens + 4.0 * tokens**2 * 64)


def test_timing_for_a_named_reference_card_and_none_for_the_cpu(monkeypatch):
    monkeypatch.delenv(TIMING_GPU_ENV, raising=False)
    assert timing_for("cpu") is None
    monkeypatch.setenv(TIMING_GPU_ENV, "RTX 4090 24GB")
    timing = timing_for("cpu")
    assert timing.gpu is tc.GPUS["RTX 4090 24GB"] and timing.name == "RTX 4090 24GB"
    assert timing.settings == choice.SETTINGS
    monkeypatch.setenv(TIMING_GPU_ENV, "RTX 9999")
    with pytest.raises(ValueError, match="RTX 9999.*not a reference GPU.*RTX 4090 24GB"):
        timing_for("cpu")
