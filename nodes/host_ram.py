"""ComfyUI's side of the host memory: the host environment the manager is given (``comfyui_host_environment``:
ComfyUI's pinner, what its pinned-memory cap leaves, its temp folder for the disk tier), its pinned-memory
accounting, and its LoRA backups.

- Pinning goes through ComfyUI's own ``pin_memory`` / ``unpin_memory`` (0.3.75 and later), so the
  store's page-locked bytes count in ComfyUI's ``TOTAL_PINNED_MEMORY`` and its ``MAX_PINNED_MEMORY``
  cap (``--disable-pinned-memory``) holds for them as for ComfyUI's own weights. On 0.33+ that call
  first evicts dynamic models' pins to make room, so those are not counted against the store.
- ComfyUI's backup of an unpatched weight is the Parameter the LoRA replaced; once the manager has
  packed it, that Parameter is a view into the block's host buffer, and would keep the whole old
  buffer alive next to the repacked one. The backup is replaced by a compact copy of its own bytes.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import torch
from torch import nn

import comfy.model_management

from ..offload import HostEnvironment, clear_cuda_error, weight_parts


class ComfyUIPinner:
    """Page-locks through ComfyUI, which registers with cudaHostRegister and books the bytes."""

    def register(self, tensor: torch.Tensor) -> bool:
        # 0.3.75 pins only Parameters (and QuantizedTensor); a Parameter over the buffer shares its memory.
        granted = bool(comfy.model_management.pin_memory(_as_parameter(tensor)))
        if not granted:
            clear_cuda_error()  # 0.3.75 leaves a refused cudaHostRegister's error for the next kernel launch
        return granted

    def unregister(self, tensor: torch.Tensor) -> None:
        comfy.model_management.unpin_memory(tensor)


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    with torch.inference_mode(tensor.is_inference()):
        return nn.Parameter(tensor, requires_grad=False)


def comfyui_disk_folder() -> str:
    """The disk tier's folder unless $LAYERWISE_OFFLOAD_DISK_DIR names one: ComfyUI's temp folder (on the install's
    disk; ComfyUI empties it at start and exit, so a killed server's file does not outlive the next start)."""
    import folder_paths
    return os.path.join(folder_paths.get_temp_directory(), "layerwise-offload")


def comfyui_pinner() -> Optional[ComfyUIPinner]:
    """ComfyUI's pinner where this ComfyUI has one and pins at all (an accelerator, pinning not disabled)."""
    mm = comfy.model_management
    if not (hasattr(mm, "pin_memory") and hasattr(mm, "unpin_memory")):
        return None
    if getattr(mm, "MAX_PINNED_MEMORY", 0) <= 0 or mm.is_device_cpu(mm.get_torch_device()):
        return None
    return ComfyUIPinner()


def comfyui_pin_cap_left(own_pinned_bytes: int) -> Optional[int]:
    """What ComfyUI's ``MAX_PINNED_MEMORY`` leaves for this store: the cap less what everything else pinned.
    Our own pins go through ComfyUI and count in its ``TOTAL_PINNED_MEMORY``, so they are added back; other
    models' pinned weights are not ours to take. None where this ComfyUI keeps no such total."""
    mm = comfy.model_management
    cap = getattr(mm, "MAX_PINNED_MEMORY", None)
    if cap is None:
        return None
    others = int(getattr(mm, "TOTAL_PINNED_MEMORY", 0)) - int(own_pinned_bytes) - evictable_pinned_bytes()
    return max(0, int(cap) - max(0, others))


def evictable_pinned_bytes() -> int:
    """Pinned bytes ComfyUI gives up to make room for a new pin: 0.33+'s ``pin_memory`` first evicts dynamic
    models' registrations (``ensure_pin_registerable``), so those do not hold this store's share. Older ComfyUIs
    evict nothing."""
    mm = comfy.model_management
    if not hasattr(mm, "ensure_pin_registerable"):
        return 0
    total = 0
    for loaded in list(getattr(mm, "current_loaded_models", [])):
        patcher = getattr(loaded, "model", None)
        if patcher is not None and patcher.is_dynamic() and hasattr(patcher, "pinned_memory_size"):
            total += int(patcher.pinned_memory_size())
    return total


def comfyui_pinned_memory_cap(own_pinned_bytes: int = 0) -> Optional[int]:
    """What ComfyUI's limit on pinned host memory leaves for this model (``--disable-pinned-memory`` gives 0)."""
    if comfy.model_management.is_device_cpu(comfy.model_management.get_torch_device()):
        return None
    return comfyui_pin_cap_left(own_pinned_bytes)


def comfyui_host_environment(loopback_device_bytes: Optional[Callable[[], int]] = None) -> HostEnvironment:
    """The host as ComfyUI runs it: its pinner and pinned-memory cap, its temp folder for the disk tier, and on the
    CPU loopback what the "device" will take from host RAM (``loopback_device_bytes``: the armed plan's slots and
    residents beyond what it holds now, and the device LoRA's scratch)."""
    pinner = comfyui_pinner()
    extra = {} if pinner is None else {"pinner": pinner}
    return HostEnvironment(pin_cap=comfyui_pinned_memory_cap, disk_folder=comfyui_disk_folder(),
                           device_bytes_from_host=loopback_device_bytes, **extra)


def compact_backups(patcher, keys: Iterable[str], buffers: Iterable[Optional[torch.Tensor]]) -> int:
    """Replace backups of ``keys`` that view one of ``buffers`` by compact pageable copies; returns bytes copied.
    A quantized weight (a tensor subclass) is copied part by part and rebuilt as the same subclass."""
    storages = {b.untyped_storage().data_ptr() for b in buffers if b is not None}
    copied = 0
    for key in keys:
        backup = patcher.backup.get(key)
        if backup is None:
            continue
        parts = weight_parts(key, backup.weight)
        if not any(t.untyped_storage().data_ptr() in storages for _, t in parts.tensors):
            continue
        weight = backup.weight
        with torch.inference_mode(weight.is_inference()):
            copies = {name: t.detach().clone() for name, t in parts.tensors}
            compact = weight.detach().clone() if parts.rebuild is None else parts.rebuild(copies)
        patcher.backup[key] = backup._replace(weight=compact)
        copied += sum(c.numel() * c.element_size() for c in copies.values())
    return copied


def packing_progress_bar():
    """ComfyUI's progress bar for packing the host store (a large model takes a while)."""
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if total < 8:
            return
        if bar is None:
            import comfy.utils
            bar = comfy.utils.ProgressBar(total)
        bar.update_absolute(done, total)
    return update
