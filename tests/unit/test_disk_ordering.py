"""The disk tier's stage checked for races without a GPU or a slow disk: vector clocks over four actors.

The real StreamBackend and DiskTier run over a stand-in for ``torch.cuda`` whose streams and events keep vector
clocks, as in test_stream_ordering.py, plus the host thread and the disk: an op a stream runs was queued by the
host, so it happens after what the host knew then; the host learns that a copy finished only from its event
(``query``/``synchronize``), and that a read finished only by waiting for it. Reads and copies run for real, so
the output is checked bitwise too. Both sources of a disk block are checked: the cache file and the checkpoint's
extents. A disk block is read and copied chunk by chunk through a ring of a few staging chunks; the toy's blocks
fit in one default chunk, so the chunked runs shrink the chunk to one page (every block several chunks) and the
ring to one, two or three chunks. The two rules, per staging chunk: it is copied to the device only after its disk
read finished, and a new read into it starts only after every copy from it finished.
"""

from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import save_file

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.disk import tier as disk_tier
from layerwise_offload.offload.disk.checkpoint import CheckpointFile
from layerwise_offload.offload.device.backend import StreamBackend

ACTORS = ("compute", "copy", "host", "disk")


def merge(into, other):
    for actor in ACTORS:
        into[actor] = max(into[actor], other[actor])


def happens_before(a, b):
    return all(a[s] <= b[s] for s in ACTORS)


class Host:
    def __init__(self):
        self.clock = {s: 0 for s in ACTORS}

    def tick(self):
        self.clock["host"] += 1
        return dict(self.clock)


class FakeStream:
    def __init__(self, name, host):
        self.name, self.host = name, host
        self.clock = {s: 0 for s in ACTORS}

    def tick(self):
        merge(self.clock, self.host.tick())  # queued by the host: after everything it knew
        self.clock[self.name] += 1
        return dict(self.clock)

    def wait_event(self, event):
        if event.clock is not None:
            merge(self.clock, event.clock)

    def synchronize(self):
        merge(self.host.clock, self.clock)


class FakeEvent:
    host = None

    def __init__(self, enable_timing=False):
        self.clock = None

    def record(self, stream):
        self.clock = stream.tick()

    def synchronize(self):
        if self.clock is not None:
            merge(self.host.clock, self.clock)

    def query(self):
        self.synchronize()  # the fake finishes at once; the host learns it by asking
        return True

    def elapsed_time(self, other):
        return 0.0


class FakeCudaModule:
    def __init__(self):
        self.host = Host()
        self.Event = type("Event", (FakeEvent,), {"host": self.host})
        self.compute = FakeStream("compute", self.host)
        self.current = self.compute

    def Stream(self, device=None):
        return FakeStream("copy", self.host)

    @contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self, device=None):
        return self.current


class Backend(StreamBackend):
    def __init__(self, module):
        self.module, self.device, self.measure_time = module, torch.device("cpu"), True
        self.copy_stream = module.Stream()
        self.transform_stream = None
        self.copy_seconds = self.stall_seconds = 0.0
        self._pending = []
        self.copies = []  # (source's first byte, clock at start, clock at end)

    def copy(self, dst, src, after=None, then=None):
        handle = super().copy(dst, src, after, then)
        self.copies.append((src.data_ptr(), handle.started.clock, handle.done.clock))
        return handle


class YesPinner:
    def register(self, tensor):
        return True

    def unregister(self, tensor):
        pass


def instrument(tier, module, reads):
    """Record every read into a staging buffer with its clocks; waiting for it teaches the host its end."""
    start, settle = tier._start, tier._settle
    ends = {}

    def _start(index, piece, staging):
        issued = module.host.tick()
        disk = dict(issued)
        disk["disk"] = max(c["disk"] for c in [issued] + [r[2] for r in reads]) + 1
        reads.append((staging.buffer.data_ptr(), issued, disk))
        ends[id(staging)] = disk
        start(index, piece, staging)

    def _settle(staging):
        if staging.future is not None:
            merge(module.host.clock, ends[id(staging)])
        settle(staging)
    tier._start, tier._settle = _start, _settle


def toy_over_checkpoint(tmp_path):
    """A toy whose weights are a safetensors checkpoint's mapped tensors: its disk blocks read the file's extents."""
    path = tmp_path / "toy.safetensors"
    save_file({k: v.contiguous() for k, v in ToyTransformer().state_dict().items()}, str(path))
    model = ToyTransformer()
    model.load_state_dict(CheckpointFile(str(path)).state_dict(), assign=True)
    return model


# (staging chunk bytes, chunks in the ring): the defaults (each toy block one chunk), and one page per chunk.
CHUNKED = [(4096, 1), (4096, 2), (4096, 3)]


def run_checked(resident, prefetch, policy, tmp_path, break_with=None, source="cache", chunks=None, monkeypatch=None):
    if chunks is not None:
        monkeypatch.setattr(disk_tier, "CHUNK_BYTES", chunks[0])
        monkeypatch.setattr(disk_tier, "STAGING_CHUNKS", chunks[1])
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model = toy_over_checkpoint(tmp_path) if source == "checkpoint" else ToyTransformer()
    with torch.no_grad():
        want = model(x)
    module = FakeCudaModule()
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, policy=policy, pin_memory=True, host_store="disk",
                                      environment=HostEnvironment(disk_folder=str(tmp_path), pinner=YesPinner(),
                                                                  available_host_bytes=lambda: 2**40),
                                      backend=Backend(module))
    backend = manager.backend
    manager.attach(model)
    reads = []
    manager.prepare()
    assert bool(manager.host.disk.extents) == (source == "checkpoint")
    instrument(manager.host.disk, module, reads)
    if break_with is not None:
        break_with(manager.host.disk)
    with torch.no_grad():
        outputs = [model(x) for _ in range(3)]
    ring = {s.buffer.data_ptr() for s in manager.host.disk.ring}
    events = sorted([(r[1]["host"], "read", r) for r in reads] +
                    [(c[1]["host"], "copy", c) for c in backend.copies if c[0] in ring], key=lambda e: e[0])
    last_read, copies_since = {}, {}
    for _, kind, (buffer, begin, end) in events:
        if kind == "read":
            for copy_end in copies_since.get(buffer, []):
                assert happens_before(copy_end, begin), "a read may overwrite a staging buffer a copy still reads"
            copies_since[buffer] = []
            last_read[buffer] = end
        else:
            assert buffer in last_read and happens_before(last_read[buffer], begin), (
                "a staging buffer may be copied before its disk read finished")
            copies_since.setdefault(buffer, []).append(end)
    assert reads and any(kind == "copy" for _, kind, _ in events)
    tier = manager.host.disk
    assert len(tier.ring) == disk_tier.STAGING_CHUNKS and tier.ring_bytes == disk_tier.staging_ring_bytes(
        max(manager.block_nbytes()))
    if chunks is not None:
        assert len(reads) > 3 * len(manager.schedule.streamed_blocks)  # several chunks per block
    assert all(torch.equal(out, want) for out in outputs)  # after the clocks: a race shows there first, by name
    manager.detach()


@pytest.mark.parametrize("chunks", [None] + CHUNKED)
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
@pytest.mark.parametrize("resident, prefetch, policy", [(0, 1, "leading"), (2, 2, "strided"), (1, 3, "leading")])
def test_no_copy_before_its_read_and_no_read_over_a_copy_in_flight(tmp_path, monkeypatch, resident, prefetch, policy,
                                                                   source, chunks):
    run_checked(resident, prefetch, policy, tmp_path, source=source, chunks=chunks, monkeypatch=monkeypatch)


def skip_read_waits(tier):
    tier._settle = lambda staging: None


def skip_copy_waits(tier, monkeypatch):
    monkeypatch.setattr(disk_tier, "copy_finished", lambda handle, wait: True)


@pytest.mark.parametrize("chunks", [None, (4096, 2)])
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_the_checker_catches_a_copy_before_its_read(tmp_path, monkeypatch, source, chunks):
    with pytest.raises(AssertionError, match="copied before its disk read"):
        run_checked(0, 1, "leading", tmp_path, break_with=skip_read_waits, source=source, chunks=chunks,
                    monkeypatch=monkeypatch)


@pytest.mark.parametrize("chunks", [None, (4096, 2)])
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_the_checker_catches_a_read_over_a_copy_in_flight(tmp_path, monkeypatch, source, chunks):
    with pytest.raises(AssertionError, match="overwrite a staging buffer"):
        run_checked(0, 1, "leading", tmp_path, break_with=lambda tier: skip_copy_waits(tier, monkeypatch),
                    source=source, chunks=chunks, monkeypatch=monkeypatch)
