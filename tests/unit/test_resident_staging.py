"""Residents reach the device from page-locked memory (offload/device/resident_copy.py), checked without a GPU.

The vector clocks of test_disk_ordering.py (compute, copy stream, host): the host learns that a copy finished
only from its event. Every copy of a resident must read page-locked memory (the pinner's registered ranges),
and the host may refill a bounce buffer only after every copy that read it finished. The output is bitwise the
model's own, and the ring is unlocked once its copies are done.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.device import resident_copy as resident_staging


def _fakes():
    path = Path(__file__).with_name("test_disk_ordering.py")  # one definition of the host-aware stand-in
    spec = importlib.util.spec_from_file_location("layerwise_offload_disk_fakes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fakes = _fakes()


class RangePinner:
    """Stands in for cudaHostRegister: keeps the registered byte ranges, refuses after ``refuse_after`` grants."""

    def __init__(self, refuse_after=None):
        self.ranges = {}
        self.grants = 0
        self.refuse_after = refuse_after

    def register(self, tensor):
        if self.refuse_after is not None and self.grants >= self.refuse_after:
            return False
        self.grants += 1
        self.ranges[tensor.data_ptr()] = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        return True

    def unregister(self, tensor):
        del self.ranges[tensor.data_ptr()]

    def locked(self, begin, end):
        return any(a <= begin and end <= b for a, b in self.ranges.items())


class SourceBackend(fakes.Backend):
    """Records every copy: its source range, whether that range was page-locked then, its clocks."""

    def __init__(self, module, pinner):
        super().__init__(module)
        self.pinner = pinner
        self.sources = []  # (first byte, last byte, page-locked, clock at start, clock at end)

    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after, then)
        begin = src.data_ptr()
        self.sources.append((begin, begin + src.numel(), self.pinner.locked(begin, begin + src.numel()),
                             handle.started.clock, handle.done.clock))
        return handle


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


def run(resident, prefetch, monkeypatch, pinner=None, chunk=4096, break_waits=False):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ToyTransformer()(x)
    model = ToyTransformer()
    pinner = pinner or RangePinner()
    module = fakes.FakeCudaModule()
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, pin_memory=True,
                                      environment=HostEnvironment(pinner=pinner, available_host_bytes=lambda: 2**40),
                                      backend=SourceBackend(module, pinner))
    backend = manager.backend
    manager.copier.bounce_bytes = chunk  # looks inside: a toy block spans several chunks, so the ring is reused
    fills = []  # (first byte, last byte, host clock when the host wrote the bounce buffer)
    fill = torch.Tensor.copy_

    def watched_fill(tensor, source, *args, **kwargs):
        begin = tensor.data_ptr()
        if any(b.data_ptr() <= begin < b.data_ptr() + b.numel() for b in getattr(manager.copier.bounce, "buffers", ())):
            fills.append((begin, begin + tensor.numel(), dict(module.host.tick())))
        return fill(tensor, source, *args, **kwargs)
    if break_waits:
        monkeypatch.setattr(resident_staging, "copy_finished", lambda handle, wait: True)
    manager.attach(model)
    with torch.no_grad():
        monkeypatch.setattr(torch.Tensor, "copy_", watched_fill)
        outputs = [model(x) for _ in range(3)]
        monkeypatch.setattr(torch.Tensor, "copy_", fill)
    for begin, end, host in fills:
        for source in backend.sources:
            if overlaps((begin, end), source[:2]) and not fakes.happens_before(host, source[3]):
                assert fakes.happens_before(source[4], host), "a bounce buffer may be refilled while a copy reads it"
    assert all(torch.equal(out, want) for out in outputs)
    return manager, backend, fills


@pytest.mark.parametrize("resident, prefetch", [(2, 1), (7, 1), (3, 2)])
def test_residents_are_copied_from_page_locked_memory_in_order(monkeypatch, resident, prefetch):
    manager, backend, fills = run(resident, prefetch, monkeypatch)
    residents = manager.schedule.resident_blocks
    resident_bytes = sum(manager.store.layouts[i].nbytes for i in residents)
    assert fills and sum(end - begin for begin, end, _ in fills) == resident_bytes  # every resident byte, once
    assert all(locked for _, _, locked, _, _ in backend.sources), "a copy read pageable host memory"
    assert manager.copier.bounce is None  # the ring is unlocked once its copies are done
    streamed = [manager.store.buffers[i] for i in manager.schedule.streamed_blocks]
    assert sorted(manager.host.pinner.ranges) == sorted(b.data_ptr() for b in streamed)  # residents stay pageable
    manager.detach()
    assert not manager.host.pinner.ranges


def test_a_refused_bounce_ring_falls_back_to_pageable_copies(monkeypatch):
    """The pinner grants the streamed blocks and nothing more: the residents copy from pageable memory, correctly."""
    manager, backend, fills = run(2, 1, monkeypatch, pinner=RangePinner(refuse_after=5))
    assert not fills and manager.copier.bounce is None
    residents = {manager.store.buffers[i].data_ptr() for i in manager.schedule.resident_blocks}
    assert {begin for begin, _, locked, _, _ in backend.sources if not locked} == residents
    manager.detach()


def test_the_checker_catches_a_refill_over_a_copy_in_flight(monkeypatch):
    with pytest.raises(AssertionError, match="refilled while a copy reads it"):
        run(2, 1, monkeypatch, break_waits=True)
