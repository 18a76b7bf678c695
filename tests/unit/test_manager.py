"""The offload engine on the CPU loopback: bitwise output, residency, bounds, release and detach."""

import logging

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager, apply_layerwise_offload

NUM_BLOCKS = 7  # ToyTransformer(): 3 double + 4 single


@pytest.fixture(scope="module")
def sample_input():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def reference_output(x, **model_changes):
    model = ToyTransformer()
    for key, value in model_changes.items():
        setattr(model, key, value)
    with torch.no_grad():
        return model(x)


def offloaded(**settings):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, **settings)
    return model, manager


def params_are_real(block):
    return all(p.numel() > 0 and p.device.type == "cpu" for p in block.parameters())


def check_invariant(model, manager):
    for index, block in enumerate(model.blocks_in_call_order()):
        assert params_are_real(block) == manager.points_at_device(index), (
            f"block {index}: real={params_are_real(block)} pointed={manager.points_at_device(index)}")
        assert manager.is_materialized(index) or not manager.points_at_device(index)


def watch_blocks(model, manager, record):
    """Hooks placed after the manager's, so they see the state each block actually runs with."""
    handles = []
    for index, block in enumerate(model.blocks_in_call_order()):
        def pre(module, args, index=index):
            assert params_are_real(module), f"block {index} runs with placeholder weights"
            record.append(len(manager.materialized_blocks()))
            check_invariant(model, manager)

        def post(module, args, output):
            check_invariant(model, manager)
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return handles


@pytest.mark.parametrize("policy", ["leading", "strided"])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("resident", range(NUM_BLOCKS + 1))
def test_output_is_bitwise_identical(sample_input, resident, prefetch, policy):
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=resident, prefetch_size=prefetch, policy=policy)
    materialized_counts = []
    watch_blocks(model, manager, materialized_counts)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(sample_input), want)
    bound = resident + prefetch + 1
    assert max(materialized_counts) <= bound
    assert manager.stats().peak_materialized_blocks <= bound
    assert manager.device_bytes() == manager.device_bytes(manager.config)


@pytest.mark.parametrize("policy", ["leading", "strided"])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
@pytest.mark.parametrize("resident", [0, 2, 5, NUM_BLOCKS])
def test_after_warmup_residents_copy_zero_times_and_streamed_once(sample_input, resident, prefetch, policy):
    model, manager = offloaded(resident_layers=resident, prefetch_size=prefetch, policy=policy)
    with torch.no_grad():
        model(sample_input)  # learns the call order
        model(sample_input)
        before = list(manager.engine.counters.copies_per_block)
        model(sample_input)
    copies = [after - b for after, b in zip(manager.engine.counters.copies_per_block, before)]
    resident_blocks = set(manager.schedule.resident_blocks)
    assert len(resident_blocks) == resident
    # Streamed blocks that all fit in the slots at once (no more than prefetch_size) stay there.
    streamed_copies = 1 if NUM_BLOCKS - resident > prefetch else 0
    for index, count in enumerate(copies):
        assert count == (0 if index in resident_blocks else streamed_copies), f"block {index} copied {count} times"
    sizes = manager.block_nbytes()
    stats = manager.stats()
    assert stats.bytes_copied_last_forward == streamed_copies * sum(sizes[i] for i in manager.schedule.streamed_blocks)
    assert stats.copies_last_forward == streamed_copies * (NUM_BLOCKS - resident)
    assert stats.demand_copies <= 1  # only the very first streamed block of the very first forward


def test_residents_stay_until_released(sample_input):
    model, manager = offloaded(resident_layers=3)
    with torch.no_grad():
        model(sample_input)
        model(sample_input)
    assert manager.materialized_blocks()[:3] == [0, 1, 2]
    assert manager.stats().resident_bytes == sum(manager.block_nbytes()[:3])
    manager.release_all()
    assert not manager.is_materialized(1) and manager.stats().resident_bytes == 0
    check_invariant(model, manager)
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))
    assert manager.is_materialized(1)


def test_strided_policy_spreads_streamed_blocks(sample_input):
    model, manager = offloaded(resident_layers=4, policy="strided")
    with torch.no_grad():
        model(sample_input)
    assert manager.schedule.streamed_blocks == (1, 3, 5)


@pytest.mark.parametrize("pattern", ["skip", "reverse", "repeat", "skip_and_reverse"])
@pytest.mark.parametrize("resident", [0, 3])
def test_skips_and_reordering_keep_the_invariant(sample_input, pattern, resident):
    changes = {
        "skip": {"skip": {1, 4}},
        "reverse": {"order": list(reversed(range(NUM_BLOCKS)))},
        "repeat": {"order": [0, 1, 1, 2, 3, 3, 3, 4, 5, 6, 0]},
        "skip_and_reverse": {"order": [6, 4, 2, 0], "skip": {2}},
    }[pattern]
    want = reference_output(sample_input, **changes)
    model, manager = offloaded(resident_layers=resident, prefetch_size=2)
    for key, value in changes.items():
        setattr(model, key, value)
    counts = []
    watch_blocks(model, manager, counts)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(sample_input), want)
            check_invariant(model, manager)
    assert max(counts) <= resident + 2 + 1


def test_mixed_dtypes_and_strides_survive(sample_input):
    model, manager = offloaded(resident_layers=0)
    original = ToyTransformer()
    transposed = original.double_blocks[1].down.weight
    assert not transposed.is_contiguous()
    seen = {}

    def capture(module, args):
        seen["stride"] = module.down.weight.stride()
        seen["gate"] = module.gate.dtype
    model.double_blocks[1].register_forward_pre_hook(capture)
    with torch.no_grad():
        model(sample_input)
    assert seen == {"stride": transposed.stride(), "gate": torch.bfloat16}
    assert len({entry.dtype for entry in manager.store.layouts[1].entries}) == 2


def test_release_all_and_detach_leave_nothing_behind(sample_input):
    model, manager = offloaded(resident_layers=3, prefetch_size=2)
    params_before = {name: p for name, p in model.named_parameters()}
    with torch.no_grad():
        model(sample_input)
    manager.release_all()
    assert manager.materialized_blocks() == []
    assert manager.device_bytes() == 0
    assert not manager.armed
    check_invariant(model, manager)
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))
    manager.detach()
    assert not manager.engine.hooks.installed
    assert manager.store is None and manager.device_bytes() == 0
    for block in model.blocks_in_call_order():
        assert not block._forward_pre_hooks and not block._forward_hooks
    assert not model._forward_pre_hooks and not model._forward_hooks
    # Same parameter objects, ordinary tensors, the original values.
    reference = dict(ToyTransformer().named_parameters())
    for name, param in model.named_parameters():
        assert param is params_before[name]
        assert torch.equal(param, reference[name]) and param.stride() == reference[name].stride()
        assert param.untyped_storage().nbytes() == reference[name].untyped_storage().nbytes()
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))


def test_replan_changes_the_plan_without_leaking(sample_input):
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=1)
    with torch.no_grad():
        model(sample_input)
        for resident, prefetch, policy in [(5, 1, "leading"), (2, 3, "strided"), (0, 1, "leading")]:
            kept, same_prefetch = set(manager.engine.device_memory.residents), prefetch == manager.config.prefetch_size
            manager.replan(resident_layers=resident, prefetch_size=prefetch, policy=policy)
            if same_prefetch:  # only the resident set changed: what stays stays, the rest is released
                assert set(manager.engine.device_memory.residents) == kept & set(range(resident))
            else:
                assert manager.device_bytes() == 0
            assert torch.equal(model(sample_input), want)
            assert len(manager.schedule.resident_blocks) == resident
            assert manager.device_bytes() == manager.device_bytes(manager.config)


def test_an_error_inside_a_block_releases_it(sample_input):
    model, manager = offloaded(resident_layers=2, prefetch_size=1)
    failing = model.single_blocks[0]  # block 3, streamed

    def explode(module, args):
        raise RuntimeError("boom")
    handle = failing.register_forward_pre_hook(explode)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(sample_input)
    check_invariant(model, manager)
    assert len(manager.materialized_blocks()) <= 2 + 1 + 1
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))
    manager.release_all()
    assert manager.device_bytes() == 0


def test_inference_mode_and_grad_mode(sample_input):
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=2)
    with torch.inference_mode():
        assert torch.equal(model(sample_input), want)
    # Parameters made under inference_mode must still work in grad mode afterwards (the engine is
    # for inference: a backward through released blocks is not supported).
    out = model(sample_input)
    assert out.requires_grad and torch.equal(out.detach(), want)


def test_torch_compile_of_a_model_holding_managed_blocks(sample_input):
    want = reference_output(sample_input)
    model, manager = offloaded(resident_layers=3, prefetch_size=1)
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(compiled(sample_input), want)
    assert manager.stats().copies_last_forward == NUM_BLOCKS - 3


def test_pinning_without_an_accelerator_falls_back_with_one_warning(sample_input, caplog):
    model, manager = offloaded(resident_layers=0, pin_memory=True)
    with caplog.at_level(logging.WARNING, logger="layerwise_offload"), torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))
    pin_warnings = [r for r in caplog.records if "could not pin" in r.getMessage()]
    assert len(pin_warnings) == 1
    assert all(r.getMessage().startswith("[layerwise-offload]") for r in caplog.records)
    assert manager.stats().pinned_host_bytes == 0


@pytest.mark.parametrize("bad, message", [
    ({"resident_layers": -1}, "resident_layers must be >= 0, got -1"),
    ({"resident_layers": float("nan")}, "nan"),
    ({"resident_layers": "4"}, "'4'"),
    ({"resident_layers": True}, "True"),
    ({"prefetch_size": 0}, "prefetch_size must be an integer >= 1, got 0"),
    ({"prefetch_size": 1.5}, "1.5"),
    ({"policy": "random"}, "'random'"),
    ({"pin_memory": "yes"}, "'yes'"),
])
def test_invalid_arguments_name_the_value(bad, message):
    model = ToyTransformer()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", **bad)


def test_bad_block_lists_are_refused():
    model = ToyTransformer()
    with pytest.raises(ValueError, match="at least one block"):
        LayerwiseOffloadManager([], "cpu")
    block = model.single_blocks[0]
    with pytest.raises(ValueError, match="appears twice"):
        LayerwiseOffloadManager([block, block], "cpu")
    other = ToyTransformer().single_blocks[0]
    other.mix.weight = block.mix.weight
    with pytest.raises(ValueError, match="shared with block 0"):
        LayerwiseOffloadManager([block, other], "cpu")


def test_nothing_is_touched_before_the_first_forward():
    model = ToyTransformer()
    pointers = [p.data_ptr() for p in model.parameters()]
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", resident_layers=2)
    assert manager.store is None and manager.device_bytes() == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert manager.device_bytes(manager.config) > 0


@pytest.mark.parametrize("resident", [0, 3])
def test_released_blocks_can_point_at_the_host_store(sample_input, resident):
    model, manager = offloaded(resident_layers=resident, released_params="host")
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))
    manager.engine.hooks.remove()
    # Without hooks the model still runs: streamed blocks read their host copies.
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))
    host_pointers = {v.data_ptr() for i in range(NUM_BLOCKS) for v in manager.store.views(i)}
    for index, block in enumerate(model.blocks_in_call_order()):
        on_host = all(p.data_ptr() in host_pointers for p in block.parameters())
        assert on_host == (not manager.points_at_device(index))


def test_prepare_repacks_blocks_changed_behind_its_back(sample_input):
    """A whole-model .to() or a LoRA bake that swaps Parameter objects must not go unnoticed."""
    model, manager = offloaded(resident_layers=2, released_params="host")
    with torch.no_grad():
        model(sample_input)
    assert manager.prepare() == []
    block = model.single_blocks[1]  # block 4, streamed
    block.mix.weight = torch.nn.Parameter(block.mix.weight.data * 2)  # a "bake": new object, new values
    model.double_blocks[0].up.weight.data = model.double_blocks[0].up.weight.data.clone()  # a "move"
    changed = manager.prepare()
    assert changed == [0, 4]
    assert not manager.armed and manager.device_bytes() == 0
    want_model = ToyTransformer()
    want_model.single_blocks[1].mix.weight.data *= 2
    with torch.no_grad():
        want = want_model(sample_input)
        assert torch.equal(model(sample_input), want)
    assert manager.prepare() == []


def test_host_store_refuses_to_push_the_host_into_oom(sample_input):
    from layerwise_offload.offload.disk.budget import PACKING_SLACK_BYTES
    free = [None]  # the host's free RAM as the manager reads it, changed below
    model, manager = offloaded(resident_layers=0, environment=HostEnvironment(available_host_bytes=lambda: free[0]))
    # Packing frees each block's old copy, but its new buffer exists first: one block (and the slack) must be free.
    free[0] = PACKING_SLACK_BYTES + manager.block_nbytes()[0] - 1
    with torch.no_grad(), pytest.raises(MemoryError, match="host memory is short: packing the blocks needs"):
        model(sample_input)
    free[0] = None  # unknown: no guard
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference_output(sample_input))


def test_host_store_replaces_the_weights_instead_of_copying_them():
    """RAM: packing frees the module's own CPU weights, so the store costs no second copy."""
    import ctypes
    import gc
    import psutil
    process = psutil.Process()
    libc = ctypes.CDLL("libc.so.6")  # glibc keeps freed heap pages; trim them so RSS shows what is really held
    model = ToyTransformer(dim=1024, hidden=4096, double=2, single=2)  # ~128 MiB of block weights
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", released_params="host")
    total = sum(manager.block_nbytes())
    gc.collect()
    before = process.memory_info().rss
    manager.prepare()
    gc.collect()
    libc.malloc_trim(0)
    grown = process.memory_info().rss - before
    assert manager.store.nbytes() == total
    assert grown < 0.25 * total, f"RSS grew {grown / 2**20:.0f} MiB for a {total / 2**20:.0f} MiB store"


@pytest.mark.parametrize("released_params", ["placeholder", "host"])
def test_a_model_built_under_inference_mode(sample_input, released_params):
    """ComfyUI loads models and runs prompts inside inference_mode: parameters are inference tensors."""
    with torch.inference_mode():
        model = ToyTransformer()
        manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2,
                                          released_params=released_params)
        assert model.single_blocks[0].mix.weight.is_inference()
        for _ in range(2):
            assert torch.equal(model(sample_input), reference_output(sample_input))
    manager.release_all()  # outside inference_mode, as ComfyUI's unload may be
    manager.prepare()
    manager.detach()
    with torch.inference_mode():
        assert torch.equal(model(sample_input), reference_output(sample_input))
