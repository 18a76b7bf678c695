"""Edges of a forward: running out of device memory while arming, and copies still in flight when it ends."""

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, apply_layerwise_offload
from layerwise_offload.tests.cuda_standin import CudaRuleBroken, happens_before, overlaps
from layerwise_offload.tests.stream_checks import backend_over, new_cuda


@pytest.fixture(scope="module")
def x():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def out_of_memory_on(call_number, manager):
    allocate = manager.engine.device_memory.allocate
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
    manager.engine.device_memory.allocate = out_of_memory_on(failing_allocation, manager)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        model(x)
    assert not manager.armed
    assert manager.device_bytes() == 0 and not manager.materialized_blocks()
    assert manager.engine.hooks.installed
    del manager.engine.device_memory.allocate  # the memory is back
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert manager.device_bytes() == manager.device_bytes(manager.config)
    manager.detach()


def offloaded_over_the_standin(model, **settings):
    """The manager over the CUDA stand-in (tests/cuda_standin.py), its host copies page-locked, the host ahead."""
    cuda = new_cuda()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, pin_memory=True,
                                      environment=HostEnvironment(pinner=cuda.pinner(),
                                                                  available_host_bytes=lambda: 2**40),
                                      backend=backend_over(cuda), **settings)
    cuda.drive(manager)
    return cuda, manager


@pytest.mark.parametrize("released", ["placeholder", "host"])
@pytest.mark.parametrize("tails", [0, 4096])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_copies_pending_when_a_forward_ends_are_waited_on_before_outside_reads(x, prefetch, tails, released):
    """Blocks prefetched for the next forward have copies that may still be running; anything reading the
    weights after the forward (on the current stream) must see finished copies or the host copy, never a slot
    still being written: a prefetched block points at the device only from its own pre-hook on."""
    model = ToyTransformer()
    cuda, manager = offloaded_over_the_standin(model, resident_layers=1, prefetch_size=prefetch,
                                               streamed_tail_bytes=tails, released_params=released)
    blocks = model.blocks_in_call_order()
    with cuda.running(), torch.no_grad():
        for _ in range(2):
            model(x)
            assert bool(manager.engine.device_memory.heads) == bool(tails)
            prefetched = [i for i in manager.materialized_blocks() if not manager.schedule.resident[i]]
            assert prefetched  # the look-ahead wrapped into the next forward
            assert not any(manager.points_at_device(i) for i in prefetched)
            for index in manager.materialized_blocks():  # code outside the hooks reads the weights now
                for param in blocks[index].parameters():
                    param.float().sum()  # a race with a copy still writing raises here (CudaRuleBroken)
    assert not cuda.faults
    manager.detach()


def test_the_checker_catches_an_outside_read_of_bytes_in_flight(x):
    """A prefetched block pointed at its slot as soon as its copy is queued (as the manager once did): the same
    outside read races with the copy."""
    model = ToyTransformer()
    cuda, manager = offloaded_over_the_standin(model, resident_layers=1, prefetch_size=2)
    with cuda.running(), torch.no_grad():
        model(x)
        index = next(i for i in manager.materialized_blocks() if not manager.schedule.resident[i])
        manager.engine.mover.point_at(index, manager.engine.states.to_point(index))  # looks inside: points it early
        with pytest.raises(CudaRuleBroken, match="on the compute stream may read the manager's device memory that "
                                                 "a copy to the device on the copy stream may still write"):
            model.blocks_in_call_order()[index].mix.weight.sum()


@pytest.mark.parametrize("resident, prefetch", [(1, 1), (2, 2), (0, 1)])
def test_the_compute_stream_does_not_wait_for_the_next_forwards_prefetch(x, resident, prefetch):
    """After a forward, the copies prefetched for the next one run on the copy stream while the compute stream
    goes on (the sampler's math, the next forward's resident blocks); its first streamed block waits for them."""
    with torch.no_grad():
        want = ToyTransformer()(x)
    model = ToyTransformer()
    cuda, manager = offloaded_over_the_standin(model, resident_layers=resident, prefetch_size=prefetch)
    with cuda.running(), torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
            prefetched = [i for i in manager.materialized_blocks() if not manager.schedule.resident[i]]
            assert prefetched
            for index in prefetched:
                slot = manager.engine.device_memory.slots[manager.engine.device_memory.block_slot[index]]
                span = (slot.data_ptr(), slot.data_ptr() + slot.numel())
                writer = [u for u in cuda.uploads if overlaps(u.dst, span)][-1]
                assert not happens_before(writer.clock, cuda.compute.clock), (
                    f"the compute stream waits at the end of the forward for block {index}'s prefetch")
    assert not cuda.faults
    manager.detach()
