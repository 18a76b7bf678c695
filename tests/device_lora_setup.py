"""A tiny Wan 2.1 behind the offload node with a random LoRA applied on the device, and that random LoRA, for the
ComfyUI tests to share (tests/comfy/test_device_lora_streams.py, test_device_lora_factors.py, test_host_ram.py,
...). Imports ComfyUI: use it from tests/comfy/ only, where tests/conftest.py has imported ComfyUI before
collecting."""

import torch

import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.controller import offload_model

__all__ = ["offloaded_with_lora", "random_lora", "tensors_of"]


def random_lora(patcher, seed=11, rank=3):
    """A LoRA in the generic ``<key>.lora_up.weight`` format over the blocks' 2-D weights (their Linears)."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for key, tensor in patcher.model.state_dict().items():
        if ".blocks." in key and key.endswith(".weight") and tensor.ndim == 2:
            stem = key[: -len(".weight")]
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
    return lora


def offloaded_with_lora(resident_layers):
    """A tiny Wan 2.1 with a random LoRA behind the node (pin off), sampled once and checked bitwise against
    ComfyUI's full load with the same LoRA; returns the offloaded patcher, its device-side LoRA and that output."""
    base = tiny_dits.build_wan21()
    lora = random_lora(base)
    patcher = offload_model(comfy.sd.load_lora_for_models(base, None, lora, 0.8, 0)[0], resident_layers, 1,
                            "leading", False)
    want = tiny_dits.sample(comfy.sd.load_lora_for_models(tiny_dits.build_wan21(), None, lora, 0.8, 0)[0])
    assert torch.equal(tiny_dits.sample(patcher), want)  # the same bits as ComfyUI's full load with the LoRA
    return patcher, patcher.attachments["layerwise_offload"].manager.engine.copier.transform, want


def tensors_of(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_of(v)
    elif isinstance(getattr(value, "weights", None), (tuple, list)):
        yield from tensors_of(value.weights)
