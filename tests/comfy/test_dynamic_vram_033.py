"""ComfyUI 0.33+ with dynamic VRAM, the default on NVIDIA: every loader -> node chain, through ComfyUI's own
``ModelPatcherDynamic`` and its real load path (tests/dynamic_vram_standin.py stands in for comfy-aimdo's device
set-up only).

What 0.33 did to the pack before: the Layerwise loader's dynamic model had no ``cached_patcher_init``, so the node's
takeover (``get_non_dynamic_delegate()``) raised "cached_patcher_init is not initialized"; with core loaders the
takeover reloaded the checkpoint and copied it into RAM. Now the node takes the very model ComfyUI loaded
(``clone(disable_dynamic=True, model_override=...)``): no reload, the weights stay the ones aimdo mapped.

References: without a LoRA, 0.33's own dynamic run of the same loader without the node. With a LoRA, ComfyUI's
non-dynamic run: a dynamic model applies LoRA only on the VBAR cast path, which needs a GPU (the stand-in's
docstring), so ComfyUI's other path is the reference there.
"""

import os

import pytest
import safetensors.torch
import torch

import comfy.model_management as mm
import comfy.sd
import comfy.utils
import folder_paths
import nodes as comfy_nodes

from layerwise_offload.devtools import peers, tiny_dits
from layerwise_offload.tests import dynamic_vram_standin
from layerwise_offload.nodes.loader import load_diffusion_model_layerwise, load_layerwise
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.tests.comfy_support import overhead
from layerwise_offload.tests.device_lora_setup import random_lora

if not dynamic_vram_standin.available():
    pytest.skip("this ComfyUI has no dynamic VRAM that core loaders use (0.33+)", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("comfy_loopback", "dynamic_vram")

LOADERS = ("unet", "checkpoint", "layerwise", "gguf")


@pytest.fixture
def dynamic_vram():
    with dynamic_vram_standin.dynamic_vram():
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two tiny Wan 2.1 experts as ComfyUI sees them: diffusion models, a checkpoint, GGUF (F16: lossless)."""
    root = tmp_path_factory.mktemp("dynamic_models")
    diffusion, checkpoints = root / "diffusion_models", root / "checkpoints"
    checkpoints.mkdir()
    for seed in (0, 1):
        path = tiny_dits.save_tiny_wan21(diffusion / f"expert{seed}.safetensors", seed=seed)
        weights = safetensors.torch.load_file(path)
        safetensors.torch.save_file({f"model.diffusion_model.{k}": v for k, v in weights.items()},
                                    os.fspath(checkpoints / f"expert{seed}.safetensors"))
    folder_paths.add_model_folder_path("diffusion_models", str(diffusion))
    folder_paths.add_model_folder_path("checkpoints", str(checkpoints))
    gguf = None
    if peers.peer_tarball() is not None:
        pytest.importorskip("gguf")
        from layerwise_offload.devtools.quantized_models import save_tiny_wan21_gguf
        gguf = peers.import_comfyui_gguf(root / "custom_nodes")
        for seed in (0, 1):
            save_tiny_wan21_gguf(diffusion / f"expert{seed}.gguf", "F16", seed=seed)
    return {"root": root, "gguf": gguf}


def load(files, loader, seed=0):
    """``loader``'s MODEL output for expert ``seed``, through the node class a workflow uses."""
    name = f"expert{seed}.safetensors"
    if loader == "unet":
        return comfy_nodes.UNETLoader().load_unet(name, "default")[0]
    if loader == "checkpoint":
        return comfy_nodes.CheckpointLoaderSimple().load_checkpoint(name)[0]
    if loader == "layerwise":
        return load_layerwise(name, "default")
    if files["gguf"] is None:
        pytest.skip("no ComfyUI-GGUF in shared/peers")
    return files["gguf"].nodes.UnetLoaderGGUF().load_unet(f"expert{seed}.gguf")[0]


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


@pytest.fixture
def reloads(monkeypatch):
    """Checkpoint reads (ComfyUI's file loading, the Layerwise loader's) while the list is being watched."""
    seen = []
    original_torch_file, original_layerwise = comfy.utils.load_torch_file, load_diffusion_model_layerwise

    def load_torch_file(*args, **kwargs):
        seen.append(args[0])
        return original_torch_file(*args, **kwargs)
    monkeypatch.setattr(comfy.utils, "load_torch_file", load_torch_file)
    return seen


def test_the_layerwise_loaders_dynamic_model_can_be_demoted_by_comfyui(files):
    """The failure as a user met it: ComfyUI's delegate of a dynamic model built without ``cached_patcher_init``
    raises; the Layerwise loader's model now carries one, and ComfyUI's delegate loads bitwise the same model."""
    path = os.fspath(files["root"] / "diffusion_models" / "expert0.safetensors")
    bare = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(path))
    assert bare.is_dynamic()
    with pytest.raises(RuntimeError, match="cached_patcher_init is not initialized"):
        bare.get_non_dynamic_delegate()
    model = load(files, "layerwise")
    assert model.is_dynamic()
    delegate = model.get_non_dynamic_delegate()
    assert not delegate.is_dynamic()
    want = tiny_dits.sample(load(files, "unet"), seed=3)
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(delegate, seed=3), want)


@pytest.mark.parametrize("loader", LOADERS)
def test_each_loader_chain_is_comfyuis_dynamic_run_with_no_reload(files, loader, reloads):
    model = load(files, loader)
    assert model.is_dynamic() or loader == "gguf"  # ComfyUI-GGUF builds its own (classic) patcher
    want = tiny_dits.sample(model, seed=3)  # 0.33's dynamic run, no node
    reloads.clear()
    for resident in (0, 2, -1):
        offloaded = offload_model(model, resident, 1, "leading", True)
        assert offloaded.model is model.model and not offloaded.is_dynamic()
        assert torch.equal(tiny_dits.sample(offloaded, seed=3), want), resident
        assert controller_of(offloaded).manager.stats().forwards > 0
    assert reloads == []
    assert torch.equal(tiny_dits.sample(model, seed=3), want)  # the same loaded model without the node again


@pytest.mark.parametrize("loader", ["unet", "checkpoint", "layerwise"])
def test_lora_before_or_after_the_node_is_comfyuis(files, loader):
    path = os.fspath(files["root"] / "diffusion_models" / "expert0.safetensors")
    dynamic_vram_standin.disable()
    try:
        plain = comfy.sd.load_diffusion_model(path)
        lora = random_lora(plain, seed=7, rank=2)
        want = tiny_dits.sample(comfy.sd.load_lora_for_models(plain, None, lora, 0.8, 0)[0], seed=3)
    finally:
        dynamic_vram_standin.enable()
    mm.unload_all_models()
    model = load(files, loader)
    before = offload_model(comfy.sd.load_lora_for_models(model, None, lora, 0.8, 0)[0], 2, 1, "leading", True)
    after = comfy.sd.load_lora_for_models(offload_model(model, 2, 1, "leading", True), None, lora, 0.8, 0)[0]
    for offloaded in (before, after):
        assert offloaded.model is model.model
        assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)


@pytest.mark.parametrize("loader", LOADERS)
def test_two_dynamic_experts_take_turns(files, loader):
    def run(experts):
        latent = tiny_dits.sample(experts[0], seed=6, steps=4)
        return tiny_dits.sample(experts[1], latent=latent, seed=6, steps=4, denoise=0.5)
    models = [load(files, loader, seed) for seed in (0, 1)]
    want = run(models)
    mm.unload_all_models()
    experts = [offload_model(model, 1, 1, "leading", True) for model in models]
    for _ in range(2):
        assert torch.equal(run(experts), want)
    assert all(expert.model is model.model for expert, model in zip(experts, models))


def test_comfyuis_block_prefetch_and_cuda_graphs_stay_off_for_the_node_model(files):
    """0.33's per-block prefetch queue and CUDA graphs (LTX2, MiniMax) run only where ``apply_model`` passes
    ``prefetch_dynamic_vbars``, i.e. for a dynamic patcher: the node's model never has both streaming at once."""
    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs["transformer_options"].get("prefetch_dynamic_vbars"))
    model = load(files, "unet")
    hook = model.model.diffusion_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        tiny_dits.sample(model, seed=3, steps=1)
        alone, seen[:] = set(seen), []
        tiny_dits.sample(offload_model(model, 2, 1, "leading", True), seed=3, steps=1)
    finally:
        hook.remove()
    assert alone == {True} and set(seen) == {False}


def test_streamed_tails_through_the_templates_chain(files, monkeypatch):
    """The templates' chain (Load Diffusion Model (Layerwise) -> node, auto) on 0.33's dynamic VRAM, with a card known
    to the timing model and a budget smaller than the model: auto streams tails, bitwise against 0.33's own
    dynamic run of the same model, and the same loaded model runs without the node after."""
    from layerwise_offload.nodes import run_planning
    from layerwise_offload.offload import TIMING_GPU_ENV
    from layerwise_offload.offload.timing import costs as gpu_costs

    card = gpu_costs.GPUS["RTX 4090 24GB"]
    slow = "RTX 4090 behind a 0.2 GB/s link"  # the tiny model's copies outweigh its host time, as a real model's do
    monkeypatch.setitem(gpu_costs.GPUS, slow, type(card)(slow, card.vram_bytes, 0.2e9, card.matmul_flops_per_s,
                                                         card.hbm_bytes_per_s))
    model = load(files, "layerwise")
    want = tiny_dits.sample(model, seed=3)  # 0.33's dynamic run, no node
    offloaded = offload_model(model, -1, 1, "auto", True)
    manager = controller_of(offloaded).manager
    free = overhead() + int(0.8 * sum(manager.block_nbytes()))  # ComfyUI's reserve and the activations first
    monkeypatch.setenv(TIMING_GPU_ENV, slow)
    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (free, free) if torch_free_too else free)
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)
    assert isinstance(manager.config.streamed_tail_bytes, tuple) and manager.engine.device_memory.heads
    assert manager.stats().bytes_copied_last_forward == sum(manager.block_tails())
    monkeypatch.undo()
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(model, seed=3), want)


@pytest.mark.parametrize("loader", LOADERS)
def test_weights_through_each_loader_chain(files, loader, weights_replan, reloads):
    """residency_policy weights over 0.33's dynamic models, from every loader: the node takes the model ComfyUI
    loaded (no reload), streams weight by weight within 60% of the units' bytes bitwise against 0.33's own dynamic
    run, and the same loaded model runs without the node after."""
    model = load(files, loader)
    want = tiny_dits.sample(model, seed=3)  # 0.33's dynamic run, no node
    reloads.clear()
    offloaded = offload_model(model, -1, 1, "weights", True)
    assert offloaded.model is model.model and not offloaded.is_dynamic()
    controller, plan = weights_replan(offloaded, want, lambda patcher: tiny_dits.sample(patcher, seed=3))
    assert controller.discovered.streams_weights and plan.resident_count < controller.manager.num_blocks
    assert reloads == []
    mm.unload_all_models()
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
