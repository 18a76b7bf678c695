"""Residents reach the device from page-locked memory (offload/device/resident_copy.py), checked without a GPU.

The real manager and StreamBackend run over the CUDA stand-in (tests/cuda_standin.py), the host far ahead: the
host learns that a copy finished only from its event. Every copy of a resident must read page-locked memory (the
stand-in's pinner knows which bytes are), and the host may refill a bounce buffer only after every copy that read it
finished (the host writing host memory a queued copy may still read raises where it happens). The output is
bitwise the model's own, and the ring is unlocked once its copies are done.
"""

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.device import resident_copy as resident_staging
from layerwise_offload.tests.cuda_standin import CudaRuleBroken, byte_span
from layerwise_offload.tests.stream_checks import backend_over, new_cuda


def run(resident, prefetch, monkeypatch, refuse_after=None, chunk=4096, break_waits=False, regime="compute_bound"):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ToyTransformer()(x)
    model = ToyTransformer()
    cuda = new_cuda(regime)
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, pin_memory=True,
                                      environment=HostEnvironment(pinner=cuda.pinner(refuse_after),
                                                                  available_host_bytes=lambda: 2**40),
                                      backend=backend_over(cuda))
    cuda.drive(manager)
    manager.engine.copier.bounce_bytes = chunk  # looks inside: a toy block spans several chunks, so the ring is reused
    fills = []  # (first byte, last byte) of each host write into a bounce buffer
    fill = torch.Tensor.copy_

    def watched_fill(tensor, source, *args, **kwargs):
        begin = tensor.data_ptr()
        if any(b.data_ptr() <= begin < b.data_ptr() + b.numel() for b in getattr(manager.engine.copier.bounce, "buffers", ())):
            fills.append(byte_span(tensor))
        return fill(tensor, source, *args, **kwargs)
    if break_waits:
        monkeypatch.setattr(resident_staging, "copy_finished", lambda handle, wait: True)
    manager.attach(model)
    with cuda.running(), torch.no_grad():  # a refill under a copy in flight raises in here (CudaRuleBroken)
        monkeypatch.setattr(torch.Tensor, "copy_", watched_fill)
        outputs = [model(x) for _ in range(3)]
        monkeypatch.setattr(torch.Tensor, "copy_", fill)
        cuda.synchronize()  # the host waits for the device (a sampler reading its output back) ...
        outputs.append(model(x))  # ... so the next forward finds the ring's copies done, and unlocks it
    assert all(torch.equal(out, want) for out in outputs)
    assert not cuda.faults
    return manager, cuda, fills


@pytest.mark.parametrize("regime", ["compute_bound", "host_bound"])
@pytest.mark.parametrize("resident, prefetch", [(2, 1), (7, 1), (3, 2)])
def test_residents_are_copied_from_page_locked_memory_in_order(monkeypatch, resident, prefetch, regime):
    manager, cuda, fills = run(resident, prefetch, monkeypatch, regime=regime)
    residents = manager.schedule.resident_blocks
    resident_bytes = sum(manager.store.layouts[i].nbytes for i in residents)
    assert fills and sum(end - begin for begin, end in fills) == resident_bytes  # every resident byte, once
    assert all(upload.pinned for upload in cuda.uploads), "a copy read pageable host memory"
    assert not cuda.pageable_async
    assert manager.engine.copier.bounce is None  # the ring is unlocked once its copies are done
    streamed = [manager.store.buffers[i] for i in manager.schedule.streamed_blocks]
    assert cuda.pinned_spans() == sorted(byte_span(b) for b in streamed)  # residents stay pageable
    manager.detach()
    assert not cuda.pinned_spans()


def test_a_refused_bounce_ring_falls_back_to_pageable_copies(monkeypatch):
    """The pinner grants the streamed blocks and nothing more: the residents copy from pageable memory, correctly."""
    manager, cuda, fills = run(2, 1, monkeypatch, refuse_after=5)
    assert not fills and manager.engine.copier.bounce is None
    residents = {manager.store.buffers[i].data_ptr() for i in manager.schedule.resident_blocks}
    assert {upload.src[0] for upload in cuda.uploads if not upload.pinned} == residents
    manager.detach()


def test_the_checker_catches_a_refill_over_a_copy_in_flight(monkeypatch):
    with pytest.raises(CudaRuleBroken, match=r"the host changes host memory \(a host copy\) that a copy on the copy "
                                             "stream may still read"):
        run(2, 1, monkeypatch, break_waits=True)
