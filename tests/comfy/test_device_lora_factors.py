"""The device-side LoRA keeps its factors on the load device: uploaded once per tensor when the LoRA is set up
(on the compute stream), never again per block copy from pageable host memory, and ComfyUI's own patches are
left as they are (other clones and ComfyUI's unpatching use them)."""

import torch

from layerwise_offload.nodes.device_lora import DeviceLora, patches_on_device, scratch_bytes
from layerwise_offload.tests.device_lora_setup import offloaded_with_lora, tensors_of


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
