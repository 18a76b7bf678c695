"""The safetensors checkpoint as the disk tier's source: the header parser and mapping, where a tensor's bytes lie,
and disk blocks read from the file's extents (bitwise output, nothing written, the file left as it was)."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.disk.budget import RAM_MARGIN_BYTES
from layerwise_offload.offload.disk.checkpoint import CheckpointError, CheckpointFile, is_mapped, locate
from layerwise_offload.offload.disk.tier import staging_ring_bytes

NUM_BLOCKS = 7


def write_toy(path, seed=0):
    model = ToyTransformer(seed=seed)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def mapped_toy(path):
    """A ToyTransformer whose parameters and buffers are the checkpoint's mapped tensors (no copy)."""
    model = ToyTransformer()
    checkpoint = CheckpointFile(str(path))
    model.load_state_dict(checkpoint.state_dict(), assign=True)
    return model, checkpoint


def reference(path, x):
    """The output without offload, of a model loaded with the file's layouts (every weight contiguous)."""
    model = ToyTransformer()
    model.load_state_dict(load_file(str(path)), assign=True)
    with torch.no_grad():
        return model(x)


def cache_files(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("layerwise-offload-"))


@pytest.fixture
def toy_file(tmp_path):
    return write_toy(tmp_path / "toy.safetensors")


@pytest.fixture
def sample_input():
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def test_the_parser_reads_every_dtype_and_the_metadata_and_maps_without_copying(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(11, dtype=torch.int64),
               "d": torch.randn(4, 4).to(torch.float8_e4m3fn), "e": torch.randn(2, 3).half(), "f": torch.ones(0)}
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    checkpoint = CheckpointFile(str(path))
    assert checkpoint.metadata == {"format": "pt", "note": "x"}
    loaded = checkpoint.state_dict()
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8))
    where = locate(loaded["a"])
    assert where == (str(path.resolve()), checkpoint.tensors["a"].offset, 60)
    with open(path, "rb") as raw:
        raw.seek(where[1])
        assert raw.read(60) == tensors["a"].numpy().tobytes()
    assert is_mapped(loaded["c"]) and locate(loaded["c"][1:4])[1] == checkpoint.tensors["c"].offset + 8


def test_conversions_are_not_file_backed(toy_file):
    checkpoint = CheckpointFile(str(toy_file))
    weight = checkpoint.tensor("embed.weight")
    assert locate(weight) is not None
    assert locate(weight.t()) is None  # not contiguous: its bytes are not in the file's order
    assert locate(weight.to(torch.bfloat16)) is None and locate(weight.clone()) is None
    assert locate(torch.nn.Parameter(weight, requires_grad=False)) == locate(weight)
    assert not is_mapped(weight.clone())


@pytest.mark.parametrize("damage, fault", [
    (lambda head, body: b"\x05\x00", "shorter than the 8-byte"),
    (lambda head, body: struct.pack("<Q", 10**9) + body, "does not fit the file"),
    (lambda head, body: struct.pack("<Q", 4) + b"nope" + body, "not JSON"),
    (lambda head, body: _header({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}) + body,
     "do not match its size"),
    (lambda head, body: _header({"x": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}) + body,
     "cannot read"),
])
def test_a_broken_header_is_an_error_naming_the_file_and_the_fault(tmp_path, damage, fault):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(damage(b"", bytes(16)))
    with pytest.raises(CheckpointError, match=fault) as error:
        CheckpointFile(str(path))
    assert "broken.safetensors" in str(error.value)


def _header(entries):
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("resident, prefetch, policy", [(0, 1, "leading"), (2, 2, "strided"), (NUM_BLOCKS, 1, "leading")])
def test_disk_blocks_read_from_the_checkpoint_write_nothing_and_give_the_same_output(
        tmp_path, toy_file, sample_input, resident, prefetch, policy):
    before = (toy_file.read_bytes(), os.stat(toy_file).st_mtime_ns)
    want = reference(toy_file, sample_input)
    model, _ = mapped_toy(toy_file)
    folder = tmp_path / "cache"
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=resident,
                                      prefetch_size=prefetch, policy=policy, host_store="disk",
                                      environment=HostEnvironment(
                                          disk_folder=str(folder), available_host_bytes=lambda: 2**40))
    manager.attach(model)
    read = []
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(sample_input), want)
            read.append(manager.stats().disk_bytes_read)
    stats = manager.stats()
    assert stats.disk_blocks == stats.disk_checkpoint_blocks == NUM_BLOCKS
    assert stats.host_bytes == 0 and stats.disk_bytes == sum(manager.block_nbytes())
    streamed = sum(manager.block_nbytes()[i] for i in manager.schedule.streamed_blocks)
    assert read[3] - read[2] == read[2] - read[1] == streamed  # bytes read per step = the disk blocks' stored bytes
    assert not folder.exists() or cache_files(folder) == []  # nothing was written
    manager.detach()
    # Detached, the blocks hold the file's tensors again: a model bigger than RAM is never copied into it.
    assert all(locate(p) is not None for b in model.blocks_in_call_order() for p in b.parameters())
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
    assert (toy_file.read_bytes(), os.stat(toy_file).st_mtime_ns) == before  # the checkpoint is never written


def test_a_converted_block_and_a_baked_one_fall_back_to_the_cache_file(tmp_path, toy_file, sample_input):
    model, _ = mapped_toy(toy_file)
    blocks = model.blocks_in_call_order()
    with torch.no_grad():
        blocks[2].mix.weight = torch.nn.Parameter(blocks[2].mix.weight * 1.5, requires_grad=False)  # converted
    want_model = ToyTransformer()
    want_model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with torch.no_grad():
        want = want_model(sample_input)
    manager = LayerwiseOffloadManager(blocks, "cpu", resident_layers=0, prefetch_size=1, host_store="disk",
                                      released_params="host", environment=HostEnvironment(
                                          disk_folder=str(tmp_path / "cache"), available_host_bytes=lambda: 2**40))
    manager.attach(model)
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
    assert sorted(manager.engine.host.disk.extents) == [i for i in range(NUM_BLOCKS) if i != 2]
    assert len(cache_files(tmp_path / "cache")) == 1
    # A bake swaps a block's parameters for new tensors (ComfyUI's patch_weight_to_device): that block is
    # repacked, into the cache file.
    names = [name for name, _ in blocks[4].named_parameters()]
    with torch.no_grad():
        patched = manager.store.weight_views(4)[names.index("mix.weight")] + 0.25
        blocks[4].mix.weight = torch.nn.Parameter(patched.clone(), requires_grad=False)
        want_model.blocks_in_call_order()[4].mix.weight.copy_(patched)
        want = want_model(sample_input)
    assert manager.prepare() == [4]
    assert 4 not in manager.engine.host.disk.extents and manager.engine.host.disk.holds(4)
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
    manager.detach()


def test_auto_packs_ram_blocks_from_the_mapping_and_reads_the_rest_from_the_file(tmp_path, toy_file, sample_input):
    want = reference(toy_file, sample_input)
    model, _ = mapped_toy(toy_file)
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=0, prefetch_size=1,
                                      host_store="auto", environment=HostEnvironment(
                                          disk_folder=str(tmp_path / "cache"), available_host_bytes=lambda: free))
    sizes = manager.block_nbytes()
    # Room for three blocks in RAM beyond the margin and the staging ring: mapped weights free no RAM when packed.
    free = RAM_MARGIN_BYTES + 3 * max(sizes) + staging_ring_bytes(max(sizes))
    manager.attach(model)
    with torch.no_grad():
        assert torch.equal(model(sample_input), want)
    tiers = manager.engine.host.tiers()
    assert tiers == ["ram"] * 3 + ["disk"] * 4
    assert sorted(manager.engine.host.disk.extents) == [i for i, t in enumerate(tiers) if t == "disk"]
    assert all(not is_mapped(manager.store.buffers[i]) for i, t in enumerate(tiers) if t == "ram")
    manager.detach()


def test_a_few_converted_bytes_stay_in_ram_and_the_rest_of_the_block_still_reads_the_file(
        tmp_path, toy_file, sample_input):
    """A quantized layer's scale converted on load, say: the block is still read from the checkpoint and the
    converted entry (here the 64-byte gate of block 3) is copied from RAM into the staging buffer with each read."""
    model, _ = mapped_toy(toy_file)
    blocks = model.blocks_in_call_order()
    with torch.no_grad():
        blocks[3].gate = torch.nn.Parameter(blocks[3].gate * 2, requires_grad=False)
    want_model = ToyTransformer()
    want_model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with torch.no_grad():
        want = want_model(sample_input)
    manager = LayerwiseOffloadManager(blocks, "cpu", resident_layers=0, prefetch_size=1, host_store="disk",
                                      environment=HostEnvironment(
        disk_folder=str(tmp_path / "cache"), available_host_bytes=lambda: 2**40))
    manager.attach(model)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(sample_input), want)
    assert sorted(manager.engine.host.disk.extents) == list(range(NUM_BLOCKS)) and list(manager.engine.host.disk.kept) == [3]
    assert not (tmp_path / "cache").exists() or cache_files(tmp_path / "cache") == []
    manager.detach()
