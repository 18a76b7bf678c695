"""What the machine around a manager provides: the pinner, the pin cap, the free-RAM probe, the disk tier's folder."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

DISK_DIR_ENV = "LAYERWISE_OFFLOAD_DISK_DIR"


def default_disk_folder(fallback: Optional[str] = None) -> str:
    """Where the disk tier writes: $LAYERWISE_OFFLOAD_DISK_DIR (read when the file is made), else ``fallback``,
    else the system temp folder."""
    return os.environ.get(DISK_DIR_ENV) or fallback or os.path.join(tempfile.gettempdir(), "layerwise-offload")


DEVICE_DEFAULT = "device default"


@dataclass(frozen=True)
class HostEnvironment:
    """What the machine around a manager provides: given once, when the manager is made, and never changed.

    ``pinner`` page-locks host buffers (None: never); by default the device's own (none for the CPU).
    ``pin_cap`` is an outside cap on page-locked bytes (ComfyUI's own limit): given the bytes this manager holds
    page-locked now, the most it may hold (None: no cap). It is asked each time the pinning is chosen, since other
    models pin and unpin between runs.
    ``available_host_bytes`` reads the host memory free to this process (None: unknown); by default the OS's
    figure, its memory cgroup included (:func:`~.ram.available_host_bytes`).
    ``disk_folder`` is where the disk tier's cache file goes unless $LAYERWISE_OFFLOAD_DISK_DIR says otherwise
    (None: the system temp folder; see :func:`default_disk_folder`).
    ``device_bytes_from_host`` (a device whose memory is host RAM, as the CPU loopback's): what the device will
    take beyond what it holds now (the armed plan's slots and residents, scratch beside them). The host store plans
    with that much less, as it would beside a GPU holding them in VRAM; otherwise it fills the RAM the slots are
    then allocated from, and the process runs out of memory once they are.
    """

    pinner: Any = DEVICE_DEFAULT
    pin_cap: Optional[Callable[[int], Optional[int]]] = None
    available_host_bytes: Optional[Callable[[], Optional[int]]] = None
    disk_folder: Optional[str] = None
    device_bytes_from_host: Optional[Callable[[], int]] = None

    def cache_folder(self) -> str:
        """Where the disk tier's cache file goes now (the environment variable is read at each call)."""
        return default_disk_folder(self.disk_folder)
