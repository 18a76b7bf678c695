"""Helpers the ComfyUI tests share (tests/comfy/): the LoRA of test_messy_states.py and test_failure_recovery.py,
and the device memory ComfyUI keeps free beside the tiny Wan's activations. Imports ComfyUI: use it from
tests/comfy/ only, where tests/conftest.py has imported ComfyUI before collecting."""

import functools

import torch

import comfy.model_management as mm

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.offload.planner import forward_activation_bytes

__all__ = ["lora", "overhead", "random_lora_with_text_embedding"]


def random_lora_with_text_embedding(patcher, seed, rank=2):
    """A LoRA in the generic ``<key>.lora_up.weight`` format over the blocks' Linear weights and one non-block."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for key, tensor in patcher.model.state_dict().items():
        if not key.endswith(".weight") or tensor.ndim != 2:
            continue
        if ".blocks." not in key and "text_embedding" not in key:
            continue
        stem = key[:-len(".weight")]
        lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
        lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
    return lora


@functools.lru_cache(maxsize=None)
def lora():
    return random_lora_with_text_embedding(tiny_dits.build_tiny("wan21"), seed=7)


def overhead():
    latent = tiny_dits.TINY_FAMILIES["wan21"].latent_shape
    activations = forward_activation_bytes("WanModel", 256, 2 * 8 * 8, batch=2 * latent[0], dtype_bytes=4).nbytes
    return int(mm.minimum_inference_memory()) + activations
