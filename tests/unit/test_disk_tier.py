"""The disk tier on the CPU loopback: bitwise output from the cache file, bytes read per forward, the file's life."""

import os

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer, toy_and_reference
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.disk.cache_file import CacheFile, DiskTierError, padded, remove_stale_files

NUM_BLOCKS = 7


@pytest.fixture
def sample_input():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def reference(x):
    with torch.no_grad():
        return ToyTransformer()(x)


def offloaded(folder, available=lambda: 2**40, **settings):
    model = ToyTransformer()
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", **settings, environment=HostEnvironment(
        disk_folder=str(folder), available_host_bytes=available))
    return model, manager.attach(model)


def cache_files(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("layerwise-offload-"))


@pytest.mark.parametrize("released", ["placeholder", "host"])
@pytest.mark.parametrize("resident, prefetch, policy", [(0, 1, "leading"), (2, 1, "leading"), (3, 2, "strided"),
                                                        (NUM_BLOCKS, 1, "leading")])
def test_disk_blocks_give_the_same_output_and_read_their_stored_bytes_once_per_forward(
        tmp_path, sample_input, resident, prefetch, policy, released):
    model, manager = offloaded(tmp_path, resident_layers=resident, prefetch_size=prefetch, policy=policy,
                               host_store="disk", released_params=released)
    want = reference(sample_input)
    read = []
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(sample_input), want)
            read.append(manager.stats().disk_bytes_read)
    stats = manager.stats()
    assert manager.engine.host.tiers() == ["disk"] * NUM_BLOCKS
    assert stats.disk_blocks == NUM_BLOCKS and stats.host_bytes == 0
    assert stats.disk_bytes == sum(manager.block_nbytes())
    sizes = manager.block_nbytes()
    streamed = sum(sizes[i] for i in manager.schedule.streamed_blocks)
    residents = sum(sizes[i] for i in manager.schedule.resident_blocks)
    # Residents are read once when the plan is armed; streamed blocks once per forward (steady state: the reads
    # ahead wrap into the next forward, so each forward reads the next one's first blocks).
    assert read[0] >= residents + streamed
    assert read[2] - read[1] == read[3] - read[2] == streamed
    assert stats.disk_reads * 0 == 0 and stats.bytes_copied_last_forward == streamed
    assert cache_files(tmp_path) and all(name.endswith(".bin") for name in cache_files(tmp_path))
    manager.detach()
    assert cache_files(tmp_path) == []  # deleted with the store
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)  # the blocks hold ordinary weights again


def test_released_host_views_of_disk_blocks_are_the_weights_and_writes_never_reach_the_file(tmp_path, sample_input):
    """Released disk blocks view a private mapping of the file: the model runs without the hooks, and a write
    through those views (ComfyUI's hooks write weights in place) stays in the process."""
    model, manager = offloaded(tmp_path, resident_layers=0, host_store="disk", released_params="host")
    with torch.no_grad():
        model(sample_input)
    manager.engine.hooks.remove()
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
        first = manager.blocks[0].mix.weight
        before = manager.engine.host.disk.source(0).read()  # the block's bytes as the disk tier reads them
        first.add_(1.0)
        assert torch.equal(manager.engine.host.disk.source(0).read(), before)


def test_auto_keeps_every_block_in_ram_where_packing_adds_nothing(tmp_path, sample_input):
    from layerwise_offload.offload.disk.budget import RAM_MARGIN_BYTES
    free = [RAM_MARGIN_BYTES - 1]  # the host's free RAM as the manager reads it, changed below
    model, manager = offloaded(tmp_path, available=lambda: free[0], resident_layers=1, host_store="auto")
    # Packing into RAM frees ComfyUI's copy (the toy's weights are sole-owned): one byte short of the margin, every
    # block still stays in RAM, which takes no more than ComfyUI's copy did.
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
    assert manager.engine.host.tiers() == ["ram"] * NUM_BLOCKS and cache_files(tmp_path) == []
    free[0] = 2**40
    manager.replan(host_store="ram")  # another setting: every block back in RAM, the file gone
    with torch.no_grad():
        assert torch.equal(model(sample_input), reference(sample_input))
    assert manager.engine.host.tiers() == ["ram"] * NUM_BLOCKS and cache_files(tmp_path) == []


def test_call_order_other_than_list_order_reads_what_runs(tmp_path):
    order = [6, 5, 4, 3, 2, 1, 0, 0, 3]
    model, x, want = toy_and_reference(order, 3, 4)
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=1, host_store="disk",
                                      environment=HostEnvironment(
        disk_folder=str(tmp_path)))
    manager.attach(model)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
    manager.detach()


def test_repacking_a_disk_block_rewrites_it(tmp_path, sample_input):
    model, manager = offloaded(tmp_path, resident_layers=0, host_store="disk", released_params="host")
    with torch.no_grad():
        model(sample_input)
    block = model.single_blocks[1]
    block.mix.weight = torch.nn.Parameter(block.mix.weight.data * 2)  # a "bake": new object, new values
    assert manager.prepare() == [4]
    want_model = ToyTransformer()
    want_model.single_blocks[1].mix.weight.data *= 2
    with torch.no_grad():
        assert torch.equal(model(sample_input), want_model(sample_input))


def test_an_unwritable_folder_is_an_error_naming_it(tmp_path, sample_input):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    model, manager = offloaded(blocked / "sub", resident_layers=0, host_store="disk")
    with torch.no_grad(), pytest.raises(DiskTierError, match="file-not-folder.*host_store = ram"):
        model(sample_input)


def test_a_disk_too_small_is_an_error_naming_the_folder(tmp_path):
    with pytest.raises(DiskTierError, match=f"{tmp_path}.*GiB free"):
        CacheFile(str(tmp_path), expected_bytes=2**62)


def test_files_of_dead_processes_are_removed_and_partial_files_never_read(tmp_path):
    dead = 2**22 + 12345  # above pid_max's default: no such process
    for name in (f"layerwise-offload-{dead}-abc123.bin", f"layerwise-offload-{dead}-abc124.partial",
                 f"layerwise-offload-{os.getpid()}-abc125.bin", "unrelated.bin"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_files(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([f"layerwise-offload-{os.getpid()}-abc125.bin", "unrelated.bin"])
    cache = CacheFile(str(tmp_path))
    assert cache.path.endswith(".partial")  # written under a temporary name until finished
    cache.append(torch.arange(padded(10), dtype=torch.uint8))
    cache.finish()
    assert cache.path.endswith(".bin") and os.path.exists(cache.path)
    cache.close()
    assert not os.path.exists(cache.path)


def test_a_failed_read_is_raised_once_and_leaves_the_tier_usable(tmp_path, sample_input, monkeypatch):
    """An I/O error on a read reaches the forward that needed the block; the unload after it does not raise it
    again (ComfyUI unloads outside its error handling: a second raise there stopped its prompt worker), and the
    next forward reads the block again, bitwise."""
    model, manager = offloaded(tmp_path, resident_layers=0, host_store="disk")
    with torch.no_grad():
        want = model(sample_input)
    manager.release_all()
    tier = manager.engine.host.disk
    real_read = tier.file.read_into
    failures = [OSError(5, "Input/output error")]

    def failing_read(buffer, offset):
        if failures:
            raise failures.pop()
        return real_read(buffer, offset)
    monkeypatch.setattr(tier.file, "read_into", failing_read)
    with torch.no_grad(), pytest.raises(OSError, match="Input/output error"):
        model(sample_input)
    manager.release_all()  # what ComfyUI's unload runs: no second raise
    tier.settle_reads()
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
