"""The disk tier's stage checked for races without a GPU or a slow disk, over the CUDA stand-in.

The real StreamBackend and DiskTier run over tests/cuda_standin.py: streams in simulated time with the host far
ahead, vector clocks over the streams, the host and a ``disk`` actor (tests/stream_checks.py ``watch_disk_reads``:
each read into a staging chunk is the disk writing that chunk, over for the host once it waited for the read). The
host learns that a copy finished only from its event (``query``/``synchronize``). Reads and copies run for real, so
the output is checked bitwise too. Both sources of a disk block are checked: the cache file and the checkpoint's
extents. A disk block is read and copied chunk by chunk through a ring of a few staging chunks; the toy's blocks
fit in one default chunk, so the chunked runs shrink the chunk to one page (every block several chunks) and the
ring to one, two or three chunks. The two rules, per staging chunk, are the stand-in's: a copy from it must come
after its disk read finished, and a new read into it (the disk writing host memory) after every copy from it
finished; either broken raises where it happens.
"""

import pytest
import torch
from safetensors.torch import save_file

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.disk import tier as disk_tier
from layerwise_offload.offload.disk.checkpoint import CheckpointFile
from layerwise_offload.tests.cuda_standin import CudaRuleBroken, overlaps
from layerwise_offload.tests.stream_checks import backend_over, new_cuda, watch_disk_reads


def toy_over_checkpoint(tmp_path):
    """A toy whose weights are a safetensors checkpoint's mapped tensors: its disk blocks read the file's extents."""
    path = tmp_path / "toy.safetensors"
    save_file({k: v.contiguous() for k, v in ToyTransformer().state_dict().items()}, str(path))
    model = ToyTransformer()
    model.load_state_dict(CheckpointFile(str(path)).state_dict(), assign=True)
    return model


# (staging chunk bytes, chunks in the ring): the defaults (each toy block one chunk), and one page per chunk.
CHUNKED = [(4096, 1), (4096, 2), (4096, 3)]


def run_checked(resident, prefetch, policy, tmp_path, break_with=None, source="cache", chunks=None, monkeypatch=None,
                regime="host_bound"):
    if chunks is not None:
        monkeypatch.setattr(disk_tier, "CHUNK_BYTES", chunks[0])
        monkeypatch.setattr(disk_tier, "STAGING_CHUNKS", chunks[1])
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    model = toy_over_checkpoint(tmp_path) if source == "checkpoint" else ToyTransformer()
    with torch.no_grad():
        want = model(x)
    cuda = new_cuda(regime)
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, policy=policy, pin_memory=True, host_store="disk",
                                      environment=HostEnvironment(disk_folder=str(tmp_path), pinner=cuda.pinner(),
                                                                  available_host_bytes=lambda: 2**40),
                                      backend=backend_over(cuda))
    cuda.drive(manager)
    manager.attach(model)
    reads = []  # (block, chunk, staging buffer's first byte) per read started
    with cuda.running(), torch.no_grad():
        manager.prepare()
        assert bool(manager.engine.host.disk.extents) == (source == "checkpoint")
        watch_disk_reads(cuda, manager.engine.host.disk, reads)
        if break_with is not None:
            break_with(manager.engine.host.disk)
        outputs = [model(x) for _ in range(3)]
    tier = manager.engine.host.disk
    ring = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in tier.ring]
    assert reads and all(any(begin <= first < end for begin, end in ring) for _, _, first in reads)
    assert any(overlaps(upload.src, span) for upload in cuda.uploads for span in ring)  # copies from the ring
    assert all(upload.pinned for upload in cuda.uploads if any(overlaps(upload.src, span) for span in ring))
    assert len(tier.ring) == disk_tier.STAGING_CHUNKS and tier.ring_bytes == disk_tier.staging_ring_bytes(
        max(manager.block_nbytes()))
    if chunks is not None:
        assert len(reads) > 3 * len(manager.schedule.streamed_blocks)  # several chunks per block
    if regime == "host_bound":  # copies found finished: chunks are read ahead of the copies that need them
        assert tier.demand_reads < len(manager.schedule.streamed_blocks)
    assert all(torch.equal(out, want) for out in outputs)  # after the stand-in: a race raises there first, by name
    assert not cuda.faults
    manager.detach()


@pytest.mark.parametrize("chunks", [None] + CHUNKED)
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
@pytest.mark.parametrize("resident, prefetch, policy", [(0, 1, "leading"), (2, 2, "strided"), (1, 3, "leading")])
def test_no_copy_before_its_read_and_no_read_over_a_copy_in_flight(tmp_path, monkeypatch, resident, prefetch, policy,
                                                                   source, chunks):
    """The device quick (a copy the host asks about has finished, so the ring reads ahead into chunks it finds
    free)."""
    run_checked(resident, prefetch, policy, tmp_path, source=source, chunks=chunks, monkeypatch=monkeypatch)


@pytest.mark.parametrize("resident, prefetch, policy, source", [(0, 1, "leading", "cache"),
                                                                (2, 2, "strided", "checkpoint"),
                                                                (1, 3, "leading", "checkpoint")])
def test_the_same_with_the_host_far_ahead(tmp_path, monkeypatch, resident, prefetch, policy, source):
    """The device slow (copies still run when the ring wants their chunks: it waits for their events)."""
    run_checked(resident, prefetch, policy, tmp_path, source=source, chunks=(4096, 2), monkeypatch=monkeypatch,
                regime="compute_bound")


def skip_read_waits(tier):
    tier._settle = lambda staging: None


def skip_copy_waits(tier, monkeypatch):
    monkeypatch.setattr(disk_tier, "copy_finished", lambda handle, wait: True)


@pytest.mark.parametrize("chunks", [None, (4096, 2)])
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_the_checker_catches_a_copy_before_its_read(tmp_path, monkeypatch, source, chunks):
    with pytest.raises(CudaRuleBroken, match="a copy on the copy stream reads host memory that a disk write may not "
                                             "have finished"):
        run_checked(0, 1, "leading", tmp_path, break_with=skip_read_waits, source=source, chunks=chunks,
                    monkeypatch=monkeypatch)


@pytest.mark.parametrize("chunks", [None, (4096, 2)])
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_the_checker_catches_a_read_over_a_copy_in_flight(tmp_path, monkeypatch, source, chunks):
    with pytest.raises(CudaRuleBroken, match=r"the host changes host memory \(a disk write\) that a copy on the copy "
                                             "stream may still read"):
        run_checked(0, 1, "leading", tmp_path, break_with=lambda tier: skip_copy_waits(tier, monkeypatch),
                    source=source, chunks=chunks, monkeypatch=monkeypatch)
