"""GGUF checkpoints through city96's ComfyUI-GGUF (unmodified, from shared/peers), in-process, bitwise.

``UnetLoaderGGUF -> LayerwiseOffload -> sampling`` equals ``UnetLoaderGGUF -> sampling`` for F16, Q8_0, Q5_0 and
Q4_0 blocks, with and without a LoRA (ComfyUI-GGUF applies it at dequantization time from ``patches`` it hangs on
the weights), and the bytes on the wire per forward are the streamed blocks' quantized bytes. The real-server
variant is tests/e2e/test_gguf_server.py.
"""

import os

import pytest
import torch

import comfy.model_management as mm
import comfy.sd
import folder_paths

from layerwise_offload.offload.host.packing import ENTRY_ALIGNMENT_BYTES
from layerwise_offload.devtools import peers, tiny_dits
from layerwise_offload.devtools.quantized_models import GGUF_TYPES, save_tiny_wan21_gguf
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin

pytest.importorskip("gguf", reason="the gguf package (a dev package of scripts/setup_env.sh) is not installed")
if peers.peer_tarball() is None:
    pytest.skip(f"no shared/peers/{peers.GGUF_TARBALL} beside the repository (set LAYERWISE_OFFLOAD_SHARED)",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("comfy_loopback")

NUM_BLOCKS = 4
# Bytes per 32-value GGML block: F16 2 per value; Q8_0 2 + 32; Q5_0 2 + 4 + 16; Q4_0 2 + 16.
BYTES_PER_32 = {"F16": 64, "Q8_0": 34, "Q5_0": 22, "Q4_0": 18}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """ComfyUI-GGUF imported as ComfyUI would load it, and a folder of tiny Wan 2.1 GGUF files it can see."""
    root = tmp_path_factory.mktemp("gguf")
    module = peers.import_comfyui_gguf(root / "custom_nodes")
    models = root / "diffusion_models"
    for qtype in GGUF_TYPES:
        save_tiny_wan21_gguf(models / f"tiny_wan21_{qtype}.gguf", qtype, seed=0)
    folder_paths.add_model_folder_path("diffusion_models", str(models))
    return module


def load(gguf, qtype):
    (patcher,) = gguf.nodes.UnetLoaderGGUF().load_unet(f"tiny_wan21_{qtype}.gguf")
    return patcher


def with_lora(patcher, seed=5):
    """A rank-2 LoRA on two linears of every block, through ComfyUI's LoRA loader (LoraLoaderModelOnly)."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for index in range(NUM_BLOCKS):
        for name in ("self_attn.o", "ffn.0"):
            stem = f"diffusion_model.blocks.{index}.{name}"
            weight = patcher.model.get_parameter(stem + ".weight")
            out_features, in_features = weight.tensor_shape
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(out_features, 2, generator=gen)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(2, in_features, generator=gen)
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    assert len(patched.patches) == 2 * NUM_BLOCKS
    return patched


def weight_kinds(patcher):
    blocks = patcher.model.diffusion_model.blocks
    return {(type(b.self_attn.q.weight).__name__, getattr(b.self_attn.q.weight, "tensor_type", None).name)
            for b in blocks}


# Every type from RAM; from disk the bytes take the same path whatever the type, so one type there.
@pytest.mark.parametrize("qtype,host_store", [(qtype, "ram") for qtype in GGUF_TYPES] + [("Q4_0", "disk")])
def test_gguf_offloaded_equals_comfyui_gguf(gguf, qtype, host_store, monkeypatch, tmp_path):
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(tmp_path))
    base = load(gguf, qtype)
    assert weight_kinds(base) == {("GGMLTensor", qtype)}
    want = tiny_dits.sample(base, seed=3, family="wan21")
    mm.unload_all_models()
    want_lora = tiny_dits.sample(with_lora(load(gguf, qtype)), seed=3, family="wan21")
    mm.unload_all_models()
    assert not torch.equal(want, want_lora)  # the LoRA matters

    model = load(gguf, qtype)
    for lora, expected in ((False, want), (True, want_lora)):
        for resident, policy in ((0, "leading"), (2, "strided")):
            offloaded = offload_model(with_lora(model) if lora else model, resident, 1, policy, True, host_store)
            assert torch.equal(tiny_dits.sample(offloaded, seed=3, family="wan21"), expected), (lora, resident)
            assert offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager.engine.host.tiers() == (
                [host_store] * NUM_BLOCKS)
            assert weight_kinds(offloaded) == {("GGMLTensor", qtype)}
            manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
            stats = manager.stats()
            streamed = [i for i in range(NUM_BLOCKS) if not manager.schedule.resident[i]]
            assert stats.copies_last_forward == len(streamed)
            assert stats.bytes_copied_last_forward == sum(manager.block_nbytes()[i] for i in streamed)
            if host_store == "disk":
                # ComfyUI-GGUF maps the .gguf read-only and its weights are views of it: the disk tier reads the
                # blocks from that file, byte for byte, and writes no cache file.
                disk = manager.engine.host.disk
                assert sorted(disk.extents) == list(range(NUM_BLOCKS))
                assert {path for extents in disk.extents.values() for path, *_ in extents} == {
                    os.path.realpath(folder_paths.get_full_path("diffusion_models", f"tiny_wan21_{qtype}.gguf"))}
                assert not [name for name in os.listdir(tmp_path) if name.startswith("layerwise-offload-")]
            mm.unload_all_models()


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_packed_block_is_the_gguf_size(gguf, qtype):
    model = load(gguf, qtype)
    offloaded = offload_model(model, 0, 1, "leading", True)
    tiny_dits.sample(offloaded, seed=3, family="wan21", steps=1)
    manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
    block = model.model.diffusion_model.blocks[1]
    quantized = sum(p.numel() for n, p in block.named_parameters() if p.ndim == 2 and n.endswith("weight"))
    values = sum(p.tensor_shape.numel() for n, p in block.named_parameters() if p.ndim == 2 and n.endswith("weight"))
    others = sum(p.numel() * p.element_size() for n, p in block.named_parameters()
                 if not (p.ndim == 2 and n.endswith("weight")))
    assert quantized == values // 32 * BYTES_PER_32[qtype] // (2 if qtype == "F16" else 1)
    packed = quantized * (2 if qtype == "F16" else 1) + others
    padding = len(manager.store.layouts[1].entries) * ENTRY_ALIGNMENT_BYTES  # each entry on a page of its own
    assert packed <= manager.block_nbytes()[1] <= packed + padding
    mm.unload_all_models()


def test_comfyui_gguf_never_copies_offloaded_blocks_out_of_its_mapping(gguf, monkeypatch, tmp_path):
    """ComfyUI-GGUF's own ``load()`` "releases the mmap" after a partial load to a GPU: every weight still on the
    host is moved to the GPU and back, a fresh copy in anonymous RAM. Through the node that must never run, or the
    disk tier's blocks would land in RAM on a GPU (where a CPU run cannot show it, since there ``load_device ==
    offload_device`` skips the release). ComfyUI's load reaches the patcher through ``partially_load``, which the
    node's patcher overrides; the same load of the plain GGUF model does call GGUF's ``load()`` (the control)."""
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(tmp_path))
    patcher_class = gguf.nodes.GGUFModelPatcher
    calls = []
    for name in ("load", "pin_weight_to_device"):
        original = getattr(patcher_class, name)

        def recorded(self, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, type(self).__name__))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(patcher_class, name, recorded)

    tiny_dits.sample(load(gguf, "Q8_0"), seed=3, family="wan21", steps=1)
    mm.unload_all_models()
    assert ("load", "GGUFModelPatcher") in calls  # the control: ComfyUI alone goes through GGUF's load()
    calls.clear()

    model = load(gguf, "Q8_0")
    mapped = {name: param.data_ptr() for name, param in model.model.diffusion_model.blocks.named_parameters()}
    offloaded = offload_model(model, 1, 1, "leading", True, "disk")
    tiny_dits.sample(offloaded, seed=3, family="wan21", steps=1)
    assert calls == []
    manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
    assert sorted(manager.engine.host.disk.extents) == list(range(NUM_BLOCKS))  # every block's host copy: the .gguf
    mm.unload_all_models()
    # After the unload the blocks are the file's tensors again, where ComfyUI-GGUF left them.
    assert {name: param.data_ptr() for name, param in model.model.diffusion_model.blocks.named_parameters()} == mapped


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_gguf_streamed_weight_by_weight_equals_comfyui_gguf(gguf, lora, weights_replan):
    """residency_policy weights over ComfyUI-GGUF's own Linear modules: each GGMLTensor weight streams on its own in
    its stored bytes, the LoRA applied on the device, bitwise ComfyUI-GGUF's output, with 60% of the blocks' bytes
    free."""
    qtype = "Q4_0"
    want = tiny_dits.sample(with_lora(load(gguf, qtype)) if lora else load(gguf, qtype), seed=3, family="wan21")
    mm.unload_all_models()
    model = load(gguf, qtype)
    offloaded = offload_model(with_lora(model) if lora else model, -1, 1, "weights", True)
    controller, plan = weights_replan(offloaded, want, lambda m: tiny_dits.sample(m, seed=3, family="wan21"))
    manager = controller.manager
    assert weight_kinds(offloaded) == {("GGMLTensor", qtype)}
    assert manager.num_blocks > NUM_BLOCKS  # units, not blocks
    mm.unload_all_models()
