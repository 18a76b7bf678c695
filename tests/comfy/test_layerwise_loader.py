"""Load Diffusion Model (Layerwise) in the real ComfyUI: ComfyUI's own model, bitwise equal to UNETLoader's, its
unconverted weights left in the file; behind the offload node the disk blocks are read from the checkpoint."""

import os

import pytest
import safetensors.torch
import torch

import comfy.model_management as mm
import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.loader import load_diffusion_model_layerwise, model_options_for
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.offload.disk.checkpoint import locate
from layerwise_offload.tests.device_lora_setup import random_lora

pytestmark = pytest.mark.usefixtures("comfy_loopback")

BLOCK_COUNT = 4  # the tiny Wan's blocks


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory):
    """Two tiny Wan 2.1 files (fp32, two seeds: Wan 2.2's two experts) and one with fp8 blocks (what ComfyUI's
    weight_dtype fp8_e4m3fn makes of every block tensor)."""
    folder = tmp_path_factory.mktemp("loader_models")
    paths = [tiny_dits.save_tiny_wan21(folder / f"expert{seed}.safetensors", seed=seed) for seed in (0, 1)]
    sd = safetensors.torch.load_file(paths[0])
    fp8 = {k: (v.to(torch.float8_e4m3fn) if k.startswith("blocks.") else v) for k, v in sd.items()}
    paths.append(os.fspath(folder / "fp8.safetensors"))
    safetensors.torch.save_file(fp8, paths[2])
    return paths


@pytest.fixture
def disk_dir(tmp_path, monkeypatch):
    folder = tmp_path / "disk"
    monkeypatch.setenv("LAYERWISE_OFFLOAD_DISK_DIR", str(folder))
    return folder


def manager_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager


def written(folder):
    return sorted(os.listdir(folder)) if folder.exists() else []


def file_backed(patcher):
    return {k for k, v in patcher.model.diffusion_model.state_dict().items() if locate(v) is not None}


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_e4m3fn"])
def test_the_model_is_comfyuis_bitwise_and_keeps_unconverted_weights_in_the_file(wan_files, weight_dtype):
    options = model_options_for(weight_dtype)
    want_model = comfy.sd.load_diffusion_model(wan_files[0], model_options=dict(options))
    want_sd = want_model.model.diffusion_model.state_dict()
    want = tiny_dits.sample(want_model, seed=2)
    mm.unload_all_models()
    before = (open(wan_files[0], "rb").read(), os.stat(wan_files[0]).st_mtime_ns)
    model = load_diffusion_model_layerwise(wan_files[0], dict(options))
    assert type(model.model) is type(want_model.model)
    got_sd = model.model.diffusion_model.state_dict()
    assert got_sd.keys() == want_sd.keys()
    for key in want_sd:
        assert got_sd[key].dtype == want_sd[key].dtype and torch.equal(got_sd[key], want_sd[key]), key
    backed = file_backed(model)
    if weight_dtype == "default":  # fp32 on the CPU, as stored: every block weight stays in the file
        assert all(key in backed for key in want_sd if key.startswith("blocks.") and want_sd[key].ndim == 2)
    else:  # ComfyUI casts the weights to fp8: those are converted, so not the file's
        assert not any(got_sd[k].dtype == torch.float8_e4m3fn for k in backed)
    assert torch.equal(tiny_dits.sample(model, seed=2), want)  # ComfyUI alone runs it: the same bits
    assert (open(wan_files[0], "rb").read(), os.stat(wan_files[0]).st_mtime_ns) == before


def test_fp8_weights_stay_in_the_file_and_stream_from_it_bitwise(wan_files, disk_dir):
    options = model_options_for("fp8_e4m3fn")
    want = tiny_dits.sample(comfy.sd.load_diffusion_model(wan_files[2], model_options=dict(options)), seed=4)
    mm.unload_all_models()
    model = load_diffusion_model_layerwise(wan_files[2], dict(options))
    block_keys = {k for k in model.model.diffusion_model.state_dict() if k.startswith("blocks.")}
    assert block_keys <= file_backed(model)  # stored as fp8, kept as fp8: left in the file
    offloaded = offload_model(model, 0, 1, "leading", False, "disk")
    assert torch.equal(tiny_dits.sample(offloaded, seed=4), want)
    stats = manager_of(offloaded).stats()
    assert stats.disk_checkpoint_blocks == BLOCK_COUNT and written(disk_dir) == []


def test_behind_the_offload_node_disk_blocks_read_the_checkpoint_and_nothing_is_written(wan_files, disk_dir):
    """host_store disk: every streamed block is read from the checkpoint, its stored bytes once per step. (auto's
    mix of RAM blocks packed from the mapping and disk blocks read from it: tests/unit/test_checkpoint_source.py.)"""
    want = tiny_dits.sample(comfy.sd.load_diffusion_model(wan_files[0]), seed=5, steps=3)
    mm.unload_all_models()
    model = load_diffusion_model_layerwise(wan_files[0], {})
    offloaded = offload_model(model, 1, 1, "leading", False, "disk")
    read = []
    for _ in range(2):
        assert torch.equal(tiny_dits.sample(offloaded, seed=5, steps=3), want)
        read.append((manager_of(offloaded).stats().disk_bytes_read, manager_of(offloaded).stats().forwards))
    manager = manager_of(offloaded)
    stats = manager.stats()
    assert manager.engine.host.tiers() == ["disk"] * BLOCK_COUNT and stats.host_bytes == 0
    assert stats.disk_checkpoint_blocks == BLOCK_COUNT and written(disk_dir) == []
    streamed = sum(manager.block_nbytes()[i] for i in manager.schedule.streamed_blocks)
    assert read[1][0] - read[0][0] == (read[1][1] - read[0][1]) * streamed > 0


def test_lora_on_the_device_keeps_the_file_source_and_a_bake_falls_back_to_the_cache_file(wan_files, disk_dir):
    lora = random_lora(comfy.sd.load_diffusion_model(wan_files[0]), seed=7, rank=2)
    reference, _ = comfy.sd.load_lora_for_models(comfy.sd.load_diffusion_model(wan_files[0]), None, lora, 0.8, 0)
    want = tiny_dits.sample(reference, seed=3)
    mm.unload_all_models()
    model = load_diffusion_model_layerwise(wan_files[0], {})
    offloaded = offload_model(comfy.sd.load_lora_for_models(model, None, lora, 0.8, 0)[0], 0, 1, "leading", False,
                              "disk")
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)
    manager = manager_of(offloaded)
    assert manager.engine.copier.transform is not None  # the device LoRA: the host keeps the file's weights
    assert manager.stats().disk_checkpoint_blocks == BLOCK_COUNT and written(disk_dir) == []
    mm.load_models_gpu([offloaded], force_patch_weights=True)  # ComfyUI wants real patched weights: a bake
    assert manager.stats().disk_checkpoint_blocks == 0 and manager.stats().disk_blocks == BLOCK_COUNT
    assert any(name.endswith(".bin") for name in written(disk_dir))
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)


def test_two_experts_alternate_with_neither_ones_streamed_blocks_in_ram(wan_files, disk_dir):
    """Wan 2.2's high- and low-noise experts: two loaders, two offload nodes, the sampler switching between them."""
    def run(models):
        latent = tiny_dits.sample(models[0], seed=6, steps=4)
        return tiny_dits.sample(models[1], latent=latent, seed=6, steps=4, denoise=0.5)
    want = run([comfy.sd.load_diffusion_model(path) for path in wan_files[:2]])
    mm.unload_all_models()
    experts = [offload_model(load_diffusion_model_layerwise(path, {}), 0, 1, "leading", False, "disk")
               for path in wan_files[:2]]
    for _ in range(2):
        assert torch.equal(run(experts), want)
    for expert in experts:
        stats = manager_of(expert).stats()
        assert stats.host_bytes == 0 and stats.disk_checkpoint_blocks == BLOCK_COUNT
    assert written(disk_dir) == []


def test_quantized_tensor_weights_from_the_loader_stream_bitwise(tmp_path, disk_dir):
    """ComfyUI's mixed-precision fp8 file: its layers wrap the file's fp8 data and scale in a QuantizedTensor
    without a copy, so those blocks too are read from the checkpoint, parts and all."""
    from layerwise_offload.devtools.quantized_models import save_tiny_wan21_fp8_mixed
    path = save_tiny_wan21_fp8_mixed(tmp_path / "mixed.safetensors")
    want = tiny_dits.sample(comfy.sd.load_diffusion_model(path), seed=8)
    mm.unload_all_models()
    model = load_diffusion_model_layerwise(path, {})
    weight = model.model.diffusion_model.blocks[0].self_attn.q.weight
    assert type(weight.data) is not torch.Tensor  # a QuantizedTensor, as UNETLoader makes it
    offloaded = offload_model(model, 0, 1, "leading", False, "disk")
    assert torch.equal(tiny_dits.sample(offloaded, seed=8), want)
    stats = manager_of(offloaded).stats()
    assert stats.disk_checkpoint_blocks == BLOCK_COUNT and written(disk_dir) == []


def test_the_run_line_says_which_disk_blocks_come_from_the_checkpoint(wan_files, disk_dir):
    offloaded = offload_model(load_diffusion_model_layerwise(wan_files[1], {}), 0, 1, "leading", False, "disk")
    tiny_dits.sample(offloaded, seed=1, steps=2)
    figures = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].last_report.figures()
    assert f"{BLOCK_COUNT} blocks on disk ({BLOCK_COUNT} from the checkpoint file)" in figures, figures


def test_where_python_lacks_the_disk_tiers_calls_the_loader_and_the_node_run_from_ram(wan_files, disk_dir,
                                                                                       monkeypatch):
    """Windows and macOS: no os.pread, os.preadv, os.posix_fadvise. The loader still maps the file (a
    copy-on-write mapping, both OSes have it) and is ComfyUI's model bitwise; the node's auto keeps every block in
    RAM (nothing written), and host_store = disk is refused when the prompt is queued, naming the reason."""
    from layerwise_offload.nodes.offload_node import host_store_problem

    want = tiny_dits.sample(comfy.sd.load_diffusion_model(wan_files[0]), seed=5)
    mm.unload_all_models()
    for name in ("pread", "preadv", "posix_fadvise"):
        monkeypatch.delattr(os, name, raising=False)
    model = load_diffusion_model_layerwise(wan_files[0], {})
    assert file_backed(model)  # left in the file
    assert torch.equal(tiny_dits.sample(model, seed=5), want)
    offloaded = offload_model(model, 1, 1, "leading", False, "auto")
    assert torch.equal(tiny_dits.sample(offloaded, seed=5), want)
    assert manager_of(offloaded).engine.host.tiers() == ["ram"] * BLOCK_COUNT and written(disk_dir) == []
    assert "host_store = disk: the disk tier needs os.preadv, os.posix_fadvise" in host_store_problem("disk")
    assert host_store_problem("auto") is None and host_store_problem("ram") is None
