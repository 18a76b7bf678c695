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
# What each manager was made for: its blocks (by identity) and its device.
_SERVES: "weakref.WeakKeyDictionary[LayerwiseOffloadManager, tuple]" = weakref.WeakKeyDictionary()
# The device LoRA's scratch per manager (the latest load's): beside the blocks on the device, so on the CPU loopback
# in host RAM too, which the host store leaves free (shared_manager).
_LORA_SCRATCH: "weakref.WeakKeyDictionary[LayerwiseOffloadManager, int]" = weakref.WeakKeyDictionary()


def shared_manager(diffusion_model: nn.Module, discovered: DiscoveredBlocks, device: torch.device,
                   plan: OffloadConfig) -> LayerwiseOffloadManager:
    device = normalize_device(torch.device(device))
    manager = _MANAGERS.get(diffusion_model)
    # Another output streams this model by blocks where this one streams weight units, or the other way round:
    # one manager at a time holds the parameters
    if manager is None or _SERVES.get(manager) != (tuple(map(id, discovered.blocks)), device):
        if manager is not None:
            manager.detach()
        made: List[weakref.ref] = []  # the probe reads the manager weakly: ComfyUI frees it by reference count

        def loopback_device_bytes() -> int:
            this = made[0]() if made else None
            if this is None:
                return 0
            return max(0, this.device_bytes(this.config) - this.device_bytes()) + _LORA_SCRATCH.get(this, 0)
        manager = apply_layerwise_offload(discovered.blocks, device, plan, hooks=False,
                                          environment=comfyui_host_environment(
                                              loopback_device_bytes if device.type == "cpu" else None))
        made.append(weakref.ref(manager))
        _MANAGERS[diffusion_model] = manager
        _SERVES[manager] = (tuple(map(id, discovered.blocks)), device)
    return manager
