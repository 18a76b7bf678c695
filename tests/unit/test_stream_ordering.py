"""The CUDA stream/event logic (StreamBackend) checked for data races without a GPU.

The real StreamBackend runs over a stand-in for ``torch.cuda`` whose streams and events only keep
vector clocks: every op on a stream advances that stream's clock, ``record`` snapshots it and
``wait_event`` merges it, exactly the happens-before order CUDA guarantees. Copies still run for real
(on the CPU), so the output is checked as well. For every block read on the "compute stream" the copy
that filled its slot must happen before the read; for every copy into a slot, every earlier read of
that memory must happen before the copy starts. The only fake is the GPU's stream semantics.
"""

from contextlib import contextmanager

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.device.backend import StreamBackend
from layerwise_offload.offload.units import weight_units

STREAMS = ("compute", "copy", "transform")


class FakeStream:
    waits = []  # (waiting stream, stream the event was recorded on): every wait_event of every stream

    def __init__(self, name):
        self.name = name
        self.clock = {s: 0 for s in STREAMS}

    def tick(self):
        self.clock[self.name] += 1
        return dict(self.clock)

    def wait_event(self, event):
        FakeStream.waits.append((self.name, event.stream))
        if event.clock is not None:
            for s in STREAMS:
                self.clock[s] = max(self.clock[s], event.clock[s])

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self, enable_timing=False):
        self.clock = None
        self.stream = None

    def record(self, stream):
        self.clock = stream.tick()
        self.stream = stream.name

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class FakeCudaModule:
    """What StreamBackend asks of ``torch.cuda``: Stream, Event, stream(), current_stream()."""

    Event = FakeEvent

    def __init__(self):
        self.compute = FakeStream("compute")
        self.current = self.compute
        self.made = 0

    def Stream(self, device=None):
        """The backend's copy stream first, then its after-copy transform stream."""
        self.made += 1
        return FakeStream(STREAMS[min(self.made, len(STREAMS) - 1)])

    @contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self, device=None):
        return self.current


def happens_before(a, b):
    return all(a[s] <= b[s] for s in STREAMS)


class RecordingBackend(StreamBackend):
    def __init__(self, module):
        self.module = module
        self.device = torch.device("cpu")
        self.measure_time = True
        self.copy_stream = module.Stream()
        self.transform_stream = None
        self.copy_seconds = self.stall_seconds = 0.0
        self._pending = []
        self.writes = []  # (start, end, first byte, last byte, clock at start, clock at end)

    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after, then)
        start = dst.data_ptr()
        self.writes.append((start, start + dst.numel(), handle.started.clock, handle.done.clock))
        return handle


def storage_ranges(block):
    """Each parameter's bytes (a block with a streamed tail reads two buffers: its head's and its slot's)."""
    return [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in block.parameters()]


def overlaps_any(range_, spans):
    return any(overlaps(range_, span) for span in spans)


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


class YesPinner:
    """Stands in for cudaHostRegister; ``refuse_after`` leaves the later blocks pageable."""

    def __init__(self, refuse_after=None):
        self.count = 0
        self.refuse_after = refuse_after

    def register(self, tensor):
        self.count += 1
        return self.refuse_after is None or self.count <= self.refuse_after

    def unregister(self, tensor):
        pass


PINNING = {"pinned": YesPinner(), "pageable": None, "mixed": YesPinner(refuse_after=2)}


def halve_on_the_device(fake, backend):
    """An after-copy transform that halves a block's weights (exact in every dtype) and records its write
    into the block's device memory, with the clock of the stream it ran on."""
    backend.transform_writes = []  # (first byte, last byte, clock, stream it ran on)

    def halve(index, weights):
        clock = fake.current.tick()
        weights = [w for w in weights if w is not None]  # a head or a tail: the weights this copy wrote, one buffer
        for weight in weights:
            weight.mul_(0.5)
        span = (min(w.data_ptr() for w in weights), max(w.data_ptr() + w.numel() * w.element_size() for w in weights))
        backend.transform_writes.append((*span, clock, fake.current.name))
    return halve


def run_checked(resident, prefetch, policy, order, pinning, backend_class=None, transform=False, before=None,
                forwards=3, tails=0, units=False):
    """Three forwards under the race checker; returns the backend with its copies and where they were issued.
    ``transform``: an after-copy transform halves every block's weights on the "device" as it is copied in.
    ``before(k, manager, backend)`` runs before forward ``k`` (a replan, say), ``forwards`` of them. ``units``: the
    manager streams the blocks' weight units (offload/units.py), not the blocks."""
    def streamed_modules(model):
        blocks = model.blocks_in_call_order()
        return list(weight_units(blocks).units) if units else blocks

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    reference = ToyTransformer()
    reference.order = order
    with torch.no_grad():
        if transform:
            for param in (p for block in streamed_modules(reference) for p in block.parameters()):
                param.mul_(0.5)
        want = reference(x)
    model = ToyTransformer()
    model.order = order
    fake = FakeCudaModule()
    FakeStream.waits = []
    manager = LayerwiseOffloadManager(streamed_modules(model), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, policy=policy, pin_memory=pinning != "pageable",
                                      streamed_tail_bytes=tails,
                                      environment=HostEnvironment(pinner=PINNING[pinning],
                                                                  available_host_bytes=lambda: 2**40),
                                      backend=(backend_class or RecordingBackend)(fake))
    backend = manager.backend
    if PINNING[pinning] is not None:
        PINNING[pinning].count = 0
    if transform:
        manager.set_after_copy(halve_on_the_device(fake, backend))
    manager.attach(model)
    track_issuing_hook(manager, backend)
    reads = []  # (block, memory range, clock when its reads start, clock when they end)
    starts = {}

    def read_start(index):
        def hook(module, args):
            spans = storage_ranges(module)
            starts[index] = (spans, fake.compute.tick(), len(backend.writes))
            for span in spans:
                writer = [w for w in backend.writes if overlaps((w[0], w[1]), span)][-1]
                assert happens_before(writer[3], starts[index][1]), f"block {index} may read before its copy finished"
            for begin, end, clock, stream in getattr(backend, "transform_writes", ()):
                if overlaps_any((begin, end), spans):
                    assert stream == "transform", f"block {index}'s after-copy transform ran on the {stream} stream"
                    assert happens_before(clock, starts[index][1]), f"block {index} may read before its transform"
        return hook

    def read_end(index):
        def hook(module, args, output):
            spans, start, writes_at_start = starts.pop(index)
            for begin, end, _, _ in backend.writes[writes_at_start:]:
                assert not overlaps_any((begin, end), spans), f"a copy was issued into block {index}'s memory while it ran"
            reads.append((index, spans, start, fake.compute.tick(), len(backend.writes)))
        return hook

    for index, block in enumerate(streamed_modules(model)):
        block.register_forward_pre_hook(read_start(index))  # after the manager's: sees the waits it issued
        block.register_forward_hook(read_end(index), prepend=True)  # before the manager's release
    with torch.no_grad():
        for k in range(forwards):
            if before is not None:
                before(k, manager, backend)
            assert torch.equal(model(x), want)
    assert backend.writes and reads
    # The next copy never queues behind a LoRA: the copy stream waits on the compute stream only.
    assert ("copy", "transform") not in FakeStream.waits, "the copy stream waits for an after-copy transform"
    for number, (begin, end, write_start, _) in enumerate(backend.writes):
        for index, spans, _, read_finished, writes_before in reads:
            if writes_before <= number and overlaps_any((begin, end), spans):
                assert happens_before(read_finished, write_start), (
                    f"copy #{number} may overwrite memory block {index} is still reading")
    return manager, backend


def track_issuing_hook(manager, backend):
    """Record, for every copy, the block whose pre- or post-hook issued it, and which block it copies."""
    host_block = {}
    backend.issued = []  # (copied block, "pre" | "post", hook's block, copied from pinned memory)
    backend.issuing = None
    for name, phase in (("before_block", "pre"), ("after_block", "post")):
        def wrapped(index, original=getattr(manager, name), phase=phase):
            backend.issuing = (phase, index)
            try:
                return original(index)
            finally:
                backend.issuing = None
        setattr(manager, name, wrapped)
    original_copy, copy_in = backend.copy, manager.copier.copy

    def copying(backend_, index, *args, **kwargs):
        backend.copying = index
        return copy_in(backend_, index, *args, **kwargs)
    manager.copier.copy = copying

    def copy(dst, src, after=None, then=None):
        host_block.update({(b.data_ptr(), b.data_ptr() + b.numel()): i for i, b in enumerate(manager.store.buffers)})
        block = next((i for (begin, end), i in host_block.items() if begin <= src.data_ptr() < end), None)
        if block is None:  # a resident's chunk, from the page-locked bounce ring (offload/device/resident_copy.py)
            bounce = [b.data_ptr() for b in manager.copier.bounce.buffers]
            assert src.data_ptr() in bounce, "a copy from neither the store nor the bounce ring"
            backend.issued.append((backend.copying, *backend.issuing, True))
        else:
            assert block == backend.copying
            backend.issued.append((block, *backend.issuing, manager.store.is_pinned(block)))
        return original_copy(dst, src, after, then)
    backend.copy = copy


SCENARIOS = [
    (0, 1, "leading", None), (0, 2, "strided", None), (2, 1, "leading", None), (3, 3, "strided", None),
    (1, 1, "leading", [0, 2, 4, 6]), (2, 2, "leading", [6, 5, 4, 3, 2, 1, 0]), (0, 1, "leading", [0, 1, 1, 2, 5, 3]),
]


@pytest.mark.parametrize("pinning", ["pinned", "pageable", "mixed"])
@pytest.mark.parametrize("resident, prefetch, policy, order", SCENARIOS)
def test_no_block_reads_before_its_copy_and_no_copy_overwrites_a_pending_read(resident, prefetch, policy, order,
                                                                              pinning):
    manager, backend = run_checked(resident, prefetch, policy, order, pinning)
    residents = set(manager.schedule.resident_blocks)  # copied once when the plan is armed
    if pinning != "pageable":  # through the bounce ring where the pinner grants it (offload/device/resident_copy.py)
        assert all(pinned for block, _, _, pinned in backend.issued if block in residents) or pinning == "mixed"
    for block, phase, hook_block, pinned in backend.issued:
        if phase == "pre" and block != hook_block and block not in residents:  # a prefetch
            assert pinned, f"a copy of block {block} from pageable memory was issued before block {hook_block} ran"
    kinds = {(phase, pinned) for block, phase, _, pinned in backend.issued if block not in residents}
    if pinning == "pageable":
        assert ("post", False) in kinds and ("pre", True) not in kinds
    if pinning == "pinned" and order is None:
        assert ("pre", True) in kinds and ("post", True) not in kinds


@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("resident, prefetch, policy, order", SCENARIOS[:4] + SCENARIOS[5:6])
def test_an_after_copy_transform_runs_on_its_own_stream_before_the_block_reads(resident, prefetch, policy, order,
                                                                               pinning):
    """A LoRA applied on the device: ordered after the copy, before the reads, never twice (the host keeps the
    untransformed weights, so three forwards give the same output as the halved reference)."""
    manager, backend = run_checked(resident, prefetch, policy, order, pinning, transform=True)
    copies = len(backend.writes)
    assert len(backend.transform_writes) == copies  # once per copy, residents included


class TransformAfterTheEvent(RecordingBackend):
    """The transform queued outside what the copy's handle covers: the compute stream would not wait for it."""

    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after)
        if then is not None:
            if self.transform_stream is None:
                self.transform_stream = self.module.Stream()
            with self.module.stream(self.transform_stream):
                then()
        return handle


class TransformOnTheCopyStream(RecordingBackend):
    """The older order: the transform on the copy stream before the copy's event (the next copy waits behind it)."""

    def copy(self, dst, src, after=None, then=None):
        def on_the_copy_stream():
            with self.module.stream(self.copy_stream):
                then()
        return super().copy(dst, src, after, on_the_copy_stream if then is not None else None)


class TransformOnTheComputeStream(RecordingBackend):
    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after)
        if then is not None:
            then()
        return handle


@pytest.mark.parametrize("broken", [TransformAfterTheEvent, TransformOnTheComputeStream, TransformOnTheCopyStream])
def test_the_checker_catches_a_misordered_transform(broken):
    with pytest.raises(AssertionError, match="before its transform|transform ran on the (compute|copy)"):
        run_checked(0, 1, "leading", None, "pinned", backend_class=broken, transform=True)


class NoSlotWait(RecordingBackend):
    def copy(self, dst, src, after=None, then=None):
        return super().copy(dst, src, after=None, then=then)


class NoComputeWait(RecordingBackend):
    def wait_for_copy(self, handle):
        pass


@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("broken", [NoSlotWait, NoComputeWait])
def test_the_checker_catches_a_missing_wait(pinning, broken):
    """Without the copy stream's wait for the slot's last reader, or the compute stream's wait for the copy, it fails."""
    with pytest.raises(AssertionError, match="may overwrite|may read before"):
        run_checked(0, 1, "leading", None, pinning, backend_class=broken)


def tail_cap():
    from layerwise_offload.offload.host.packing import block_parameters, plan_layout
    return plan_layout(block_parameters(ToyTransformer().blocks_in_call_order()[0])).tail_sizes[2]


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("resident, prefetch, policy, order", SCENARIOS[:4] + SCENARIOS[5:])
def test_streamed_tails_are_ordered_like_whole_blocks(resident, prefetch, policy, order, pinning, transform):
    """A streamed block that keeps its head reads two buffers: the head copied once at arming, the tail into its slot
    at every copy. No read before either copy (or its transform), no copy into either while the block runs."""
    manager, backend = run_checked(resident, prefetch, policy, order, pinning, transform=transform, tails=tail_cap())
    streamed = manager.schedule.streamed_blocks
    assert set(manager.device_memory.heads) == set(streamed)
    if transform:
        assert len(backend.transform_writes) == len(backend.writes)  # heads and tails: each transformed once


@pytest.mark.parametrize("transform", [False, True])
@pytest.mark.parametrize("pinning", ["pinned", "pageable"])
@pytest.mark.parametrize("resident, prefetch, policy, order", [(0, 1, "leading", None), (5, 2, "strided", None),
                                                               (3, 1, "leading", [6, 5, 4, 3, 2, 1, 0])])
@pytest.mark.parametrize("tails", [0, 600])
def test_weight_units_are_ordered_like_blocks(resident, prefetch, policy, order, pinning, transform, tails):
    """Each module that owns weights streamed on its own (offload/units.py), whole or its tail (a Linear's bias): no
    unit reads before its copy or its transform, no copy lands in a unit's memory while it runs; the output after
    three forwards is the reference's (asserted by run_checked)."""
    manager, backend = run_checked(resident, prefetch, policy, order, pinning, transform=transform, tails=tails,
                                   units=True)
    assert manager.num_blocks == 3 * 7
    if transform:
        assert len(backend.transform_writes) == len(backend.writes)
