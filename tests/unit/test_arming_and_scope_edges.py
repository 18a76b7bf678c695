"""Edges of a forward: running out of device memory while arming, and copies still in flight when it ends."""

import importlib.util
from pathlib import Path

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import apply_layerwise_offload


def _stream_ordering_fakes():
    """The vector-clock stand-in for ``torch.cuda`` from test_stream_ordering.py (one definition of it)."""
    path = Path(__file__).with_name("test_stream_ordering.py")
    spec = importlib.util.spec_from_file_location("layerwise_offload_stream_fakes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fakes = _stream_ordering_fakes()


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def out_of_memory_on(call_number, manager):
    allocate = manager.device_memory.allocate
    calls = 0

    def failing(nbytes):
        nonlocal calls
        calls += 1
        if calls == call_number:
            raise torch.OutOfMemoryError(f"test: allocation {call_number} of {nbytes} bytes failed")
        return allocate(nbytes)
    return failing


@pytest.mark.parametrize("failing_allocation", [1, 2, 3, 4])  # 2 resident buffers, then 2 slots
def test_out_of_memory_while_arming_leaves_a_usable_manager(x, failing_allocation):
    with torch.no_grad():
        want = ToyTransformer()(x)
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2,
                                      prefetch_size=1)
    # Looks inside: an out-of-memory at a chosen device allocation, which no CPU run would raise on its own.
    manager.device_memory.allocate = out_of_memory_on(failing_allocation, manager)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        model(x)
    assert not manager.armed
    assert manager.device_bytes() == 0 and not manager.materialized_blocks()
    assert manager.hooks.installed
    del manager.device_memory.allocate  # the memory is back
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert manager.device_bytes() == manager.planned_device_bytes()
    manager.detach()


@pytest.mark.parametrize("tails", [0, 4096])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_copies_pending_when_a_forward_ends_are_waited_on_before_outside_reads(x, prefetch, tails):
    """Blocks prefetched for the next forward have copies that may still be running; anything reading the
    weights after the forward (on the current stream) must see finished copies or the host copy, never a slot
    still being written."""
    model = ToyTransformer()
    fake = fakes.FakeCudaModule()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=1,
                                      prefetch_size=prefetch, backend=fakes.RecordingBackend(fake),
                                      streamed_tail_bytes=tails)
    backend = manager.backend
    with torch.no_grad():
        for _ in range(2):
            model(x)
            assert bool(manager.device_memory.heads) == bool(tails)
            prefetched = [i for i in manager.materialized_blocks() if not manager.schedule.resident[i]]
            assert prefetched  # the look-ahead wrapped into the next forward
            read = fake.compute.tick()  # code outside the hooks reads the weights now
            for index in manager.materialized_blocks():
                for span in fakes.storage_ranges(model.blocks_in_call_order()[index]):
                    writers = [w for w in backend.writes if fakes.overlaps((w[0], w[1]), span)]
                    assert not writers or fakes.happens_before(writers[-1][3], read), (
                        f"block {index}'s parameters view device memory whose copy may still be running")
    manager.detach()


@pytest.mark.parametrize("resident, prefetch", [(1, 1), (2, 2), (0, 1)])
def test_the_compute_stream_does_not_wait_for_the_next_forwards_prefetch(x, resident, prefetch):
    """After a forward, the copies prefetched for the next one run on the copy stream while the compute stream
    goes on (the sampler's math, the next forward's resident blocks); its first streamed block waits for them."""
    with torch.no_grad():
        want = ToyTransformer()(x)
    model = ToyTransformer()
    fake = fakes.FakeCudaModule()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=resident,
                                      prefetch_size=prefetch, backend=fakes.RecordingBackend(fake))
    backend = manager.backend
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
            prefetched = [i for i in manager.materialized_blocks() if not manager.schedule.resident[i]]
            assert prefetched
            for index in prefetched:
                slot = manager.device_memory.slots[manager.device_memory.block_slot[index]]
                start = slot.data_ptr()
                writer = [w for w in backend.writes if fakes.overlaps((w[0], w[1]), (start, start + slot.numel()))][-1]
                assert not fakes.happens_before(writer[3], fake.compute.clock), (
                    f"the compute stream waits at the end of the forward for block {index}'s prefetch")
    manager.detach()
