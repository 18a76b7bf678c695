"""The device-side LoRA keeps its factors on the load device: uploaded once per tensor when the LoRA is set up
(on the compute stream), never again per block copy from pageable host memory, and ComfyUI's own patches are
left as they are (other clones and ComfyUI's unpatching use them)."""

import torch

import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.device_lora import DeviceLora, patches_on_device, scratch_bytes
from layerwise_offload.nodes.controller import offload_model


def random_lora(patcher, rank=3):
    generator = torch.Generator().manual_seed(11)
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


def test_factors_are_uploaded_once_and_comfyuis_patches_stay(monkeypatch):
    monkeypatch.setenv("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    patcher, transform, _ = offloaded_with_lora(0)
    controller = patcher.attachments["layerwise_offload"]
    assert isinstance(transform, DeviceLora) and transform.plan
    originals = [t for entries in transform.plan.values() for _, _, patches in entries
                 for p in patches for t in tensors_of(p[1])]
    assert len(originals) == 2 * sum(len(e) for e in transform.plan.values())  # up and down per patched weight

    # On another device the factors move there once; the plan ComfyUI's patches came from is untouched.
    moved, nbytes = patches_on_device(transform.plan, torch.device("meta"))
    on_meta = [t for entries in moved.values() for _, _, patches in entries for p in patches for t in tensors_of(p[1])]
    assert len(on_meta) == len(originals) and all(t.device.type == "meta" for t in on_meta)
    assert all(t.device.type == "cpu" for t in originals)
    assert nbytes == sum(t.numel() * t.element_size() for t in originals)
    assert scratch_bytes(controller.discovered.blocks, transform.plan) > nbytes  # the footprint counts them
    assert transform.factor_bytes == 0  # the CPU loopback's load device is the host: nothing was copied
