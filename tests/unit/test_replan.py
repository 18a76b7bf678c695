"""A replan that changes only the resident set moves only the blocks whose membership changed (issue 28 item 2).

Residents that stay keep their device buffer and views (never copied again, never written), blocks that leave the
set are released and their buffer freed, blocks that join it are copied in by the next forward; the slot ring is
kept unless its geometry changes. Counted by ``stats().resident_copies``; the output stays bitwise.
"""

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, apply_layerwise_offload, choose_resident_blocks
from layerwise_offload.tests.cuda_standin import overlaps
from layerwise_offload.tests.stream_checks import run_checked

NUM_BLOCKS = 7


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def want(x):
    with torch.no_grad():
        return ToyTransformer()(x)


def residents(count, policy):
    return {i for i, keep in enumerate(choose_resident_blocks(NUM_BLOCKS, count, policy)) if keep}


def resident_pointers(model, manager):
    """Each resident's device buffer and where its parameters point."""
    blocks = model.blocks_in_call_order()
    return {i: (buffer.data_ptr(), tuple(p.data_ptr() for p in blocks[i].parameters()))
            for i, buffer in manager.engine.device_memory.residents.items()}


@pytest.mark.parametrize("policy", ["leading", "strided"])
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("start", [0, 1, 3, 6])
def test_a_replan_by_one_copies_only_the_blocks_that_join(x, want, policy, prefetch, start):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=start,
                                      prefetch_size=prefetch, policy=policy)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
        for count in (start + 1, start, start - 1, start + 1):  # up by one, back, below, up by two
            if not 0 <= count <= NUM_BLOCKS:
                continue
            old, new = residents(manager.config.resident_count(manager.num_blocks), policy), residents(count, policy)
            kept = {i: where for i, where in resident_pointers(model, manager).items() if i in new}
            copies = manager.stats().resident_copies
            manager.replan(resident_layers=count)
            assert set(manager.engine.device_memory.residents) == old & new  # the leavers' buffers are freed now
            for _ in range(2):
                assert torch.equal(model(x), want)
            assert manager.stats().resident_copies - copies == len(new - old)
            assert set(manager.engine.device_memory.residents) == new == set(manager.schedule.resident_blocks)
            now = resident_pointers(model, manager)
            assert all(now[i] == where for i, where in kept.items())  # same buffer, same views
            assert manager.device_bytes() == manager.device_bytes(manager.config)
    if policy == "leading":  # one block's worth: r -> r+1 copies exactly one, r -> r-1 none
        assert len(residents(start + 1, policy) - residents(start, policy)) <= 1
    manager.detach()


def test_the_figures_plus_one_copies_one_block_minus_one_copies_none(x, want):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=3)
    with torch.no_grad():
        model(x)
        before = manager.stats()
        manager.replan(resident_layers=4)
        assert torch.equal(model(x), want)
        up = manager.stats()
        manager.replan(resident_layers=3)
        assert torch.equal(model(x), want)
        down = manager.stats()
    assert before.resident_copies == 3
    assert up.resident_copies - before.resident_copies == 1
    assert down.resident_copies - up.resident_copies == 0
    assert down.copies_last_forward == 4  # block 3 streams again: copied with the others, as any streamed block
    manager.detach()


def test_the_slot_ring_is_kept_unless_its_geometry_changes(x, want):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2,
                                      prefetch_size=1)
    sizes = manager.block_nbytes()
    with torch.no_grad():
        model(x)
        slots = [s.data_ptr() for s in manager.engine.device_memory.slots]
        manager.replan(resident_layers=3)
        same = max(sizes[3:]) == max(sizes[2:])
        assert ([s.data_ptr() for s in manager.engine.device_memory.slots] == slots) == same
        assert torch.equal(model(x), want)
        manager.replan(resident_layers=NUM_BLOCKS)  # nothing streams: no ring
        assert manager.engine.device_memory.slots == []
        assert torch.equal(model(x), want)
        assert manager.device_bytes() == sum(sizes)
        manager.replan(resident_layers=5)  # a ring again, the five residents untouched
        assert set(manager.engine.device_memory.residents) == set(range(5))
        assert torch.equal(model(x), want)
        assert manager.device_bytes() == manager.device_bytes(manager.config)
    manager.detach()


def test_other_settings_still_release_everything(x, want):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=3)
    with torch.no_grad():
        model(x)
        manager.replan(resident_layers=4, prefetch_size=2)
        assert manager.device_bytes() == 0 and not manager.materialized_blocks()
        assert torch.equal(model(x), want)
        assert manager.stats().resident_copies == 3 + 4
    manager.detach()


def test_a_replan_then_a_repack_starts_from_nothing(x, want):
    """A replan leaves the kept residents for the next arming; a repack before it must not reuse them blindly."""
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=3,
                                      released_params="host")  # a repack reads the released blocks' parameters
    with torch.no_grad():
        model(x)
        manager.replan(resident_layers=2)
        assert manager.device_bytes() > 0 and not manager.armed
        manager.prepare(repack=[1])
        assert manager.device_bytes() == 0 and not manager.materialized_blocks()
        assert torch.equal(model(x), want)
    manager.detach()


def test_pinning_follows_a_replan_block_by_block(x, want):
    """The blocks that leave the resident set are page-locked, the ones that join it unlocked, nothing else."""

    class Pinner:
        def __init__(self):
            self.log = []

        def register(self, tensor):
            self.log.append(("lock", tensor.data_ptr()))
            return True

        def unregister(self, tensor):
            self.log.append(("unlock", tensor.data_ptr()))

    pinner = Pinner()
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=3,
                                      pin_memory=True, environment=HostEnvironment(
                                          pinner=pinner, available_host_bytes=lambda: 2**40))
    with torch.no_grad():
        model(x)
        assert manager.store.pinned == [False] * 3 + [True] * 4
        for count, changed in ((4, 3), (2, (2, 3))):
            pinner.log.clear()
            manager.replan(resident_layers=count)
            assert torch.equal(model(x), want)
            assert manager.store.pinned == [False] * count + [True] * (NUM_BLOCKS - count)
            changed = changed if isinstance(changed, tuple) else (changed,)
            buffers = {manager.store.buffers[i].data_ptr() for i in changed}
            assert {ptr for _, ptr in pinner.log if ptr in {b.data_ptr() for b in manager.store.buffers}} == buffers
    manager.detach()


@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("policy, prefetch, counts", [
    ("leading", 1, (2, 3, 2, 1, 7, 0)), ("strided", 2, (3, 4, 2, 5)), ("leading", 2, (0, 1, 0, 4, 3))])
@pytest.mark.parametrize("transform", [False, True])
def test_replans_under_the_stream_checker_never_write_a_kept_resident(policy, prefetch, counts, pinning, transform):
    """The CUDA stand-in's checks (tests/stream_checks.py), a replan before each forward but the first, with the host
    ahead (what leaves the plan is freed while copies for the next forward may be in flight): no block reads before
    its copy, no copy overwrites a pending read, no memory is freed under a stream, and no copy or transform writes
    a kept resident."""
    snapshots = []  # after each replan: (copies so far, transforms so far, {kept resident: its memory})

    def replan(k, manager, checked):
        if k == 0:
            return
        count = counts[k % len(counts)]
        manager.replan(resident_layers=count)
        kept = {i: (b.data_ptr(), b.data_ptr() + b.numel()) for i, b in manager.engine.device_memory.residents.items()}
        assert set(kept) <= residents(count, policy)
        snapshots.append((len(checked.cuda.uploads), len(checked.transforms), kept))

    checked = run_checked(counts[0], prefetch, policy, None, pinning, transform=transform, before=replan,
                          forwards=len(counts) + 1)
    uploads, transforms = checked.cuda.uploads, checked.transforms
    end = (len(uploads), len(transforms), {})
    assert any(kept for _, _, kept in snapshots)
    for j, (copies, transformed, kept) in enumerate(snapshots):
        for index, span in kept.items():
            # Its memory is its own until the first later replan that lets it go (then it may be reused).
            until = next(s for s in snapshots[j + 1:] + [end] if s[2].get(index) != span)
            for number in range(copies, until[0]):
                assert not overlaps(uploads[number].dst, span), f"copy #{number} wrote kept resident {index}"
            for _, written, _ in transforms[transformed:until[1]]:
                assert not overlaps(written, span), f"a transform wrote kept resident {index}"
    checked.manager.detach()
