"""The timing model (offload/timing_model.py): hand-computed steps, and that it times the manager's real schedule.

The cases use a "unit GPU": 1 byte/s of H2D and one FLOP/s of DiT compute, so a block of 2 bytes copies in 2 s
and a block of 1 FLOP computes in 1 s; host costs and the copy latency are 0 unless a test sets them.
"""

import dataclasses

import pytest

from layerwise_offload.offload.device import backend as device_backend
from layerwise_offload.offload import plan_choice as pc
from layerwise_offload.offload import timing_model as tm

UNIT = tm.GpuSpec("unit", 0, h2d_bytes_per_s=1.0, matmul_flops_per_s=1.0 / tm.DIT_EFFICIENCY, hbm_bytes_per_s=1.0)


@pytest.fixture(autouse=True)
def no_copy_latency(monkeypatch):
    monkeypatch.setattr(tm, "COPY_LATENCY_S", 0.0)


def costs(n, nbytes, flops, **kw):
    kw.setdefault("host_s_per_streamed_block", 0.0)
    kw.setdefault("launch_s_per_block", 0.0)
    return tm.ModelCosts((nbytes,) * n, (flops,) * n, **kw)


def test_streaming_every_block_with_no_compute_takes_the_bytes_over_the_bandwidth():
    p = tm.predict(costs(6, 2.0, 0.0), UNIT, 0)
    assert p.step_s == pytest.approx(12.0)
    assert p.bound_s == pytest.approx(12.0) and p.ratio == pytest.approx(1.0)
    assert p.copy_idle_s == pytest.approx(0.0) and p.copies == 6


def test_copy_bound_streaming_hides_the_compute():
    p = tm.predict(costs(6, 2.0, 1.0), UNIT, 0)
    assert p.step_s == pytest.approx(12.0) and p.compute_stall_s == pytest.approx(6.0)


def test_every_block_resident_takes_the_compute():
    c = costs(5, 2.0, 1.0, outside_flops=0.5)
    p = tm.predict(c, UNIT, 5)
    assert p.step_s == pytest.approx(5.5) and p.bound_s == pytest.approx(5.5)
    assert p.copies == 0 and p.copy_idle_s == 0.0 and p.compute_stall_s == pytest.approx(0.0)


def test_leading_with_prefetch_1_leaves_the_copy_engine_idle_under_the_residents():
    """8 blocks, 4 resident, compute 1 s, copy 2 s: the bound is max(8, 4 x 2) = 8 s.

    leading, prefetch 1 (2 slots): the last block of a step prefetches only the first streamed block (4) of the
    next, during blocks 6-7. Blocks 0-3 compute [0, 4) while the engine is idle from 1; copy 5 may start only once
    block 7 of the last step freed its slot (0) and the engine is free (1): [1, 3); block 4 [4, 5); copy 6 waits
    for block 4's slot: [5, 7); block 5 [5, 6), block 6 [7, 8); copy 7 waits for block 5 (6) and the engine (7):
    [7, 9); block 7 [9, 10); copy 4 of the next step [9, 11), as the last one. Step: 10 s, 1.25 x the bound.
    strided puts streamed blocks 1, 3, 5, 7 between residents: each copy has 2 s of compute in front of it.
    """
    c = costs(8, 2.0, 1.0)
    leading = tm.predict(c, UNIT, 4, "leading", 1)
    assert leading.step_s == pytest.approx(10.0) and leading.ratio == pytest.approx(1.25)
    assert leading.copy_idle_s == pytest.approx(2.0) and leading.compute_stall_s == pytest.approx(2.0)
    assert tm.predict(c, UNIT, 4, "strided", 1).step_s == pytest.approx(8.0)
    assert tm.predict(c, UNIT, 4, "leading", 2).step_s == pytest.approx(8.0)  # a third slot holds copy 5 early
    policy, prefetch, prediction = tm.best_setting(c, UNIT, 4)
    assert (policy, prefetch) == ("strided", 1) and prediction.ratio == pytest.approx(1.0)


def test_lora_on_a_stream_of_its_own_never_delays_the_next_copy():
    """Copy 2 s + LoRA 1 s per block, compute 1 s. The backend queues the LoRA on a stream of its own after the
    copy's bytes are in: the copy engine runs the copies back to back and the step is the copy bound (on the copy
    stream, as before, the engine got each slot 3 s apart: 18 s)."""
    c = costs(6, 2.0, 1.0, lora_bytes=(1.0,) * 6)
    p = tm.predict(c, UNIT, 0)
    assert p.step_s == pytest.approx(12.0, rel=1e-3) and p.bound_s == pytest.approx(12.0)
    kernels = [op for op in p.trace.forward_ops(2) if op[0] == "kernel" and op[2] == "transform"]
    assert len(kernels) == 6 and len({op[1] for op in kernels}) == 1 and not {op[1] for op in kernels} & {
        "copy", "compute"}


def test_host_time_bounds_the_step_when_the_gpu_is_fast():
    c = costs(4, 1e-3, 1e-3, host_s_per_streamed_block=1.0)
    p = tm.predict(c, UNIT, 0)
    assert p.step_s >= 4.0 and p.host_s == pytest.approx(4.0)


def test_the_trace_is_the_managers_order():
    """In a steady forward each streamed block is copied once on the copy stream, the compute stream waits for
    that copy's event before the block's kernel, and residents are not copied again."""
    trace = tm.record_schedule(7, 3, "strided", 1, fresh=True)
    ops = trace.forward_ops(2)
    copies = [op for op in ops if op[0] == "copy"]
    assert sorted(op[2] for op in copies) == list(trace.streamed_blocks)
    assert {op[1] for op in copies} == {"copy"} and all(op[3] == 1.0 for op in copies)
    done, last_copied, waited, forward = {}, None, set(), -1
    for op in trace.ops:  # the latest copy of each block, its done event, and the compute stream's waits
        if op[0] == "forward":
            forward = op[1]
        elif op[0] == "copy":
            last_copied = op[2]
        elif op[0] == "record" and op[1] == "copy" and last_copied is not None:
            done[last_copied], last_copied = op[2], None
        elif op[0] == "wait" and op[1] == "compute":
            waited.add(op[2])
        elif op[0] == "kernel" and op[2] == "block" and op[3] in trace.streamed_blocks and forward >= 1:
            assert done[op[3]] in waited, f"block {op[3]} ran without the compute stream waiting for its copy"


def _normalized(trace, k):
    names = {}
    out = []
    for op in trace.forward_ops(k):
        if op[0] in ("record", "wait"):
            out.append((op[0], op[1], names.setdefault(op[2], len(names))))
        elif op[0] == "host_event":
            out.append((op[0], names.setdefault(op[1], len(names))))
        else:
            out.append(op)
    return out


@pytest.mark.parametrize("resident, policy, prefetch, transform", [(0, "leading", 1, False), (4, "strided", 2, True),
                                                                   (6, "leading", 3, False)])
def test_a_replanned_manager_records_what_a_fresh_one_does(resident, policy, prefetch, transform):
    tm.record_schedule(9, 2, "leading", 1)  # the kept manager has run another plan first
    kept = tm.record_schedule(9, resident, policy, prefetch, transform)
    fresh = tm.record_schedule(9, resident, policy, prefetch, transform, fresh=True)
    assert kept.resident == fresh.resident
    assert _normalized(kept, 2) == _normalized(fresh, 2)


@pytest.fixture
def fresh_recordings():
    tm.clear_recordings()
    yield
    tm.clear_recordings()


def test_a_backend_that_copies_on_the_compute_stream_is_timed_as_serial(monkeypatch, fresh_recordings):
    """The model reads the schedule from the code: a backend that queued its copies on the compute stream would
    serialise copy and compute, and the prediction says so."""
    c = costs(6, 2.0, 1.0)
    overlapped = tm.predict(c, UNIT, 0)

    def copy_on_the_compute_stream(self, dst, src, after=None, then=None):
        dst.copy_(src, non_blocking=True)
        done = self._event()
        done.record(self.module.current_stream(self.device))
        return device_backend.CopyHandle(done)

    monkeypatch.setattr(device_backend.StreamBackend, "copy", copy_on_the_compute_stream)
    tm.clear_recordings()
    serial = tm.predict(c, UNIT, 0)
    assert overlapped.step_s == pytest.approx(12.0)
    assert serial.step_s == pytest.approx(18.0)  # 6 x (copy 2 + compute 1)
    assert {op[1] for op in serial.trace.ops if op[0] == "copy"} == {"compute"}


def test_a_changed_residency_choice_changes_the_trace(monkeypatch, fresh_recordings):
    from layerwise_offload.offload import schedule as schedule_module

    before = tm.record_schedule(8, 4, "leading", 1)
    trailing = lambda n, r, policy: tuple(i >= n - r for i in range(n))  # noqa: E731
    monkeypatch.setattr(schedule_module, "choose_resident_blocks", trailing)  # where Schedule.for_config looks
    tm.clear_recordings()
    after = tm.record_schedule(8, 4, "leading", 1)
    assert before.resident == (True,) * 4 + (False,) * 4 and after.resident == (False,) * 4 + (True,) * 4
    assert sorted(op[2] for op in after.forward_ops(2) if op[0] == "copy") == [0, 1, 2, 3]


def test_the_timeline_of_the_last_forward():
    """Per-block spans from the end of the forward before's last block (what a GPU run's CUDA events measure)."""
    resident = tm.predict(costs(4, 2.0, 1.0), UNIT, 4)
    assert [t for span in resident.block_spans for t in span] == pytest.approx([0, 1, 1, 2, 2, 3, 3, 4])
    assert resident.copy_spans == ()
    streamed = tm.predict(costs(4, 2.0, 1.0), UNIT, 0)  # copy-bound: each block waits for its copy
    for (start, end), (next_start, _) in zip(streamed.block_spans, streamed.block_spans[1:]):
        assert end - start == pytest.approx(1.0) and next_start >= end
    assert streamed.block_spans[-1][1] == pytest.approx(streamed.step_s)  # no outside work: the step ends there
    for block, (start, _) in enumerate(streamed.block_spans):  # each block's copy ends before its kernels start
        assert any(b == block and e <= start + 1e-9 for b, _, e in streamed.copy_spans)
    assert min(e for _, _, e in streamed.copy_spans) < 0  # block 0's copy: queued at the end of the forward before

def test_steady_state_two_and_three_forwards_agree():
    c = dataclasses.replace(costs(10, 3.0, 1.0), block_flops=tuple(float(1 + i % 3) for i in range(10)))
    for resident, policy, prefetch in [(0, "leading", 1), (3, "leading", 1), (5, "strided", 2)]:
        three = tm.record_schedule(10, resident, policy, prefetch, fresh=True)
        four = tm.record_schedule(10, resident, policy, prefetch, forwards=4, fresh=True)
        assert tm.simulate(three, c, UNIT).step_s == pytest.approx(tm.simulate(four, c, UNIT).step_s)


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="block_flops"):
        tm.ModelCosts((1, 2), (1.0,))
    with pytest.raises(ValueError, match="costs"):
        tm.simulate(tm.record_schedule(3, 0), costs(4, 1.0, 1.0), UNIT)
    with pytest.raises(ValueError, match="forwards"):
        tm.record_schedule(3, 0, forwards=1)


def test_reference_gpus_say_where_their_figures_come_from():
    assert len(tm.GPUS) == 4
    for gpu in tm.GPUS.values():
        assert gpu.source and gpu.h2d_bytes_per_s > 1e10 and gpu.matmul_flops_per_s > 1e13


def test_choose_plan_picks_a_setting_at_the_bound_where_leading_misses_it():
    """Copies twice as long as compute with half the blocks resident: leading with prefetch 1 leaves the copy engine
    idle while the residents compute; the choice (what residency_policy auto runs) overlaps them."""
    gpu = tm.GPUS["H200 141GB"]
    n, resident = 16, 8
    c = tm.ModelCosts(tuple([600 * 10**6] * n), tuple([gpu.dit_flops_per_s * 5e-3] * n))
    assert tm.predict(c, gpu, resident, "leading", 1).ratio > 1.1
    choice = pc.choose_plan(c, gpu, [(policy, prefetch, resident) for policy, prefetch in tm.SETTINGS])
    assert choice.prediction.ratio <= 1.05
    fastest = min(tm.predict(c, gpu, resident, p, k).step_s for p, k in tm.SETTINGS)
    assert choice.prediction.step_s <= fastest * pc.CLOSE_STEP
    # Of the plans as fast as it, none holds fewer device bytes.
    for policy, prefetch in tm.SETTINGS:
        other = pc.choose_plan(c, gpu, [(policy, prefetch, resident)])
        if other.prediction.step_s <= fastest * pc.CLOSE_STEP:
            assert choice.device_bytes <= other.device_bytes


def test_choose_plan_takes_a_deeper_ring_where_the_big_blocks_lead():
    """Flux's shape in small (8 blocks of 680 MB, then 16 of 283 MB, each 2.36 ms on an H200) with 13 resident:
    leading keeps the big blocks but a ring of up to 5 slots cannot take the copies of the residents' whole
    stretch (the fastest such plan is over 1.1x its bound); strided reaches its own bound but keeps small blocks
    and streams more bytes, so it is slower still. A deeper leading ring is faster than both and at its bound."""
    gpu = tm.GPUS["H200 141GB"]
    big, small, resident = 8, 16, 13
    c = tm.ModelCosts(tuple([680 * 10**6] * big + [283 * 10**6] * small),
                      tuple([gpu.dit_flops_per_s * 2.36e-3] * (big + small)))
    shallow = [tm.predict(c, gpu, resident, p, k) for p, k in tm.SETTINGS if k <= 4]
    assert min(shallow, key=lambda p: p.step_s).ratio > 1.1
    choice = pc.choose_plan(c, gpu, [(policy, prefetch, resident) for policy, prefetch in tm.SETTINGS])
    assert choice.policy == "leading" and choice.prefetch > 4
    assert choice.prediction.ratio <= 1.05
    assert choice.prediction.step_s < min(p.step_s for p in shallow)


def test_block_flops_counts_linear_weights_and_attention():
    from torch import nn
    block = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    tokens, batch = 10, 2
    assert pc.block_flops(block, tokens, batch) == batch * (2.0 * 2 * 64 * 256 * tokens + 4.0 * tokens**2 * 64)


def test_gpu_for_a_named_reference_card_and_none_for_the_cpu(monkeypatch):
    monkeypatch.delenv(pc.TIMING_GPU_ENV, raising=False)
    assert pc.gpu_for("cpu") is None
    monkeypatch.setenv(pc.TIMING_GPU_ENV, "RTX 4090 24GB")
    assert pc.gpu_for("cpu") is tm.GPUS["RTX 4090 24GB"]
    monkeypatch.setenv(pc.TIMING_GPU_ENV, "RTX 9999")
    with pytest.raises(ValueError, match="RTX 9999.*not a reference GPU.*RTX 4090 24GB"):
        pc.gpu_for("cpu")
