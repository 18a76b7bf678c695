"""Page-locking exactly the streamed blocks, through a recording stand-in for cudaHostRegister.

No GPU here: the pinner records every range it is asked to lock and checks that a range is never
locked twice nor unlocked when it was not locked. What the tests check is the ledger the manager
keeps and the sizes it asks for; tests/comfy and bench/ run the same path with ComfyUI's pinner.
"""

import gc
import logging

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, apply_layerwise_offload
from layerwise_offload.offload.memory.ram import GiB
from layerwise_offload.offload.memory.pinning import PinLedger, return_freed_host_memory


class RecordingPinner:
    def __init__(self, refuse_after=None, refuse_calls=()):
        self.live = {}  # data_ptr -> bytes locked now
        self.calls = []  # ("register" | "unregister", bytes)
        self.refuse_after = refuse_after
        self.refuse_calls = set(refuse_calls)  # the n-th register calls (from 0) that are refused
        self.asked = 0

    def register(self, tensor):
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        assert ptr not in self.live, "a range was page-locked twice"
        assert tensor.is_contiguous() and tensor.device.type == "cpu"
        self.asked += 1
        if self.asked - 1 in self.refuse_calls:
            return False
        if self.refuse_after is not None and len(self.live) >= self.refuse_after:
            return False
        self.live[ptr] = nbytes
        self.calls.append(("register", nbytes))
        return True

    def unregister(self, tensor):
        ptr = tensor.data_ptr()
        assert ptr in self.live, "unlocking a range that is not locked"
        self.calls.append(("unregister", self.live.pop(ptr)))

    @property
    def locked(self):
        return sum(self.live.values())


@pytest.fixture(scope="module")
def sample_input():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def reference(x):
    with torch.no_grad():
        return ToyTransformer()(x)


def pinned_offload(pinner, available=64 * GiB, **settings):
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, pin_memory=True, **settings,
                                      environment=HostEnvironment(pinner=pinner, available_host_bytes=lambda: available))
    return model, manager


def streamed_bytes(manager):
    sizes = manager.block_nbytes()
    return sum(sizes[i] for i in manager.schedule.streamed_blocks)


def test_exactly_the_streamed_blocks_are_page_locked(sample_input):
    pinner = RecordingPinner()
    model, manager = pinned_offload(pinner, resident_layers=2)
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
    streamed = streamed_bytes(manager)
    stats = manager.stats()
    assert pinner.locked == stats.host_bytes_pinned == stats.host_bytes_requested == streamed
    assert sorted(n for _, n in pinner.calls) == sorted(manager.block_nbytes()[2:])
    assert manager.store.pinned == [False, False] + [True] * 5  # residents keep a pageable copy
    # The resident plan changes: the newly streamed blocks get locked, the new residents unlocked.
    manager.replan(resident_layers=4)
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
    assert manager.store.pinned == [False] * 4 + [True] * 3
    assert pinner.locked == streamed_bytes(manager) == manager.stats().host_bytes_pinned


def test_everything_is_unlocked_on_detach_and_when_the_manager_is_dropped(sample_input):
    pinner = RecordingPinner()
    model, manager = pinned_offload(pinner)
    with torch.no_grad():
        model(sample_input)
    assert pinner.locked == sum(manager.block_nbytes())
    manager.detach()
    assert pinner.live == {}
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))

    model, manager = pinned_offload(pinner)
    with torch.no_grad():
        model(sample_input)
    assert pinner.locked > 0
    del model, manager
    gc.collect()
    assert pinner.live == {}


def test_a_repacked_block_unlocks_its_old_buffer_first(sample_input):
    pinner = RecordingPinner()
    model, manager = pinned_offload(pinner, resident_layers=0, released_params="host")
    with torch.no_grad():
        model(sample_input)
    block = model.single_blocks[1]  # block 4
    block.mix.weight = torch.nn.Parameter(block.mix.weight.data * 2)  # a LoRA bake: a new Parameter object
    assert manager.prepare() == [4]
    assert pinner.locked == sum(manager.block_nbytes())  # the old buffer was unlocked, the new one locked
    assert pinner.calls[-2:] == [("unregister", manager.block_nbytes()[4]), ("register", manager.block_nbytes()[4])]


def test_short_host_memory_locks_the_trailing_streamed_blocks_that_fit(sample_input, caplog):
    """The store is allocated already: locking it takes no more RAM, but the host keeps its margin free."""
    pinner = RecordingPinner()
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, pin_memory=True,
                                      resident_layers=1, environment=HostEnvironment(
                                          pinner=pinner, available_host_bytes=lambda: free))
    sizes = manager.block_nbytes()
    streamed = sum(sizes[1:])
    margin = 2 * GiB  # pinnable_bytes keeps at least 2 GiB free
    free = margin - (streamed - sizes[-1] - sizes[-2])
    with caplog.at_level(logging.WARNING, logger="layerwise_offload"), torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(sample_input), reference(sample_input))
    assert manager.store.pinned == [False] * 5 + [True, True]
    assert pinner.locked == sizes[-1] + sizes[-2] == manager.stats().host_bytes_pinned
    assert len([r for r in caplog.records if "page-locking" in r.getMessage()]) == 1


def test_a_refusing_pinner_leaves_the_rest_pageable_with_one_warning(sample_input, caplog):
    pinner = RecordingPinner(refuse_after=2)
    model, manager = pinned_offload(pinner)
    with caplog.at_level(logging.WARNING, logger="layerwise_offload"), torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(sample_input), reference(sample_input))
    assert sum(manager.store.pinned) == 2 and len(pinner.live) == 2
    assert len([r for r in caplog.records if "could not pin" in r.getMessage()]) == 1


def test_one_refusal_does_not_latch_pinning_off(sample_input, caplog):
    """A refused range (a neighbour's page, a transient limit) leaves that block pageable until it is asked
    for again (the next pinning pass), never the rest of the model for its life."""
    pinner = RecordingPinner(refuse_calls={1})
    model, manager = pinned_offload(pinner)
    with caplog.at_level(logging.WARNING, logger="layerwise_offload"), torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(sample_input), reference(sample_input))
    assert all(manager.store.pinned) and len(pinner.live) == manager.num_blocks
    assert pinner.asked == manager.num_blocks + 1  # the refused one was asked twice, nothing more
    assert len([r for r in caplog.records if "could not pin" in r.getMessage()]) == 1


def test_pin_memory_off_locks_nothing(sample_input):
    pinner = RecordingPinner()
    model, manager = pinned_offload(pinner)
    manager.replan(pin_memory=False)
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
    assert pinner.calls == [] and manager.stats().host_bytes_pinned == 0


def test_ledger_books_refused_requests_and_forgets_dropped_ones():
    ledger = PinLedger(None)
    buffer = torch.empty(1000, dtype=torch.uint8)
    assert not ledger.pin(buffer)
    assert ledger.bytes_requested == 1000 and ledger.bytes_pinned == 0
    ledger.unpin(buffer)
    assert ledger.bytes_requested == 0


def test_return_freed_host_memory_runs_here():
    assert return_freed_host_memory() in (True, False)


# ----------------------------------------------------------------- cudaHostRegister as CUDA answers it
class FakeCudart:
    """torch.cuda.cudart() as CUDA behaves: whole pages are locked, a range touching a locked page is refused
    with cudaErrorHostMemoryAlreadyRegistered, and a refusal stays the runtime's last error until read."""

    ALREADY_REGISTERED = 712
    PAGE = 4096

    def __init__(self):
        self.pages = {}  # page -> data_ptr of the registration that holds it
        self.last_error = 0

    def _pages(self, ptr, nbytes):
        return range(ptr // self.PAGE, (ptr + max(nbytes, 1) - 1) // self.PAGE + 1)

    def cudaHostRegister(self, ptr, nbytes, flags):
        pages = self._pages(ptr, nbytes)
        if any(p in self.pages for p in pages):
            self.last_error = self.ALREADY_REGISTERED
            return self.ALREADY_REGISTERED
        self.pages.update((p, ptr) for p in pages)
        return 0

    def cudaHostUnregister(self, ptr):
        for page in [p for p, owner in self.pages.items() if owner == ptr]:
            del self.pages[page]
        return 0

    def cudaGetLastError(self):
        code, self.last_error = self.last_error, 0
        return code


@pytest.fixture
def fake_cuda(monkeypatch):
    from layerwise_offload.offload.memory import pinning
    runtime = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(pinning, "_LAST_ERROR", [runtime.cudaGetLastError])
    return runtime


def test_a_refused_registration_leaves_no_cuda_error_behind(fake_cuda):
    from layerwise_offload.offload.memory.pinning import CudaHostRegisterPinner
    pinner = CudaHostRegisterPinner()
    buffer = torch.empty(3 * 4096, dtype=torch.uint8)
    assert pinner.register(buffer)
    assert not pinner.register(buffer[100:200])  # inside a locked page: refused, as CUDA refuses it
    assert fake_cuda.last_error == 0  # else the next kernel launch would raise it


def test_every_block_of_a_small_model_gets_its_own_pages(fake_cuda, sample_input):
    """Blocks far under a page each: heap buffers would share pages and all but the first be refused."""
    from layerwise_offload.offload.memory.pinning import CudaHostRegisterPinner
    model, manager = pinned_offload(CudaHostRegisterPinner())
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
    assert all(manager.store.pinned) and fake_cuda.last_error == 0
    # heap neighbours would share their edge pages
    assert any(sum(e.span_elements * e.dtype.itemsize for e in layout.entries) % 4096
               for layout in manager.store.layouts)
    for buffer in manager.store.buffers:
        assert buffer.data_ptr() % 4096 == 0
        storage = buffer.untyped_storage()
        end = buffer.data_ptr() + buffer.numel()
        assert storage.data_ptr() + storage.nbytes() >= -(-end // 4096) * 4096  # its last page is its own
    manager.detach()
    assert fake_cuda.pages == {}


@pytest.mark.parametrize("order", ["module", "reversed"])
@pytest.mark.parametrize("resident", [0, 3, 7])
def test_comfyui_pinning_each_released_weight_is_never_refused(fake_cuda, order, resident):
    """ComfyUI run without the node on the same model (0.3.75's lowvram load) page-locks each weight it leaves in RAM
    on its own, unless ``tensor.is_pinned()``, which asks about the first byte of the tensor's storage. Released
    weights view the store, whose streamed blocks this pack has page-locked: a weight of a locked buffer must read as
    pinned, and two weights of a pageable one must not share a page, or CUDA refuses one as already registered, an
    error 0.3.75 leaves set for its next CUDA call (both seen on an H200)."""
    from layerwise_offload.offload.memory.pinning import CudaHostRegisterPinner
    model = ToyTransformer(dim=20, hidden=44)  # weights of 1600 and 3520 bytes: entries straddle page boundaries
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=resident,
                                      released_params="host", pin_memory=True,
                                      environment=HostEnvironment(pinner=CudaHostRegisterPinner(),
                                                                  available_host_bytes=lambda: 64 * GiB))
    with torch.no_grad():
        model(torch.randn(1, 3, 20))
    manager.release_all()
    assert sum(manager.store.pinned) == 7 - resident  # the streamed blocks' host copies are page-locked
    params = [p for block in model.blocks_in_call_order() for p in block.parameters()]
    host = {v.data_ptr() for i in range(manager.num_blocks) for v in manager.store.views(i)}
    assert {p.data_ptr() for p in params} <= host  # the released blocks view the store

    def is_pinned(tensor):  # torch: isPinnedPtr(storage.data()), a registered page
        return tensor.untyped_storage().data_ptr() // fake_cuda.PAGE in fake_cuda.pages
    for param in (params if order == "module" else params[::-1]):
        if is_pinned(param):
            continue
        assert fake_cuda.cudaHostRegister(param.data_ptr(), param.numel() * param.element_size(), 1) == 0
    assert fake_cuda.last_error == 0
