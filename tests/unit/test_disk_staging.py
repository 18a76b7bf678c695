"""The disk tier's staging RAM does not grow with the block (issue 26 item 3): a disk block is read and copied chunk by
chunk through a ring of a few staging chunks, so 4 MiB and 64 MiB blocks take the same small ring (never a
block-sized buffer), and the output stays bitwise equal; a converted entry kept in RAM lands in every chunk it
spans; an after-copy transform sees the whole block."""

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.disk import tier as disk_tier
from layerwise_offload.offload.disk.cache_file import padded
from layerwise_offload.offload.disk.checkpoint import CheckpointFile
from layerwise_offload.offload.disk.tier import DiskSource, DiskTier, staging_ring_bytes
from layerwise_offload.offload.host.packing import _packed_sources, block_parameters, plan_layout

MiB = 2**20
BLOCKS = 3


class Block(nn.Module):
    """About ``4 * dim**2`` bytes of fp32: a weight and a bias, so chunks end inside and between tensors."""

    def __init__(self, dim: int):
        super().__init__()
        self.a = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.a(x))


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(BLOCKS))
        torch.random.set_rng_state(generator_state)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def over_checkpoint(model: Model, folder) -> Model:
    """``model`` with its weights replaced by a safetensors checkpoint's mapped tensors (Load Diffusion Model
    (Layerwise)'s way): its disk blocks are read from the file's extents."""
    path = folder / "blocks.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    model.load_state_dict(CheckpointFile(str(path)).state_dict(), assign=True)
    return model


def run_from_disk(tmp_path, monkeypatch, dim: int, source: str, prefetch: int = 1):
    """Three forwards with every block streamed from disk; (staging bytes, host RAM the blocks hold, the largest
    buffer the disk tier allocated, block bytes)."""
    allocated = []
    original = disk_tier.aligned_buffer
    monkeypatch.setattr(disk_tier, "aligned_buffer", lambda nbytes: allocated.append(nbytes) or original(nbytes))
    x = torch.randn(2, dim, generator=torch.Generator().manual_seed(0))
    model = Model(dim)
    with torch.no_grad():
        want = model(x)
    folder = tmp_path / f"{source}-{dim}-{prefetch}"
    folder.mkdir()
    if source == "checkpoint":
        model = over_checkpoint(model, folder)
    manager = LayerwiseOffloadManager(list(model.blocks), "cpu", resident_layers=0, prefetch_size=prefetch,
                                      host_store="disk", environment=HostEnvironment(
                                          disk_folder=str(folder), available_host_bytes=lambda: 2**40))
    manager.attach(model)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    stats = manager.stats()
    assert stats.disk_blocks == BLOCKS and stats.disk_checkpoint_blocks == (BLOCKS if source == "checkpoint" else 0)
    figures = (stats.staging_bytes, stats.host_ram_bytes, max(allocated), max(manager.block_nbytes()))
    manager.detach()
    return figures


@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_the_staging_ring_is_the_same_small_ring_for_small_and_large_blocks(tmp_path, monkeypatch, source):
    small = run_from_disk(tmp_path, monkeypatch, 1024, source)  # 4 MiB blocks: under one 16 MiB chunk
    large = run_from_disk(tmp_path, monkeypatch, 4096, source)  # 64 MiB blocks: four chunks each
    ring = disk_tier.STAGING_CHUNKS * disk_tier.CHUNK_BYTES
    assert large[3] > 4 * disk_tier.CHUNK_BYTES > small[3] > 4 * MiB
    # Every block on disk: the host RAM the blocks hold is the ring alone; the disk tier never allocates more than
    # one chunk at a time (the write buffer while packing, then each staging chunk), whatever the block.
    assert large[0] == large[1] == ring == staging_ring_bytes(large[3])
    assert large[2] == disk_tier.CHUNK_BYTES >= small[2]
    # A block under one chunk takes chunks of its own size, never more than the ring of the largest blocks.
    assert small[0] == small[1] == staging_ring_bytes(small[3]) == disk_tier.STAGING_CHUNKS * padded(small[3]) < ring
    if source == "cache":  # a third size above a chunk, and another prefetch: the same ring
        middle = run_from_disk(tmp_path, monkeypatch, 2896, source, prefetch=3)  # 32 MiB blocks
        assert middle[0] == middle[1] == ring


@pytest.mark.parametrize("released", ["placeholder", "host"])
@pytest.mark.parametrize("source", ["cache", "checkpoint"])
def test_an_after_copy_transform_sees_the_whole_block_read_in_chunks(tmp_path, monkeypatch, source, released):
    """One-page chunks, a ring of two: a LoRA-like transform halves each block on the "device" once its last chunk
    is copied; the output is the halved model's, bitwise, at every forward."""
    monkeypatch.setattr(disk_tier, "CHUNK_BYTES", 4096)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    reference = ToyTransformer()
    if source == "checkpoint":  # the file holds the transposed weight contiguous: so does the reference
        down = reference.double_blocks[1].down
        down.weight = nn.Parameter(down.weight.detach().contiguous())
    with torch.no_grad():
        for param in (p for block in reference.blocks_in_call_order() for p in block.parameters()):
            param.mul_(0.5)
        want = reference(x)
    model = ToyTransformer()
    if source == "checkpoint":
        path = tmp_path / "toy.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        model.load_state_dict(CheckpointFile(str(path)).state_dict(), assign=True)
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=2, prefetch_size=1,
                                      host_store="disk", released_params=released, environment=HostEnvironment(
                                          disk_folder=str(tmp_path), available_host_bytes=lambda: 2**40))
    transformed = []

    def halve(index, weights):
        transformed.append(index)
        for weight in weights:
            weight.mul_(0.5)
    manager.after_copy = halve
    manager.attach(model)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    stats = manager.stats()
    assert bool(stats.disk_checkpoint_blocks) == (source == "checkpoint")
    assert len(transformed) == stats.copies_issued  # once per block copy, not per chunk
    assert stats.disk_reads > stats.copies_issued  # several chunks per block
    assert stats.staging_bytes == 2 * 4096
    manager.detach()


def test_kept_entries_are_copied_into_every_chunk_they_span():
    """A checkpoint block's entries that are not the file's bytes (converted on load) stay in RAM and are copied into
    the staging chunks they fall in: pieced together, the chunks hold what the whole block's layout would, for
    entries inside one chunk and across chunk borders, contiguous or transposed."""
    block = ToyTransformer().double_blocks[1]  # its down.weight is a transposed view
    layout = plan_layout(block_parameters(block))
    sources = _packed_sources(layout)  # in entry order
    by_name = {entry.name: position for position, entry in enumerate(layout.entries)}
    kept = [(position, sources[position]) for position in range(len(layout.entries))]
    whole = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for view, (position, tensor) in zip(layout.views(whole), kept):
        view.copy_(tensor)
    for size in (4096, 3 * 4096, layout.nbytes):
        pieces = []
        for first in range(0, layout.nbytes, size):
            length = min(size, layout.nbytes - first)
            staging = torch.zeros(size, dtype=torch.uint8)
            DiskTier._fill_kept(staging, (first, length, (layout, kept)))
            pieces.append(staging[:length])
        assert torch.equal(torch.cat(pieces), whole), size
    transposed = layout.entries[by_name["down.weight"]]
    assert transposed.stride != tuple(sources[by_name["down.weight"]].contiguous().stride())  # stored transposed
    assert transposed.offset // 4096 != (transposed.offset + transposed.span_elements * 4 - 1) // 4096


def test_the_readmes_flux_staging_figures_are_the_accounting():
    """The README's before/after staging RAM for Flux.1-dev (host_store disk, prefetch 1) is what the pack's own
    accounting gives over the template's real block sizes: now the plan's ring (``TierPlanner.plan``, the figure
    packing and the refusals use), before prefetch + 2 whole page-padded blocks (the old ring)."""
    import json
    import re
    from pathlib import Path

    from layerwise_offload.offload import HostEnvironment, OffloadConfig
    from layerwise_offload.offload.host.side import HostSide

    root = Path(__file__).resolve().parents[2]
    flux = next(t for t in json.loads((root / "devtools" / "template_plans.json").read_text())["templates"]
                if t["key"] == "flux1_dev")

    class Meta(nn.Module):
        def __init__(self, nbytes):
            super().__init__()
            self.w = nn.Parameter(torch.empty(nbytes, dtype=torch.uint8, device="meta"), requires_grad=False)

    config = OffloadConfig(host_store="disk", prefetch_size=1)
    host = HostSide([Meta(n) for n in flux["block_bytes"]], torch.device("cpu"), lambda: config,
                    HostEnvironment(available_host_bytes=lambda: 2**40))
    now = host.planner.plan(range(len(flux["block_bytes"])), "disk").ring_bytes
    largest = max(flux["block_bytes"])
    before = (config.prefetch_size + 2) * padded(largest)
    line = re.search(r"For Flux\.1-dev's (\d+) MiB double blocks at prefetch 1 .*? gives (\d+) MiB before .*? and "
                     r"(\d+) MiB now", (root / "README.md").read_text(), re.S)
    assert line, "the README's staging RAM line for Flux.1-dev"
    assert [int(g) for g in line.groups()] == [round(largest / MiB), round(before / MiB), round(now / MiB)]
    assert now == staging_ring_bytes(largest) == disk_tier.STAGING_CHUNKS * disk_tier.CHUNK_BYTES


def test_where_ram_leaves_no_choice_the_ring_is_of_small_chunks_read_by_every_reader(tmp_path, monkeypatch):
    """Auto over a mapped checkpoint (packing frees nothing) with RAM for less than the floor beside the blocks: every
    block must go to disk, and the ring it reads through is two small chunks (8 MiB, not 32), each read as one
    request per reader (the read-rate probe's request size); the output stays bitwise. With RAM to spare the same
    blocks on disk (host_store = disk) read through the usual ring."""
    from layerwise_offload.offload.disk import staging as disk_staging
    from layerwise_offload.offload.disk.budget import RAM_FLOOR_BYTES

    requests = []
    read = disk_staging.StagingRing._read_checkpoint
    monkeypatch.setattr(disk_staging.StagingRing, "_read_checkpoint",
                        staticmethod(lambda view, fd, offset: requests.append(len(view)) or read(view, fd, offset)))
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))
    for host_store, available, tight in (("auto", BLOCKS * 64 * MiB + RAM_FLOOR_BYTES // 2, True),
                                         ("disk", 2**40, False)):
        model = Model(4096)  # 64 MiB blocks
        with torch.no_grad():
            want = model(x)
        folder = tmp_path / host_store
        folder.mkdir()
        model = over_checkpoint(model, folder)
        requests.clear()
        manager = LayerwiseOffloadManager(list(model.blocks), "cpu", resident_layers=0, prefetch_size=1,
                                          host_store=host_store, environment=HostEnvironment(
                                              disk_folder=str(folder), available_host_bytes=lambda: available))
        manager.attach(model)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(x), want)
        stats = manager.stats()
        plan = manager.engine.host.tier_plan
        assert stats.disk_blocks == BLOCKS and plan.tight_ring == tight, plan
        chunk = disk_tier.TIGHT_CHUNK_BYTES if tight else disk_tier.CHUNK_BYTES
        assert stats.staging_bytes == plan.ring_bytes == disk_tier.STAGING_CHUNKS * chunk
        assert max(requests) == chunk // 4  # four readers: four requests in flight per chunk
        if tight:
            assert "RAM short: 3 blocks must go to disk" in plan.reason
        manager.detach()


def test_the_tight_ring_is_planned_only_where_ram_leaves_no_choice():
    """The plan's ring: the usual chunks where blocks go to disk only to keep auto's margin; the small ones where RAM
    forces them there; and for host_store = disk, the small ones only where the usual ring would not fit."""
    from layerwise_offload.offload.disk.budget import (PACKING_SLACK_BYTES, RAM_FLOOR_BYTES, RAM_MARGIN_BYTES,
                                                       plan_host_tiers)

    sizes = [64 * MiB] * 6

    def ring(disk, tight):
        return staging_ring_bytes(max((s for s, d in zip(sizes, disk) if d), default=0), None, tight)

    def plan(available, mode="auto"):
        return plan_host_tiers(sizes, [0] * len(sizes), mode, available, ring_bytes=ring,
                               chunk_bytes=disk_tier.CHUNK_BYTES, read_rate=lambda: (2e9, "given"))
    usual = disk_tier.STAGING_CHUNKS * disk_tier.CHUNK_BYTES
    margin_only = plan(sum(sizes) + RAM_MARGIN_BYTES - 2 * 64 * MiB + usual)  # two keep the margin, none is forced
    assert margin_only.disk_blocks == 2 and not margin_only.tight_ring
    assert margin_only.ring_bytes == usual
    forced = plan(sum(sizes) + RAM_FLOOR_BYTES - 2 * 64 * MiB)
    assert forced.tight_ring and forced.ring_bytes == disk_tier.STAGING_CHUNKS * disk_tier.TIGHT_CHUNK_BYTES
    assert "RAM short" in forced.reason
    assert not plan(2**40, "disk").tight_ring
    # Packing's slack (64 MiB) and its 16 MiB write chunk fit, the usual 32 MiB ring does not: the small one does.
    short = plan(PACKING_SLACK_BYTES + disk_tier.CHUNK_BYTES + MiB, "disk")
    assert short.tight_ring and short.shortfall() is None and short.peak_bytes == disk_tier.CHUNK_BYTES


def test_read_seconds_count_a_read_still_in_flight(tmp_path, monkeypatch):
    """The tier's read time (the Stats node's rate, a run's share in its log line) counts the busy period still
    running: a ring that keeps reading ahead may not fall idle for many steps, and counting only ended periods
    read 0 s for 4 GiB in bench_engine disk."""
    import threading
    import time

    tier = DiskTier(str(tmp_path))
    block = torch.ones(4 * MiB, dtype=torch.uint8)
    tier.write(0, block.numel(), [(0, block)])
    release = threading.Event()
    read_into = tier.file.read_into

    def held(view, offset):
        release.wait(30)
        return read_into(view, offset)
    monkeypatch.setattr(tier.file, "read_into", held)
    try:
        tier.read_ahead([0])
        time.sleep(0.3)
        in_flight = tier.read_seconds
        assert in_flight >= 0.3
    finally:
        release.set()
    out = DiskSource(tier, 0).read()
    assert torch.equal(out, block)
    assert tier.read_seconds >= in_flight
    tier.close()
