"""A change of the streamed set (replan, auto resize, a smaller pin cap) page-locks and unlocks only the blocks
whose membership changed, each after the copies that read its buffer, never behind a whole-device sync.

Over the CUDA stand-in (tests/cuda_standin.py), the host far ahead: the host learns that a copy finished only from
its event, unlocking host memory a queued copy may still read raises where it happens (CudaRuleBroken), and a full
``synchronize`` of the copy stream is counted.
"""

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.tests.cuda_standin import CudaRuleBroken, CudaStandIn, byte_span
from layerwise_offload.tests.stream_checks import backend_over, new_cuda


class LoggingPinner(CudaStandIn.Pinner):
    """The stand-in's pinner (it tells the stand-in which bytes are page-locked, and an unlock is a host write of
    them), logging every (un)register."""

    def __init__(self, cuda):
        super().__init__(cuda)
        self.log = []  # ("register" | "unregister", first byte, last byte)

    def register(self, tensor):
        self.log.append(("register", *byte_span(tensor)))
        return super().register(tensor)

    def unregister(self, tensor):
        self.log.append(("unregister", *byte_span(tensor)))
        super().unregister(tensor)


def setup(resident, monkeypatch):
    model = ToyTransformer()
    cuda = new_cuda()
    pinner = LoggingPinner(cuda)
    # ComfyUI's pin cap as the manager reads it: none, until a test sets one
    cap = pinner.cap = [None]
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=1, pin_memory=True, environment=HostEnvironment(
                                          pinner=pinner, available_host_bytes=lambda: 2**40,
                                          pin_cap=lambda own: cap[0]), backend=backend_over(cuda))
    cuda.drive(manager)
    backend = manager.engine.backend
    backend.full_syncs = []
    sync = backend.copy_stream.synchronize

    def counted_sync():
        backend.full_syncs.append(backend.phase)
        sync()
    backend.copy_stream.synchronize = counted_sync
    backend.phase = "outside"
    original = manager.engine.host.sync_pinning

    def phased(*args):
        backend.phase = "sync_pinning"
        try:
            return original(*args)
        finally:
            backend.phase = "outside"
    monkeypatch.setattr(manager.engine.host, "sync_pinning", phased)
    manager.attach(model)
    return model, manager, pinner, cuda


def buffers_in(manager, blocks):
    return {(manager.store.buffers[i].data_ptr(), manager.store.buffers[i].data_ptr()
             + manager.store.buffers[i].numel()) for i in blocks}


@pytest.mark.parametrize("before, after", [(2, 4), (4, 1), (0, 7)])
def test_a_replan_relocks_only_the_blocks_that_changed_without_a_full_sync(monkeypatch, before, after):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ToyTransformer()(x)
    model, manager, pinner, cuda = setup(before, monkeypatch)
    with cuda.running(), torch.no_grad():  # an unlock under a copy in flight raises in here
        for _ in range(2):
            assert torch.equal(model(x), want)
        old = set(manager.schedule.streamed_blocks)
        since = len(pinner.log)
        manager.replan(resident_layers=after)
        for _ in range(2):
            assert torch.equal(model(x), want)
    new = set(manager.schedule.streamed_blocks)
    touched = {(begin, end) for kind, begin, end in pinner.log[since:] if begin in
               {b.data_ptr() for b in manager.store.buffers}}
    assert touched == buffers_in(manager, old ^ new)  # the blocks whose membership changed, nothing else
    assert "sync_pinning" not in manager.engine.backend.full_syncs
    assert not cuda.faults
    manager.detach()


def test_a_smaller_pin_cap_while_copies_are_in_flight_waits_only_for_their_events(monkeypatch):
    """Copies from every streamed block are queued and unfinished; the cap then drops to two blocks: the unlocked
    buffers wait for their own copies (their events, never the whole copy stream), the rest stay locked."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model, manager, pinner, cuda = setup(1, monkeypatch)
    with cuda.running(), torch.no_grad():
        model(x)
        streamed = manager.schedule.streamed_blocks
        keep = sorted(streamed, reverse=True)[:2]  # _sync_pinning locks the late blocks first
        pinner.cap[0] = sum(manager.store.buffers[i].numel() for i in keep)
        since = len(pinner.log)
        manager.engine.sync_pinning()
        assert {kind for kind, *_ in pinner.log[since:]} == {"unregister"}
        assert {(b, e) for _, b, e in pinner.log[since:]} == buffers_in(manager, set(streamed) - set(keep))
        assert not manager.engine.backend.full_syncs
        assert torch.equal(model(x), ToyTransformer()(x))
    assert not cuda.faults
    manager.detach()


def test_the_checker_catches_an_unlock_under_a_copy_in_flight(monkeypatch):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model, manager, pinner, cuda = setup(1, monkeypatch)
    with cuda.running(), torch.no_grad():
        model(x)
        pinner.cap[0] = 0
        monkeypatch.setattr(manager.engine.backend, "wait_host", lambda handle: None)
        with pytest.raises(CudaRuleBroken, match=r"the host changes host memory \(unpinned\) that a copy on the copy "
                                                 "stream may still read"):
            manager.engine.sync_pinning()
