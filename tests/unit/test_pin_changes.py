"""A change of the streamed set (replan, auto resize, a smaller pin cap) page-locks and unlocks only the blocks
whose membership changed, each after the copies that read its buffer, never behind a whole-device sync.

The host-aware vector clocks of test_disk_ordering.py: the host learns that a copy finished only from its event,
and a full ``synchronize`` of the copy stream is counted.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager


def _staging_test():
    path = Path(__file__).with_name("test_resident_staging.py")  # its recording backend and stand-in
    spec = importlib.util.spec_from_file_location("layerwise_offload_staging_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


staging = _staging_test()
SourceBackend, fakes, overlaps = staging.SourceBackend, staging.fakes, staging.overlaps


class LoggingPinner:
    """Stands in for cudaHostRegister; logs every (un)register with the host's clock at that moment."""

    def __init__(self, module):
        self.module = module
        self.log = []  # ("register" | "unregister", first byte, last byte, host clock)
        self.ranges = {}

    def _note(self, kind, tensor):
        begin = tensor.data_ptr()
        self.log.append((kind, begin, begin + tensor.numel(), dict(self.module.host.tick())))

    def register(self, tensor):
        self._note("register", tensor)
        self.ranges[tensor.data_ptr()] = tensor.data_ptr() + tensor.numel()
        return True

    def unregister(self, tensor):
        self._note("unregister", tensor)
        del self.ranges[tensor.data_ptr()]

    def locked(self, begin, end):
        return any(a <= begin and end <= b for a, b in self.ranges.items())


def setup(resident, monkeypatch):
    model = ToyTransformer()
    module = fakes.FakeCudaModule()
    pinner = LoggingPinner(module)
    # ComfyUI's pin cap as the manager reads it: none, until a test sets one
    cap = pinner.cap = [None]
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=1, pin_memory=True, environment=HostEnvironment(
                                          pinner=pinner, available_host_bytes=lambda: 2**40,
                                          pin_cap=lambda own: cap[0]), backend=SourceBackend(module, pinner))
    backend = manager.backend
    backend.full_syncs = []
    sync = backend.copy_stream.synchronize

    def counted_sync():
        backend.full_syncs.append(backend.phase)
        sync()
    backend.copy_stream.synchronize = counted_sync
    backend.phase = "outside"
    original = manager.host.sync_pinning

    def phased(*args):
        backend.phase = "sync_pinning"
        try:
            return original(*args)
        finally:
            backend.phase = "outside"
    monkeypatch.setattr(manager.host, "sync_pinning", phased)
    manager.attach(model)
    return model, manager, pinner, backend


def check_ordered(pinner, backend, since=0):
    """Every (un)register of a buffer comes after the host saw each earlier copy from that buffer finish."""
    for kind, begin, end, host in pinner.log[since:]:
        for source in backend.sources:
            queued_before = not fakes.happens_before(host, source[3])
            if queued_before and overlaps((begin, end), source[:2]):
                assert fakes.happens_before(source[4], host), f"{kind} of a buffer a copy may still read"


def buffers_in(manager, blocks):
    return {(manager.store.buffers[i].data_ptr(), manager.store.buffers[i].data_ptr()
             + manager.store.buffers[i].numel()) for i in blocks}


@pytest.mark.parametrize("before, after", [(2, 4), (4, 1), (0, 7)])
def test_a_replan_relocks_only_the_blocks_that_changed_without_a_full_sync(monkeypatch, before, after):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ToyTransformer()(x)
    model, manager, pinner, backend = setup(before, monkeypatch)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    old = set(manager.schedule.streamed_blocks)
    since = len(pinner.log)
    manager.replan(resident_layers=after)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    new = set(manager.schedule.streamed_blocks)
    touched = {(begin, end) for kind, begin, end, _ in pinner.log[since:] if begin in
               {b.data_ptr() for b in manager.store.buffers}}
    assert touched == buffers_in(manager, old ^ new)  # the blocks whose membership changed, nothing else
    assert "sync_pinning" not in backend.full_syncs
    check_ordered(pinner, backend, since)
    manager.detach()


def test_a_smaller_pin_cap_while_copies_are_in_flight_waits_only_for_their_events(monkeypatch):
    """Copies from every streamed block are queued and unfinished; the cap then drops to two blocks: the unlocked
    buffers wait for their own copies (the host learns of those, and only those), the rest stay locked."""
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model, manager, pinner, backend = setup(1, monkeypatch)
    with torch.no_grad():
        model(x)
    streamed = manager.schedule.streamed_blocks
    keep = sorted(streamed, reverse=True)[:2]  # _sync_pinning locks the late blocks first
    pinner.cap[0] = sum(manager.store.buffers[i].numel() for i in keep)
    since = len(pinner.log)
    manager._sync_pinning()
    assert {kind for kind, *_ in pinner.log[since:]} == {"unregister"}
    assert {(b, e) for _, b, e, _ in pinner.log[since:]} == buffers_in(manager, set(streamed) - set(keep))
    assert not backend.full_syncs
    check_ordered(pinner, backend, since)
    with torch.no_grad():
        assert torch.equal(model(x), ToyTransformer()(x))
    manager.detach()


def test_the_checker_catches_an_unlock_under_a_copy_in_flight(monkeypatch):
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model, manager, pinner, backend = setup(1, monkeypatch)
    with torch.no_grad():
        model(x)
    pinner.cap[0] = 0
    monkeypatch.setattr(backend, "wait_host", lambda handle: None)
    since = len(pinner.log)
    manager._sync_pinning()
    with pytest.raises(AssertionError, match="unregister of a buffer a copy may still read"):
        check_ordered(pinner, backend, since)
    manager.detach()
