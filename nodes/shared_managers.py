"""One offload manager per loaded diffusion model, shared by every node output that offloads it: the host store is
built once, and each output applies its own plan when it runs."""

from __future__ import annotations

import weakref
from typing import List

import torch
from torch import nn

from ..offload import LayerwiseOffloadManager, OffloadConfig, apply_layerwise_offload, normalize_device
from .discovery import DiscoveredBlocks
from .host_ram import comfyui_host_environment

_MANAGERS: "weakref.WeakKeyDictionary[nn.Module, LayerwiseOffloadManager]" = weakref.WeakKeyDictionary()
# The device LoRA's scratch per manager (the latest load's): beside the blocks on the device, so on the CPU loopback
# in host RAM too, which the host store leaves free (shared_manager).
_LORA_SCRATCH: "weakref.WeakKeyDictionary[LayerwiseOffloadManager, int]" = weakref.WeakKeyDictionary()


def shared_manager(diffusion_model: nn.Module, discovered: DiscoveredBlocks, device: torch.device,
                   plan: OffloadConfig) -> LayerwiseOffloadManager:
    manager = _MANAGERS.get(diffusion_model)
    # Another output streams this model by blocks where this one streams weight units, or the other way round:
    # one manager at a time holds the parameters
    same_modules = manager is not None and len(manager.blocks) == len(discovered.blocks) and all(
        a is b for a, b in zip(manager.blocks, discovered.blocks))
    if manager is None or not same_modules or manager.device != normalize_device(torch.device(device)):
        if manager is not None:
            manager.detach()
        made: List[weakref.ref] = []  # the probe reads the manager weakly: ComfyUI frees it by reference count

        def loopback_device_bytes() -> int:
            this = made[0]() if made else None
            if this is None:
                return 0
            return max(0, this.planned_device_bytes() - this.device_bytes()) + _LORA_SCRATCH.get(this, 0)
        loopback = normalize_device(torch.device(device)).type == "cpu"
        manager = apply_layerwise_offload(discovered.blocks, device, plan, hooks=False,
                                          environment=comfyui_host_environment(
                                              loopback_device_bytes if loopback else None))
        made.append(weakref.ref(manager))
        _MANAGERS[diffusion_model] = manager
    return manager
