"""Pointing parameters cheaply (issue 28 item 3) without changing what they hold: a quantized wrapper weight is
re-pointed through contents of its own (aliases) and a donor's C++ tensor when the device changes, never through a
throwaway object after the first time; the parameter keeps its identity, type and its owner's attributes; the
targets are never modified; moves by someone else are still noticed; the counters read O(1) state that matches the
blocks'. Counts, not times (times: bench/studies/host_time.py, removed since:
`git show 48aa0a6:bench/studies/host_time.py`)."""

import pytest
import torch
from torch import nn

from layerwise_offload.offload import apply_layerwise_offload
from layerwise_offload.offload.weights import WrapperPointer, wrapper_inner
from layerwise_offload.tests.quantized_standins import ScaledInt8, quantized_toy


def scaled(seed):
    return ScaledInt8.quantize(torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("devices", ["same", "changing"])
def test_a_wrapper_weight_is_re_pointed_through_contents_of_its_own(monkeypatch, devices):
    """``cpu`` and ``cpu:0`` are the same memory but different devices to the pointer: the second takes the path a
    GPU takes at every pointing (the C++ tensor traded with a donor of the target's device)."""
    param = nn.Parameter(scaled(0), requires_grad=False)
    targets = [scaled(1), scaled(2)]
    inner = [wrapper_inner(t) for t in targets]
    pointers = [[t.data_ptr() for t in i] for i in inner]
    device_of = [torch.device("cpu"), torch.device("cpu" if devices == "same" else "cpu:0")]
    swaps = []
    real_swap = torch.utils.swap_tensors
    monkeypatch.setattr(torch.utils, "swap_tensors", lambda a, b: (swaps.append(1), real_swap(a, b))[1])
    pointer = WrapperPointer(param)
    identity = id(param)
    for step in range(6):
        k = step % 2
        pointer.point(targets[k], inner[k], device_of[k])
        if step == 0:
            param.owner_note = "set by the model's owner"  # an attribute of the parameter, not of its contents
        assert id(param) == identity and type(param) is ScaledInt8 and param._is_param
        assert param.qdata.data_ptr() == targets[k].qdata.data_ptr() and param.scale.data_ptr() == targets[k].scale.data_ptr()
        assert param.qdata is not targets[k].qdata  # its own aliases: the target's tensors are never re-pointed
        assert torch.equal(param.dequantize(), targets[k].dequantize())
        assert param.note == "per-row" and param.owner_note == "set by the model's owner"
    assert len(swaps) == 1  # the first pointing installs the aliases; the rest re-point them
    assert [[t.data_ptr() for t in i] for i in inner] == pointers


def test_a_released_quantized_block_points_at_its_host_copy_and_detach_gives_it_back():
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = quantized_toy()(x)
    model = quantized_toy()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2,
                                      released_params="host")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    block = model.blocks_in_call_order()[4]  # streamed, released: its weights view the host store
    store = manager.store.buffers[4]
    begin, end = store.data_ptr(), store.data_ptr() + store.numel()
    assert begin <= block.mix.weight.qdata.data_ptr() < end and begin <= block.gate.data_ptr() < end
    assert all(manager.engine.params.is_ours(i) for i in range(manager.num_blocks))
    block.up.weight = nn.Parameter(block.up.weight.detach().clone(), requires_grad=False)  # a move by someone else
    assert not manager.engine.params.is_ours(4) and manager.prepare() == [4]
    manager.detach()
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_the_materialized_count_is_what_the_blocks_say():
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    model = quantized_toy()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=1,
                                      prefetch_size=2)
    seen = []

    def check(module, args, output=None):
        seen.append(manager.engine.states.count == sum(manager.engine.states.materialized))
    for block in model.blocks_in_call_order():
        block.register_forward_pre_hook(check)
        block.register_forward_hook(check)
    with torch.no_grad():
        for count in (1, 3, 0, 7, 2):
            manager.replan(resident_layers=count)
            model(x)
            seen.append(manager.engine.states.count == sum(manager.engine.states.materialized))
    manager.release_all()
    assert all(seen) and manager.engine.states.count == 0
    stats = manager.stats()
    assert stats.peak_materialized_blocks == 7 and stats.device_bytes == 0
