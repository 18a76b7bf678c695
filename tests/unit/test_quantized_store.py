"""Quantized weights that are tensor subclasses, in the host store and through the manager (CPU loopback).

The stand-in subclasses (a wrapper one with a separate scale, a storage one with a Python attribute) and the
quantized toy are tests/quantized_standins.py's.
"""

import pytest
import torch
from torch import nn

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import apply_layerwise_offload
from layerwise_offload.offload.host.packing import (ALIGNMENT_BYTES, ENTRY_ALIGNMENT_BYTES, HostStore,
                                                    block_parameters, plan_layout)
from layerwise_offload.offload.weights import UnsupportedWeightError
from layerwise_offload.tests.quantized_standins import ScaledInt8, TaggedBytes, quantized_toy


class Opaque(torch.Tensor):
    """A subclass the store knows nothing about."""


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def want(x):
    with torch.no_grad():
        return quantized_toy()(x)


def subclass_state(model):
    out = []
    for block in model.blocks_in_call_order():
        out.append([(type(block.mix.weight), block.mix.weight.note, type(block.gate), block.gate.tag)])
    return out


def test_streamed_tails_never_split_a_quantized_weight_and_stay_bitwise(x, want):
    """A wrapper weight's data and scale sit in different dtype groups of the buffer: a tail begins only where no
    weight has parts on both sides, and the subclass is rebuilt over its head and tail views."""
    model = quantized_toy()
    layout = plan_layout(block_parameters(model.blocks_in_call_order()[0]))
    assert any(len(w.parts) > 1 for w in layout.weights)
    for size in layout.tail_sizes[:-1]:
        split = layout.nbytes - size
        for weight in layout.weights:
            assert len({layout.entries[i].offset >= split for i in weight.parts}) == 1
    caps = sorted({size for size in layout.tail_sizes[:-1]})
    assert caps  # some split exists (the plain and the storage-subclass weights)
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2,
                                      prefetch_size=1, streamed_tail_bytes=caps[-1])
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert subclass_state(model) == [[(ScaledInt8, "per-row", TaggedBytes, "gate")]] * 7
    assert manager.stats().head_bytes > 0
    manager.detach()
    with torch.no_grad():
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("resident", [0, 2, 7])
def test_subclass_weights_stream_bitwise_and_keep_their_type(x, want, resident):
    model = quantized_toy()
    params_before = [id(p) for p in model.parameters()]
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=resident,
                                      prefetch_size=1)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert [id(p) for p in model.parameters()] == params_before  # same Parameter objects, contents swapped
    assert subclass_state(model) == [[(ScaledInt8, "per-row", TaggedBytes, "gate")]] * 7
    stats = manager.stats()
    assert stats.copies_last_forward == 7 - min(resident, 7)
    manager.detach()
    assert subclass_state(model) == [[(ScaledInt8, "per-row", TaggedBytes, "gate")]] * 7
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_bytes_on_the_wire_are_the_packed_bytes(x):
    model = quantized_toy()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=3)
    with torch.no_grad():
        model(x)
        model(x)  # the first forward also copies the residents in
    stored = manager.block_nbytes()
    assert manager.stats().bytes_copied_last_forward == sum(stored[3:])
    block = model.blocks_in_call_order()[3]
    quantized = sum(p.qdata.nbytes + p.scale.nbytes for p in (block.mix.weight, block.up.weight, block.down.weight))
    dequantized = sum(p.numel() * 4 for p in (block.mix.weight, block.up.weight, block.down.weight))
    others = sum(p.numel() * p.element_size() for name, p in block.named_parameters() if not name.endswith("weight")
                 or name.startswith("norm"))
    # int8 data + scales + the plain parameters, each on a page of its own: nothing dequantized on the wire
    entries = len(manager.store.layouts[3].entries)
    assert quantized + others <= stored[3] <= quantized + others + ENTRY_ALIGNMENT_BYTES * entries


def test_pointing_a_weight_at_a_copy_runs_no_op_on_it(x):
    """Swapping a subclass in must not detach or clone it: a subclass's detach may clone its scales on the
    compute stream while their copy is still in flight on the copy stream (comfy-kitchen's does)."""
    model = quantized_toy()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2)
    with torch.no_grad():
        model(x)
        ScaledInt8.ops_seen.clear()
        model(x)
    assert manager.stats().copies_last_forward == 5
    assert set(ScaledInt8.ops_seen) <= {torch.ops.aten.linear.default, torch.ops.aten.t.default,
                                        torch.ops.aten.addmm.default, torch.ops.aten.mm.default}, ScaledInt8.ops_seen


def test_layout_stores_the_inner_tensors_and_rebuilds_the_subclass():
    block = quantized_toy().blocks_in_call_order()[0]
    named = block_parameters(block)
    layout = plan_layout(named)
    assert {e.name for e in layout.entries} >= {"mix.weight:qdata", "mix.weight:scale", "gate"}
    assert [w.param for w in layout.weights] == [p for _, p in named]
    store = HostStore([layout])
    store.pack_block(0, pin=False)
    rebuilt = dict(zip([n for n, _ in named], store.weight_views(0)))
    assert type(rebuilt["mix.weight"]) is ScaledInt8 and rebuilt["mix.weight"].note == "per-row"
    assert torch.equal(rebuilt["mix.weight"].qdata, block.mix.weight.qdata)
    assert torch.equal(rebuilt["mix.weight"].scale, block.mix.weight.scale)
    assert rebuilt["mix.weight"].qdata.data_ptr() != block.mix.weight.qdata.data_ptr()  # a copy, in the buffer
    assert type(rebuilt["gate"]) is torch.Tensor and torch.equal(rebuilt["gate"], block.gate.as_subclass(torch.Tensor))


def test_storage_subclass_keeps_its_own_size_not_its_reported_shape():
    class LogicalShape(TaggedBytes):
        @property
        def shape(self):
            return torch.Size([4, 8])  # the dequantized shape, as GGMLTensor reports it

    raw = torch.arange(4 * 6, dtype=torch.uint8).view(4, 6).as_subclass(LogicalShape)
    layout = plan_layout([("w", nn.Parameter(raw, requires_grad=False))])
    assert layout.entries[0].shape == (4, 6) and layout.nbytes == ENTRY_ALIGNMENT_BYTES  # 24 B, padded


def test_unknown_subclass_is_refused_with_its_name():
    model = ToyTransformer()
    model.double_blocks[1].mix.weight = nn.Parameter(model.double_blocks[1].mix.weight.detach().as_subclass(Opaque))
    with pytest.raises(UnsupportedWeightError, match=r"'mix.weight'.*test_quantized_store.Opaque"):
        manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=0)
        manager.prepare()
