"""The host side on its own, without a manager: both tiers behind one interface, and the state it owns."""

import os
import time

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, OffloadConfig
from layerwise_offload.offload.blocks.params import BlockParameters
from layerwise_offload.offload.disk.tier import DiskTier
from layerwise_offload.offload.host.side import HostSide
from layerwise_offload.offload.host.tiers import HostTier, RamTier
from layerwise_offload.offload.host.packing import block_parameters


def host_side(tmp_path, host_store, available=2**40):
    """A host side over a toy model's blocks. Its settings and free RAM are read through ``knobs`` (here standing in
    for the manager's config and the OS), which a test may change as the manager and the OS would."""
    model = ToyTransformer()
    blocks = model.blocks_in_call_order()
    expected = [[param.detach().clone() for _, param in block_parameters(block)] for block in blocks]
    knobs = {"config": OffloadConfig(host_store=host_store, prefetch_size=1), "available": available}
    host = HostSide(blocks, torch.device("cpu"), lambda: knobs["config"], HostEnvironment(
        disk_folder=str(tmp_path), available_host_bytes=lambda: knobs["available"]))
    return model, blocks, expected, host, BlockParameters(blocks), knobs


def pack_all(host, params):
    packed = []

    def point_at_host_copy(index):
        packed.append(index)
        params.point_released(index, host.store, at_host=True, inference=host.inference_tensors)
    host.pack(host.outdated(params), params, point_at_host_copy)
    return packed


def weights_in(host, index, source):
    """Block ``index``'s parameters as the bytes of ``source`` (a tier's answer: a RAM block's host tensor, or a disk
    block's source, read here through the staging ring into a tensor of its own) describe them."""
    if not isinstance(source, torch.Tensor):
        source = source.read()
    return [view.clone() for view in host.store.layouts[index].weights_from(host.store.layouts[index].views(source))]


def test_both_tiers_answer_the_same_interface():
    for tier in (RamTier, DiskTier):
        assert all(callable(getattr(tier, name, None)) for name in ("holds", "read_ahead", "source", "copied",
                                                                     "pageable"))
    assert issubclass(RamTier, HostTier) and issubclass(DiskTier, HostTier)


@pytest.mark.parametrize("host_store", ["ram", "disk", "auto"])
def test_every_block_is_read_back_from_its_tier_byte_for_byte(tmp_path, host_store):
    model, blocks, expected, host, params, knobs = host_side(tmp_path, host_store)
    if host_store == "auto":
        # Short of RAM, and packing frees nothing (another holder keeps the weights, as a mapped checkpoint or a
        # shared storage would): the latest blocks go to disk, the rest stay in RAM.
        held = [param.detach() for block in blocks for param in block.parameters()]  # noqa: F841
        from layerwise_offload.offload.disk.cache_file import padded
        largest = max(sum(t.numel() * t.element_size() for t in block) for block in expected)
        # The margin, the staging ring (a few chunks, at most three toy blocks here) and about three blocks in RAM.
        knobs["available"] = 512 * 2**20 + 3 * padded(largest + 1024) + 3 * (largest + 1024)
    packed = pack_all(host, params)
    tiers = host.tiers()
    assert sorted(packed) == list(range(len(blocks)))
    assert packed == sorted(packed, key=lambda i: tiers[i] != "disk")  # the disk blocks first
    if host_store == "auto":
        assert "ram" in tiers and "disk" in tiers and tiers == sorted(tiers, key=["ram", "disk"].index)
    else:
        assert tiers == [host_store] * len(blocks)
    assert host.outdated(params) == []  # the parameters point at the copies: nothing to pack again
    for index in range(len(blocks)):
        tier = host.tier(index)
        assert isinstance(tier, HostTier) and tier.holds(index)
        assert isinstance(tier, DiskTier) == (tiers[index] == "disk") and host.reads_ahead(index) == (
            tiers[index] == "disk")
        upcoming = [i for i in range(index + 1, len(blocks))]
        got = weights_in(host, index, host.source(index, upcoming))
        host.copied(index, None)  # a finished copy: a disk block's staging buffer is free again
        assert all(torch.equal(a, b) for a, b in zip(got, expected[index]))
    with torch.no_grad():  # the blocks' own parameters view the host copies too
        assert torch.equal(model(torch.ones(1, 3, 32)), ToyTransformer()(torch.ones(1, 3, 32)))
    host.close()
    assert host.store is None and host.disk is None and host.ram is None
    assert not [name for name in os.listdir(tmp_path) if name.startswith("layerwise-offload-")]


def test_a_block_replaced_from_outside_is_the_only_one_packed_again(tmp_path):
    model, blocks, expected, host, params, knobs = host_side(tmp_path, "disk")
    pack_all(host, params)
    first = blocks[2]
    name, param = block_parameters(first)[0]
    new = torch.nn.Parameter(param.detach().clone() + 1)
    module_name, _, attr = name.rpartition(".")
    setattr(first.get_submodule(module_name) if module_name else first, attr, new)
    assert host.outdated(params) == [2]
    assert pack_all(host, params) == [2]
    got = weights_in(host, 2, host.source(2))
    host.copied(2, None)
    assert torch.equal(got[0], expected[2][0] + 1)
    host.close()


def test_a_new_host_store_setting_repacks_every_block_from_where_it_is(tmp_path):
    model, blocks, expected, host, params, knobs = host_side(tmp_path, "disk")
    pack_all(host, params)
    knobs["config"] = OffloadConfig(host_store="ram", prefetch_size=1)
    assert host.outdated(params) == list(range(len(blocks)))
    pack_all(host, params)  # read back from the old cache file, which is then deleted
    assert host.tiers() == ["ram"] * len(blocks) and host.disk is None
    assert not [name for name in os.listdir(tmp_path) if name.startswith("layerwise-offload-")]
    for index in range(len(blocks)):
        assert all(torch.equal(a, b) for a, b in zip(weights_in(host, index, host.source(index)), expected[index]))
    host.close()


@pytest.mark.parametrize("host_store", ["ram", "disk"])
def test_a_dropped_manager_frees_its_host_copies_by_reference_count_alone(tmp_path, host_store):
    """ComfyUI drops a model by reference count (its unload does not wait for the cycle collector): once the hooks
    are off, nothing among the manager's parts may point back at it, or its host store (the whole model in RAM)
    would outlive the model until some later collection, and a memory cgroup kills the server first."""
    import gc
    import weakref
    from layerwise_offload.offload import apply_layerwise_offload
    model = ToyTransformer()
    manager = apply_layerwise_offload(model.blocks_in_call_order(), "cpu", root=model, resident_layers=2,
                                      host_store=host_store, environment=HostEnvironment(
                                          disk_folder=str(tmp_path), available_host_bytes=lambda: 2**40))
    with torch.no_grad():
        model(torch.ones(1, 3, 32))
    assert manager.store.built
    refs = [weakref.ref(manager), weakref.ref(manager.store), weakref.ref(manager.engine.host)]
    manager.release_all()
    manager.engine.hooks.remove()  # what ComfyUI's unload does (the next load installs them again)
    gc.disable()
    try:
        del manager, model
        # A disk reader thread lets go of its job a moment after the job's result is set; no collector runs here.
        deadline = time.monotonic() + 5
        def cache_files():
            return [name for name in os.listdir(tmp_path) if name.startswith("layerwise-offload-")]
        while (any(ref() is not None for ref in refs) or cache_files()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [ref() is None for ref in refs] == [True] * len(refs)
        assert not cache_files()
    finally:
        gc.enable()


def _without_disk_tier_calls(monkeypatch):
    """The platform Windows and macOS users have: Python's os lacks preadv and posix_fadvise."""
    for name in ("preadv", "posix_fadvise"):
        monkeypatch.delattr(os, name, raising=False)


def test_without_the_calls_a_disk_tier_needs_auto_keeps_every_block_in_ram(tmp_path, monkeypatch):
    from layerwise_offload.offload.disk.cache_file import disk_tier_unsupported

    assert disk_tier_unsupported() is None  # this machine (Linux) has them
    _without_disk_tier_calls(monkeypatch)
    assert "os.preadv, os.posix_fadvise" in disk_tier_unsupported()
    model, blocks, expected, host, params, knobs = host_side(tmp_path, "auto", available=512 * 2**20 - 1)
    assert host.tiers() == ["ram"] * len(blocks)  # short of RAM, but there is no disk to go to
    pack_all(host, params)
    assert host.disk is None and host.tiers() == ["ram"] * len(blocks)
    for index in range(len(blocks)):
        assert all(torch.equal(a, b) for a, b in zip(weights_in(host, index, host.source(index)), expected[index]))
    assert not os.listdir(tmp_path)
    host.close()


def test_without_a_disk_tier_host_store_disk_is_refused_and_not_offered(tmp_path, monkeypatch):
    _without_disk_tier_calls(monkeypatch)
    _, _, _, host, params, knobs = host_side(tmp_path, "disk")
    with pytest.raises(ValueError, match=r"host_store = disk: the disk tier needs os\.preadv.*Use host_store = "
                                         r"auto or ram"):
        pack_all(host, params)
    _, _, _, host, params, knobs = host_side(tmp_path, "auto", available=1)
    message = host.shortfall()
    assert message and "host memory is short" in message and "host_store = disk" not in message, message
    assert "No disk tier here: the disk tier needs os.preadv" in message


def test_auto_keeps_every_block_in_ram_where_packing_frees_comfyuis_copies(tmp_path):
    """Packing a sole-owned block frees ComfyUI's copy of it: the all-RAM plan adds nothing but one block at its
    peak, so auto takes it even with less free than its usual margin (never more RAM than ComfyUI alone)."""
    model, blocks, expected, host, params, knobs = host_side(tmp_path, "auto")
    from layerwise_offload.offload.host.packing import plan_layout
    packed = [plan_layout(named).nbytes for named in params.named]  # each tensor on a page of its own
    padding = sum(packed) - sum(t.numel() * t.element_size() for block in expected for t in block)
    knobs["available"] = 64 * 2**20 + 2 * max(packed) + padding  # the slack, one block and the padding: not the margin
    pack_all(host, params)
    assert host.tiers() == ["ram"] * len(blocks)
    assert host.tier_plan.reason == ""  # grows by the alignment padding alone


def test_disk_blocks_are_written_in_chunks_and_the_ring_waits_for_the_first_read(tmp_path, monkeypatch):
    """Nothing block-sized is allocated while packing to disk: each block goes through one small write buffer,
    and the staging ring is allocated at the first read, once ComfyUI's copies are gone."""
    from layerwise_offload.offload.disk import tier as disk_tier
    monkeypatch.setattr(disk_tier, "CHUNK_BYTES", 4096)
    allocated = []
    original = disk_tier.aligned_buffer
    monkeypatch.setattr(disk_tier, "aligned_buffer", lambda nbytes: allocated.append(nbytes) or original(nbytes))
    model, blocks, expected, host, params, knobs = host_side(tmp_path, "disk")
    pack_all(host, params)
    sizes = [layout.nbytes for layout in host.store.layouts]
    assert max(sizes) > 4096 and allocated == [4096] and host.disk.ring == []
    for index in range(len(blocks)):
        got = weights_in(host, index, host.source(index))
        host.copied(index, None)
        assert all(torch.equal(a, b) for a, b in zip(got, expected[index]))
    assert len(host.disk.ring) == host.ring_size and host.disk._chunk is None
    host.close()
