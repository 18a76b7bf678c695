"""The CUDA stream/event logic (StreamBackend) checked for data races without a GPU.

The real manager and StreamBackend run over the CUDA stand-in (tests/cuda_standin.py): streams run in simulated
time with the host far ahead, events complete only when their stream passes them, and vector clocks keep CUDA's
happens-before order, so every kernel's read of a block's device memory must come after the copy (and the
after-copy transform) that wrote it, and every copy into device memory after the reads of what it overwrites; a
fault raises where it happens. Copies and kernels still run for real (on the CPU), so the output is checked
bitwise as well. The checks beyond CUDA's rules (no copy issued into a running block, the transform on its own
stream, the copy stream never waiting for it) are tests/stream_checks.py's.
"""

import pytest

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload.device.backend import StreamBackend
from layerwise_offload.tests.cuda_standin import CudaRuleBroken
from layerwise_offload.tests.stream_checks import run_checked

REVERSED = [6, 5, 4, 3, 2, 1, 0]
SCENARIOS = [
    (0, 1, "leading", None), (0, 2, "strided", None), (2, 1, "leading", None), (3, 3, "strided", None),
    (1, 1, "leading", [0, 2, 4, 6]), (2, 2, "leading", REVERSED), (0, 1, "leading", [0, 1, 1, 2, 5, 3]),
]


@pytest.mark.parametrize("pinning", ["pinned", "pageable", "mixed"])
@pytest.mark.parametrize("resident, prefetch, policy, order", SCENARIOS)
def test_no_block_reads_before_its_copy_and_no_copy_overwrites_a_pending_read(resident, prefetch, policy, order,
                                                                              pinning):
    checked = run_checked(resident, prefetch, policy, order, pinning)
    manager, cuda = checked.manager, checked.cuda
    residents = set(manager.schedule.resident_blocks)  # copied once when the plan is armed
    if pinning != "pageable":  # through the bounce ring where the pinner grants it (offload/device/resident_copy.py)
        assert all(pinned for block, _, _, pinned in checked.issued if block in residents) or pinning == "mixed"
    if pinning == "pinned":
        assert not cuda.pageable_async, "a non_blocking copy from pageable memory (CUDA makes it synchronous)"
    for block, phase, hook_block, pinned in checked.issued:
        if phase == "pre" and block != hook_block and block not in residents:  # a prefetch
            assert pinned, f"a copy of block {block} from pageable memory was issued before block {hook_block} ran"
    kinds = {(phase, pinned) for block, phase, _, pinned in checked.issued if block not in residents}
    if pinning == "pageable":
        assert ("post", False) in kinds and ("pre", True) not in kinds
    if pinning == "pinned" and order is None:
        assert ("pre", True) in kinds and ("post", True) not in kinds


@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("resident, prefetch, policy, order", SCENARIOS[:4] + SCENARIOS[5:6])
def test_an_after_copy_transform_runs_on_its_own_stream_before_the_block_reads(resident, prefetch, policy,
                                                                               order, pinning):
    """A LoRA applied on the device: ordered after the copy, before the reads, never twice (the host keeps the
    untransformed weights, so three forwards give the same output as the halved reference)."""
    checked = run_checked(resident, prefetch, policy, order, pinning, transform=True)
    assert len(checked.transforms) == len(checked.cuda.uploads)  # once per copy, residents included
    assert {stream for _, _, stream in checked.transforms} == {"transform"}


class TransformAfterTheEvent(StreamBackend):
    """The transform queued outside what the copy's handle covers: the compute stream would not wait for it."""

    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after)
        if then is not None:
            if self.transform_stream is None:
                self.transform_stream = self.module.Stream()
            with self.module.stream(self.transform_stream):
                self.transform_stream.wait_event(handle.done)
                then()
        return handle


class TransformOnTheCopyStream(StreamBackend):
    """The older order: the transform on the copy stream before the copy's event (the next copy waits behind it)."""

    def copy(self, dst, src, after=None, then=None):
        def on_the_copy_stream():
            with self.module.stream(self.copy_stream):
                then()
        return super().copy(dst, src, after, on_the_copy_stream if then is not None else None)


class TransformOnTheComputeStream(StreamBackend):
    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after)
        if then is not None:
            then()
        return handle


@pytest.mark.parametrize("broken, fault, message", [
    # CUDA's rules: a block's kernels read what the transform may still be writing ...
    (TransformAfterTheEvent, CudaRuleBroken,
     "on the compute stream may read the manager's device memory that aten.mul_.Tensor on the transform stream "
     "may still write: no event orders them"),
    # ... or the transform writes what the copy may still be writing.
    (TransformOnTheComputeStream, CudaRuleBroken,
     "aten.mul_.Tensor on the compute stream may write the manager's device memory that a copy to the device on "
     "the copy stream may still write: no event orders them"),
    # Ordered, but the copy stream queues the next copy behind the LoRA math: the checker's own rule.
    (TransformOnTheCopyStream, AssertionError, "transform ran on the copy stream"),
])
def test_the_checker_catches_a_misordered_transform(broken, fault, message):
    with pytest.raises(fault, match=message) as caught:
        run_checked(0, 1, "leading", None, "pinned", backend_class=broken, transform=True)
    assert fault is CudaRuleBroken or not isinstance(caught.value, CudaRuleBroken)


class NoSlotWait(StreamBackend):
    def copy(self, dst, src, after=None, then=None):
        return super().copy(dst, src, after=None, then=then)


class NoComputeWait(StreamBackend):
    def wait_for_copy(self, handle):
        pass


@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("broken, message", [
    (NoSlotWait, "a copy to the device on the copy stream may write the manager's device memory that aten.* on "
                 "the compute stream may still read: no event orders them"),
    (NoComputeWait, "on the compute stream may read the manager's device memory that a copy to the device on the "
                    "copy stream may still write: no event orders them"),
])
def test_the_checker_catches_a_missing_wait(pinning, broken, message):
    """Without the copy stream's wait for the slot's last reader, or the compute stream's wait for the copy, it
    fails; from pageable memory too (CUDA returns once the source is staged, not once the copy is done)."""
    with pytest.raises(CudaRuleBroken, match=message):
        run_checked(0, 1, "leading", None, pinning, backend_class=broken)


def tail_cap():
    from layerwise_offload.offload.host.packing import block_parameters, plan_layout
    return plan_layout(block_parameters(ToyTransformer().blocks_in_call_order()[0])).tail_sizes[2]


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("resident, prefetch, policy, order", SCENARIOS[:4] + SCENARIOS[5:])
def test_streamed_tails_are_ordered_like_whole_blocks(resident, prefetch, policy, order, pinning, transform):
    """A streamed block that keeps its head reads two buffers: the head copied once at arming, the tail into its slot
    at every copy. No read before either copy (or its transform), no copy into either while the block runs."""
    checked = run_checked(resident, prefetch, policy, order, pinning, transform=transform, tails=tail_cap())
    manager = checked.manager
    streamed = manager.schedule.streamed_blocks
    assert set(manager.engine.device_memory.heads) == set(streamed)
    if transform:
        assert len(checked.transforms) == len(checked.cuda.uploads)  # heads and tails: each transformed once


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("resident, prefetch, policy, order", [(0, 1, "leading", None), (5, 2, "strided", None),
                                                               (3, 1, "leading", REVERSED)])
@pytest.mark.parametrize("tails", [0, 600])
def test_weight_units_are_ordered_like_blocks(resident, prefetch, policy, order, pinning, transform, tails):
    """Each module that owns weights streamed on its own (offload/units.py), whole or its tail (a Linear's bias): no
    unit reads before its copy or its transform, no copy lands in a unit's memory while it runs; the output after
    three forwards is the reference's (asserted by run_checked)."""
    checked = run_checked(resident, prefetch, policy, order, pinning, transform=transform, tails=tails, units=True)
    assert checked.manager.num_blocks == 3 * 7
    if transform:
        assert len(checked.transforms) == len(checked.cuda.uploads)


@pytest.mark.parametrize("regime, resident, prefetch, policy, order", [
    ("copy_bound", *SCENARIOS[1]), ("host_bound", *SCENARIOS[6])])
def test_other_regimes_keep_the_order(regime, resident, prefetch, policy, order):
    """The order does not depend on which of copy and compute is the slower, or on the device being done before
    the host asks (the stand-in's times differ, and with them what the host finds finished when it asks), with a
    transform and mixed page-locking."""
    run_checked(resident, prefetch, policy, order, "mixed", transform=True, regime=regime)


def test_a_prefetch_evicted_before_it_ran_is_not_overwritten_under_its_transform():
    """The reversed order contradicts the prefetch of the first forward: blocks copied in (and transformed on the
    transform stream) ahead of their run are evicted unrun, and the next copy into their slot must come after their
    transform as well as after the compute stream's last read. Before the fix it raised "a copy to the device on the
    copy stream may write the manager's device memory that aten.mul_.Tensor on the transform stream may still
    write"."""
    run_checked(2, 2, "leading", REVERSED, "pinned", transform=True)
