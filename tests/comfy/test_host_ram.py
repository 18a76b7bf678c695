"""Host RAM inside the real ComfyUI: its pin accounting, its RAM cache figure, LoRA backups, the node's refusal."""

import pytest
import torch

import comfy.model_management as mm
import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.host_ram import ComfyUIPinner
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.nodes.advice import block_tiers
from layerwise_offload.tests.device_lora_setup import random_lora

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister without a GPU: ComfyUI's own bookkeeping around them runs for real."""

    def __init__(self):
        self.live = {}

    def cudaHostRegister(self, ptr, size, flags):
        assert ptr not in self.live
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        assert ptr in self.live
        del self.live[ptr]
        return 0


def test_our_pinned_bytes_count_in_comfyuis_pinned_total(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 2**40)
    before = mm.TOTAL_PINNED_MEMORY
    model = tiny_dits.build_tiny("wan21")
    blocks = list(model.get_model_object("diffusion_model").blocks)
    manager = LayerwiseOffloadManager(blocks, "cpu", pin_memory=True, resident_layers=1, environment=HostEnvironment(
        pinner=ComfyUIPinner(), available_host_bytes=lambda: 2**40))
    manager.prepare()
    streamed = sum(manager.block_nbytes()[1:])
    assert mm.TOTAL_PINNED_MEMORY - before == streamed == sum(cudart.live.values())
    assert manager.stats().host_bytes_pinned == manager.stats().host_bytes_requested == streamed
    manager.detach()
    assert mm.TOTAL_PINNED_MEMORY == before and cudart.live == {}


def test_comfyuis_ram_cache_sees_the_host_store():
    offloaded = offload_model(tiny_dits.build_tiny("wan21"), 1, 1, "leading", True)
    tiny_dits.sample(offloaded, seed=3)
    store = controller_of(offloaded).manager.store.nbytes()
    assert offloaded.get_ram_usage() >= store > offloaded.model_size() - controller_of(offloaded).non_block_bytes()
    from layerwise_offload.offload import format_bytes
    figures = controller_of(offloaded).last_report.figures()  # the stats line and the stats node
    held = controller_of(offloaded).host_ram_bytes()
    assert held >= store and f"RAM {format_bytes(held)} held" in figures


def _available(monkeypatch, nbytes):
    monkeypatch.setattr("layerwise_offload.offload.host.tier_planning.available_host_bytes", lambda: nbytes)


def test_the_node_refuses_only_what_packing_really_adds(monkeypatch, tmp_path):
    """Packing frees ComfyUI's copy block by block: one block (and the slack) free is enough, far below the model
    size or the old 512 MiB margin. Where the copy is held elsewhere too, packing adds the whole model: refused
    with its settings and the disk tier named, and with host_store = disk the same host runs it, bitwise."""
    from layerwise_offload.offload.disk.budget import PACKING_SLACK_BYTES
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(tmp_path))
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    model = tiny_dits.build_tiny("wan21")
    block = sum(p.nbytes for p in model.get_model_object("diffusion_model").blocks[0].parameters())
    # + the CPU loopback's "VRAM", host RAM here: 2 residents and 2 streaming slots, which the host store leaves.
    _available(monkeypatch, PACKING_SLACK_BYTES + 2 * block + 4 * block)
    assert torch.equal(tiny_dits.sample(offload_model(model, 2, 1, "strided", True, "ram"), seed=3), want)
    mm.unload_all_models()

    # 16 blocks: the disk tier's staging ring (a few chunks, at most a block each) is well below the model.
    deep = dict(tiny_dits.WAN21_TINY_CONFIG, num_layers=16)
    want = tiny_dits.sample(tiny_dits._build("WAN21_T2V", deep, 0, torch.float32), seed=3, family="wan21")
    mm.unload_all_models()
    model = tiny_dits._build("WAN21_T2V", deep, 0, torch.float32)
    blocks = model.get_model_object("diffusion_model").blocks
    held = [p.data for p in blocks.parameters()]  # another holder of ComfyUI's copy (a backup, a sibling model)
    model_bytes = sum(t.nbytes for t in held)
    _available(monkeypatch, PACKING_SLACK_BYTES + model_bytes // 2)
    with pytest.raises(MemoryError) as refusal:
        offload_model(model, 2, 1, "strided", True, "ram")
    message = str(refusal.value)
    assert message.startswith("[layerwise-offload] host memory is short: packing the blocks needs "), message
    assert " MiB short (" in message, message
    assert ("Layerwise Offload (DiT): resident_layers=2, prefetch_size=1, residency_policy=strided, pin_memory=True, "
            "host_store=ram") in message
    for remedy in ("host_store = disk", "unload other models", "fp8/GGUF", "pin_memory off", "more RAM"):
        assert remedy in message
    assert "raising it does not help" in message
    offloaded = offload_model(model, 2, 1, "strided", True, "disk")
    assert torch.equal(tiny_dits.sample(offloaded, seed=3, family="wan21"), want)
    controller = controller_of(offloaded)
    assert controller.manager.engine.host.tiers() == ["disk"] * len(blocks)
    tiers = block_tiers(controller.manager.stats())  # what the Stats node's block map draws
    assert (tiers.count("R"), tiers.count("D"), tiers.count("S")) == (2, len(blocks) - 2, 0)
    figures = controller.last_report.figures()  # the run line and the stats text
    stored = sum(controller.manager.block_nbytes())
    assert f"{len(blocks)} blocks on disk: " in figures and "read per step at" in figures, figures
    assert controller.last_report.disk_bytes_read >= stored - sum(controller.manager.block_nbytes()[:2])
    from layerwise_offload.nodes.stats_view import stats_view
    text, _ = stats_view(offloaded)  # the packing's plan, with the disk's read rate (measured here)
    assert f"host store: {len(blocks)} of {len(blocks)} blocks on disk (host_store = disk; reading their " in text, text
    assert " per step where all are streamed, at " in text and "measured on " in text, text
    del held


@pytest.mark.parametrize("rate, fast", [("1kB/s", False), ("3GB/s", True)])
def test_auto_weighs_the_disks_read_rate_and_the_stats_node_says_why(monkeypatch, tmp_path, rate, fast):
    """Packing frees nothing (another holder keeps ComfyUI's copy) and every block in RAM would leave less than
    auto's margin free, but more than its floor: the blocks that keep the margin go to disk on a fast disk and stay
    in RAM on a slow one (the rate set by $LAYERWISE_OFFLOAD_DISK_READ_RATE), bitwise either way; the Stats node
    says which and why."""
    from layerwise_offload.nodes.stats_view import stats_view
    from layerwise_offload.offload.disk.budget import RAM_MARGIN_BYTES
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(tmp_path))
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_READ_RATE", rate)
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    model = tiny_dits.build_tiny("wan21")
    blocks = model.get_model_object("diffusion_model").blocks
    held = [p.data for p in blocks.parameters()]  # another holder of ComfyUI's copy: packing frees nothing
    _available(monkeypatch, RAM_MARGIN_BYTES + sum(t.nbytes for t in held) - 1)
    offloaded = offload_model(model, 1, 1, "leading", True, "auto")
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)
    tiers = controller_of(offloaded).manager.engine.host.tiers()
    on_disk = tiers.count("disk")
    assert tiers == ["ram"] * (len(blocks) - on_disk) + ["disk"] * on_disk and (on_disk > 0) == fast
    text, data = stats_view(offloaded)
    line = f"host store: {on_disk} of {len(blocks)} blocks on disk ("
    assert line in text and any(line in caption for caption in data["caption"]), text
    why = "disk fast enough" if fast else "disk too slow for auto's 512 MiB RAM margin"
    assert why in text and f"set by $LAYERWISE_OFFLOAD_DISK_READ_RATE" in text, text
    del held


def test_on_the_cpu_loopback_the_host_store_leaves_the_devices_ram(monkeypatch, tmp_path):
    """On the CPU loopback the "VRAM" (the residents and the streaming slots) is host RAM too: the host store plans
    with the RAM less what the armed plan will hold there, as it would beside a GPU holding them in VRAM. (It
    planned with all of it and filled the RAM the slots were then taken from: a 10.8 GiB Flux in a 5.2 GiB cgroup
    packed 4.3 GiB, then 1.3 GiB of slots, OOM-killed.)"""
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(tmp_path))
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    available = 2**30
    _available(monkeypatch, available)
    offloaded = offload_model(tiny_dits.build_tiny("wan21"), 1, 1, "leading", True, "auto")
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)
    manager = controller_of(offloaded).manager
    sizes = manager.block_nbytes()
    device = manager.device_bytes(manager.config)
    assert device == sizes[0] + 2 * max(sizes[1:])  # one resident, two slots of prefetch 1
    plan = manager.engine.host.tier_plan
    # weighed after packing, beside what packing leaves: packing's own peak is gone when the slots are taken
    assert plan.available_bytes == available and plan.device_share_bytes == device
    assert plan.free_after() == available - plan.growth_bytes - device
    assert manager.device_bytes() == device  # armed: held now, so a later plan no longer takes it off
    mm.unload_all_models()

    # A LoRA before the node: its math's scratch is "VRAM" beside the blocks too.
    lora_model = tiny_dits.build_tiny("wan21")
    patched, _ = comfy.sd.load_lora_for_models(lora_model, None, random_lora(lora_model, seed=7, rank=2), 0.8, 0)
    offloaded = offload_model(patched, 1, 1, "leading", True, "auto")
    tiny_dits.sample(offloaded, seed=3)
    controller = controller_of(offloaded)
    assert controller.device_lora_scratch > 0
    assert controller.manager.engine.host.tier_plan.device_share_bytes == (
        controller.manager.device_bytes(controller.manager.config) + controller.device_lora_scratch)
    mm.unload_all_models()


def test_lora_is_applied_on_the_device_and_the_host_keeps_the_weights_once():
    """A LoRA applied after a prompt without it: the host store keeps the unpatched weights only, ComfyUI's
    backups are views of them (no bytes of their own), and the output is ComfyUI's full load with the LoRA."""
    reference_model = tiny_dits.build_tiny("wan21")
    lora = random_lora(reference_model, seed=7, rank=2)
    reference, _ = comfy.sd.load_lora_for_models(reference_model, None, lora, 0.8, 0)
    want = tiny_dits.sample(reference, seed=3)
    mm.unload_all_models()
    model = tiny_dits.build_tiny("wan21")
    originals = {k: v.clone() for k, v in model.model.state_dict().items() if ".blocks." in k}
    offloaded = offload_model(model, 1, 1, "leading", True)
    plain = tiny_dits.sample(offloaded, seed=3)
    patched, _ = comfy.sd.load_lora_for_models(offloaded, None, lora, 0.8, 0)
    assert torch.equal(tiny_dits.sample(patched, seed=3), want)
    manager = controller_of(patched).manager
    assert manager.store.nbytes() == sum(manager.block_nbytes())  # each block once
    store = {b.untyped_storage().data_ptr() for b in manager.store.buffers}
    prefixes = controller_of(patched).block_keys
    for index, prefix in enumerate(prefixes):
        names = [name for name, _ in manager.blocks[index].named_parameters()]
        for name, view in zip(names, manager.store.weight_views(index)):
            assert torch.equal(view, originals[prefix + name]), f"{prefix + name}: the host store is not unpatched"
    lora_keys = {k for k in originals if f"{k[:-len('.weight')]}.lora_up.weight" in lora}
    controller = controller_of(patched)  # model_size() holds the LoRA math's float32 scratch beside the blocks
    scratch = 3 * 4 * max(originals[k].numel() for k in lora_keys)
    scratch += sum(t.numel() * t.element_size() for name, t in lora.items()  # the factors, kept on the device
                   if f"{name.split('.lora_')[0]}.weight" in lora_keys)
    assert patched.model_size() == controller.non_block_bytes() + controller._planned_block_bytes(1) + scratch
    assert lora_keys and set(patched.backup) == lora_keys
    for key, backup in patched.backup.items():
        # The original in the store itself: no second copy, and never a view of an older buffer.
        assert backup.weight.untyped_storage().data_ptr() in store, f"{key}: backup outside the host store"
        assert torch.equal(backup.weight, originals[key])
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), plain)  # the backups restore the originals


def test_force_patch_weights_bakes_the_lora_into_what_comfyui_reads():
    """ComfyUI asks for really patched weights (force_patch_weights) when it saves or merges a model: the blocks'
    weights then hold the LoRA, baked into the host store; the next ordinary run applies it on the device again."""
    reference_model = tiny_dits.build_tiny("wan21")
    lora = random_lora(reference_model, seed=7, rank=2)
    reference, _ = comfy.sd.load_lora_for_models(reference_model, None, lora, 0.8, 0)
    mm.load_models_gpu([reference], force_full_load=True)
    want = {k: v.clone() for k, v in reference.model.state_dict().items() if ".blocks." in k}
    want_out = tiny_dits.sample(reference, seed=3)
    mm.unload_all_models()
    model = tiny_dits.build_tiny("wan21")
    offloaded = offload_model(comfy.sd.load_lora_for_models(model, None, lora, 0.8, 0)[0], 1, 1, "leading", True)
    mm.load_models_gpu([offloaded], force_patch_weights=True)
    got = {k: v for k, v in offloaded.model.state_dict().items() if ".blocks." in k}
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key}: not ComfyUI's patched weight"
    assert controller_of(offloaded).manager.engine.copier.transform is None
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want_out)
    assert controller_of(offloaded).manager.engine.copier.transform is not None
