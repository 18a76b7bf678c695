"""Streamed tails (``streamed_tail_bytes``): a streamed block keeps its head on the device and streams only its
tail, on the CPU loopback. Bitwise against the model alone, the footprint the planner computes is what is held,
only the tails move at each step, a transform patches every weight exactly once, replans move only what changed."""

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import (HostEnvironment, LayerwiseOffloadManager, apply_layerwise_offload, footprint,
                                       plan_residency, plan_streamed_tails)
from layerwise_offload.offload.host.packing import plan_layout, block_parameters
from layerwise_offload.offload.schedule import tail_within

NUM_BLOCKS = 7


@pytest.fixture(scope="module")
def sample_input():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def reference_output(x):
    with torch.no_grad():
        return ToyTransformer()(x)


def offloaded(**settings):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, **settings)
    return model, manager


def layouts():
    return [plan_layout(block_parameters(b)) for b in ToyTransformer().blocks_in_call_order()]


def test_tail_sizes_begin_at_entries_and_end_with_the_whole_block():
    for layout in layouts():
        sizes = layout.tail_sizes
        assert sizes == tuple(sorted(sizes)) and sizes[-1] == layout.nbytes
        starts = {entry.offset for entry in layout.entries}
        assert all(layout.nbytes - size in starts for size in sizes)
        assert len(sizes) == len(layout.entries)  # plain weights: every entry can begin the tail
        assert layout.tail_bytes(0) == layout.nbytes
        assert layout.tail_bytes(1) == sizes[0]  # below the smallest tail: still the last weight
        for size in sizes:
            assert layout.tail_bytes(size) == size and layout.tail_bytes(size + 1) == size
            assert tail_within(sizes, size) == size


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("resident", [0, 2, 5])
@pytest.mark.parametrize("policy", ["leading", "strided"])
@pytest.mark.parametrize("cap_index", [0, 2, 4])
def test_output_is_bitwise_identical_and_only_tails_move(sample_input, resident, prefetch, policy, cap_index):
    cap = sorted({s for layout in layouts() for s in layout.tail_sizes})[cap_index]
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=resident, prefetch_size=prefetch, policy=policy,
                               streamed_tail_bytes=cap)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(sample_input), want)
    sizes, tails = manager.block_nbytes(), manager.block_tails()
    schedule = manager.schedule
    plan = footprint(sizes, schedule.resident, prefetch, tails)
    assert manager.device_bytes() == manager.device_bytes(manager.config) == plan.total
    stats = manager.stats()
    assert stats.head_bytes == plan.head_bytes == sum(sizes[i] - tails[i] for i in schedule.streamed_blocks) > 0
    streamed_copies = 1 if NUM_BLOCKS - resident > prefetch else 0
    assert stats.bytes_copied_last_forward == streamed_copies * sum(tails[i] for i in schedule.streamed_blocks)
    manager.release_all()
    assert manager.device_bytes() == 0 and not manager.engine.device_memory.heads
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)


def test_a_transform_patches_each_weight_once(sample_input):
    """A transform that is not idempotent (adds one) run on the head at arming and on the tail at each copy gives
    the same output as the same transform on whole blocks."""
    def add_one(index, weights):
        for weight in weights:
            if weight is not None:
                weight.add_(1.0)

    outputs = []
    for cap in (0, sorted(layouts()[0].tail_sizes)[2]):
        model, manager = offloaded(resident_layers=1, prefetch_size=1, streamed_tail_bytes=cap)
        manager.after_copy = add_one
        with torch.no_grad():
            outputs.append([model(sample_input) for _ in range(3)])
        manager.detach()
    for whole, split in zip(*outputs):
        assert torch.equal(whole, split)
    assert not torch.equal(outputs[0][0], reference_output(sample_input))


def test_a_residency_change_moves_only_the_blocks_it_changes(sample_input):
    want = reference_output(sample_input)
    cap = sorted(layouts()[0].tail_sizes)[2]
    model, manager = offloaded(resident_layers=2, streamed_tail_bytes=cap)
    with torch.no_grad():
        model(sample_input)
        heads = dict(manager.engine.device_memory.heads)
        copies = list(manager.engine.counters.copies_per_block)
        manager.replan(resident_layers=3)  # block 2 joins the residents: its head goes, no other head moves
        model(sample_input)
        assert torch.equal(model(sample_input), want)
    kept = manager.engine.device_memory.heads
    assert set(kept) == set(heads) - {2}
    assert all(kept[i] is heads[i] for i in kept)
    moved = [after - before for after, before in zip(manager.engine.counters.copies_per_block, copies)]
    assert moved[0] == moved[1] == 0 and moved[2] == 1  # the residents stay; block 2 copied once, whole

    bigger = sorted(layouts()[0].tail_sizes)[4]
    manager.replan(streamed_tail_bytes=bigger)  # every split moves: the heads are copied again, once
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
        assert torch.equal(model(sample_input), want)
    assert manager.device_bytes() == manager.device_bytes(manager.config)
    manager.replan(streamed_tail_bytes=0)  # whole blocks again: no head left
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
    assert not manager.engine.device_memory.heads and manager.device_bytes() == manager.device_bytes(manager.config)


def test_planner_streams_fewer_bytes_than_whole_blocks_in_the_same_budget():
    sizes = [layout.nbytes for layout in layouts()]
    options = [layout.tail_sizes for layout in layouts()]
    total = sum(sizes)
    wins = 0
    for fraction in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        free = int(total * fraction)
        whole = min((plan_residency(sizes, free, policy=p) for p in ("leading", "strided")),
                    key=lambda plan: plan.streamed_bytes)
        split = plan_streamed_tails(sizes, options, free)
        if split is None:
            continue
        assert split.fits and split.device_bytes <= free
        assert all(t in o for t, o in zip(split.tails, options))
        assert footprint(sizes, (False,) * len(sizes), 1, split.tails).total == split.device_bytes
        assert split.streamed_bytes == sum(split.tails)
        wins += split.streamed_bytes < whole.streamed_bytes
    assert wins >= 4


def test_a_planned_split_is_what_the_manager_holds(sample_input):
    model, manager = offloaded(resident_layers=0)
    sizes, options = manager.block_nbytes(), manager.tail_options()
    plan = plan_streamed_tails(sizes, options, int(sum(sizes) * 0.7))
    manager.replan(streamed_tail_bytes=plan.tails)
    with torch.no_grad():
        for _ in range(2):  # the first copies the heads too
            assert torch.equal(model(sample_input), reference_output(sample_input))
    assert manager.block_tails() == list(plan.tails)
    assert manager.device_bytes() == plan.device_bytes
    assert manager.stats().bytes_copied_last_forward == plan.streamed_bytes


def test_a_block_on_disk_streams_whole(tmp_path, sample_input):
    """The disk tier reads whole blocks: a block on disk has no head, its tail is the block."""
    want = reference_output(sample_input)
    model = ToyTransformer()
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=0, prefetch_size=1,
                                      host_store="disk", streamed_tail_bytes=1, environment=HostEnvironment(
                                          disk_folder=str(tmp_path), available_host_bytes=lambda: 2**40))
    manager.attach(model)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(sample_input), want)
    assert manager.stats().disk_blocks == NUM_BLOCKS
    assert manager.block_tails() == manager.block_nbytes() and not manager.engine.device_memory.heads
    manager.detach()


def test_streamed_tail_bytes_is_checked():
    with pytest.raises(ValueError, match="streamed_tail_bytes must be an integer >= 0"):
        offloaded(streamed_tail_bytes=-1)
    with pytest.raises(ValueError, match="streamed_tail_bytes"):
        offloaded(streamed_tail_bytes=1.5)
    with pytest.raises(ValueError, match="streamed_tail_bytes has 2 caps for 7 blocks"):
        offloaded(streamed_tail_bytes=(1, 2))


def small_cap():
    return sorted(layouts()[0].tail_sizes)[2]


def test_an_interrupted_forward_leaves_nothing_held_after_release(sample_input):
    """KeyboardInterrupt in the middle of a step (ComfyUI's cancel): the next run is bitwise, and releasing frees
    every device byte, heads included; detach gives the blocks back whole."""
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=1, streamed_tail_bytes=small_cap())
    calls = 0

    def interrupt(module, args):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
    handle = model.blocks_in_call_order()[4].register_forward_pre_hook(interrupt)
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
        with pytest.raises(KeyboardInterrupt):
            model(sample_input)
        handle.remove()
        assert torch.equal(model(sample_input), want)
    assert manager.engine.device_memory.heads
    manager.release_all()
    assert manager.device_bytes() == 0 and not manager.engine.device_memory.heads
    manager.detach()
    assert all(p.numel() > 0 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)


def test_outside_the_hooks_a_released_block_reads_its_host_copy(sample_input):
    """released_params = host: code that runs the blocks without the hooks (a sibling clone in ComfyUI) sees whole
    weights, never a head without its tail."""
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=0, streamed_tail_bytes=small_cap(), released_params="host")
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
        manager.engine.hooks.active = False
        assert torch.equal(model(sample_input), want)
        manager.engine.hooks.active = True
        assert torch.equal(model(sample_input), want)


def test_two_models_alternating_keep_their_own_heads(sample_input):
    """Two managed models taking turns (Wan 2.2's experts): each keeps its heads and streams its tails, bitwise."""
    other_input = sample_input * 0.5
    first, first_manager = offloaded(resident_layers=0, streamed_tail_bytes=small_cap())
    second, second_manager = offloaded(resident_layers=2, streamed_tail_bytes=small_cap())
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(first(sample_input), reference_output(sample_input))
            assert torch.equal(second(other_input), reference_output(other_input))
    assert first_manager.engine.device_memory.heads and second_manager.engine.device_memory.heads
    assert not set(map(id, first_manager.engine.device_memory.heads.values())) & set(
        map(id, second_manager.engine.device_memory.heads.values()))
