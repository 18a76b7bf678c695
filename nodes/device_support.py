"""What the node does on the device ComfyUI computes on, in the words the start-up line, the node and the Stats node
share: it offloads on CUDA devices (NVIDIA, and AMD through ROCm, which PyTorch names cuda too) and passes the model
through everywhere else, where there is no separate VRAM to save (the CPU, Apple's unified memory) or no tested path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..offload import format_bytes

CPU_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_CPU_LOOPBACK"


def cpu_loopback_requested() -> bool:
    return os.environ.get(CPU_LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class DeviceSupport:
    device_type: str
    offloads: bool
    reason: str  # "passed through: ..." where the node hands the model back unchanged; else what runs
    hint: str = ""  # what a person can do about it, or ""


def device_support(device) -> DeviceSupport:
    device = torch.device(device)
    kind = device.type
    if kind == "cuda":
        rocm = " (ROCm)" if getattr(torch.version, "hip", None) else ""
        return DeviceSupport(kind, True, f"offloading on {device}{rocm}")
    if kind == "cpu":
        if cpu_loopback_requested():
            return DeviceSupport(kind, True, f"offloading on the CPU ({CPU_LOOPBACK_ENV}=1, a test mode: "
                                             "copies stay in RAM, nothing is saved)")
        return DeviceSupport(kind, False, "passed through: ComfyUI runs on the CPU, nothing to offload",
                             f"start ComfyUI with {CPU_LOOPBACK_ENV}=1 to run the offload on the CPU as a test")
    if kind == "mps":
        return DeviceSupport(kind, False, "passed through: ComfyUI runs on mps (Apple GPU, memory shared with "
                                          "the CPU), nothing to offload")
    return DeviceSupport(kind, False, f"passed through: ComfyUI runs on {kind}; Layerwise Offload streams blocks "
                                      f"on CUDA devices only (NVIDIA, AMD with ROCm)")


def _device_name(device: torch.device) -> str:
    try:
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return f"{name}, {format_bytes(total)} VRAM"
    except Exception:  # noqa: BLE001 - a name is a nicety; the line must never stop the pack from loading
        return "GPU"


def startup_line(device) -> str:
    """The one line logged when the pack loads: the device found and what the node does there."""
    support = device_support(device)
    if not support.offloads:
        hint = f" ({support.hint})" if support.hint else ""
        what = support.reason.replace("passed through", "pass models through", 1)
        return f"[layerwise-offload] loaded; the Layerwise Offload node will {what}{hint}"
    if support.device_type == "cpu":
        return f"[layerwise-offload] loaded; {support.reason}"
    device = torch.device(device)
    return (f"[layerwise-offload] loaded; {device} ({_device_name(device)}): the Layerwise Offload node keeps the "
            f"first blocks of a diffusion transformer in VRAM and streams the rest from RAM")
