"""Page-locking host buffers exactly, and giving freed host memory back to the OS.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds
every request up to a power of two (a 648 MiB block pins 1 GiB) and keeps freed blocks for reuse
instead of returning them. The store therefore allocates ordinary pageable buffers of the exact
size and page-locks them in place (``cudaHostRegister``, what ComfyUI itself does), so the bytes
locked are the bytes streamed, and unlocking gives them back with the buffer.

A *pinner* does the locking: ``register(tensor) -> bool`` and ``unregister(tensor)``. The CUDA one
calls the runtime; ComfyUI's (nodes/) goes through ComfyUI's own pin/unpin so its pinned total
counts ours; tests pass a recording stand-in, so the ledger logic runs without a GPU.

A pinned buffer that a device copy reads from may be refilled only once that copy has finished reading it:
``copy_finished`` is that rule, for the disk tier's staging ring and the resident bounce buffers alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import weakref
from typing import Dict, Optional, Protocol

import torch

from ..formatting import format_bytes

log = logging.getLogger("layerwise_offload")

__all__ = ["Pinner", "CudaHostRegisterPinner", "clear_cuda_error", "PinLedger", "copy_finished", "default_pinner",
           "return_freed_host_memory", "trim_after_next_collection"]


class Pinner(Protocol):
    def register(self, tensor: torch.Tensor) -> bool: ...

    def unregister(self, tensor: torch.Tensor) -> None: ...


class CudaHostRegisterPinner:
    """Page-locks an existing host tensor with ``cudaHostRegister`` (portable across devices)."""

    PORTABLE = 1  # cudaHostRegisterPortable: usable as pinned by every CUDA context, as ComfyUI registers

    def register(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        granted = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, self.PORTABLE)) == 0
        if not granted:
            clear_cuda_error()
        return granted

    def unregister(self, tensor: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _runtime_last_error():
    """``cudaGetLastError`` of the CUDA runtime torch already loaded (never a second copy: the error is that
    library's per-thread state), or None where it cannot be reached (torch's bindings lack it)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        except OSError:
            continue
        return lib.cudaGetLastError
    return None


_LAST_ERROR = []


def clear_cuda_error() -> Optional[int]:
    """Take the error a refused ``cudaHostRegister`` leaves as the runtime's last error, and return it.

    Left set, the next unrelated kernel launch in this thread reports it (torch checks
    ``cudaGetLastError`` after every launch) and raises far from the cause; ComfyUI 0.3.75's own
    ``pin_memory`` leaves it too. Reads it straight from the runtime where that is loaded; otherwise
    a one-element launch consumes it (no stream sync either way). None when there was nothing to clear.
    """
    if not _LAST_ERROR:
        _LAST_ERROR.append(_runtime_last_error())
    reader = _LAST_ERROR[0]
    if reader is not None:
        code = int(reader())
        return code or None
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError as error:  # torch.AcceleratorError is one: the stale error, consumed by the launch check
        log.debug("[layerwise-offload] cleared a CUDA error left by a refused page-lock: %s", error)
        return -1
    return None


def default_pinner(device: torch.device) -> Optional[Pinner]:
    """The pinner for copies to ``device``: CUDA (and ROCm's CUDA API) registers; anything else pins nothing."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaHostRegisterPinner()
    return None


class PinLedger:
    """Which host buffers are page-locked now, and how many bytes were asked for and granted.

    Keyed by the buffer's data pointer; the ledger holds the buffer itself, so a registered range
    can never be freed (and reused by the allocator) while the driver still has it locked. When
    the owner goes away without :meth:`unpin_all`, a finalizer unlocks what is left.
    """

    def __init__(self, pinner: Optional[Pinner]):
        self.pinner = pinner
        self._pinned: Dict[int, torch.Tensor] = {}
        self.bytes_requested = 0  # page-locked bytes asked for, now (held or refused)
        self._requested: Dict[int, int] = {}
        self._finalizer: Optional[weakref.finalize] = None

    def watch(self, owner) -> None:
        """Unlock everything when ``owner`` is garbage collected."""
        if self._finalizer is None:
            self._finalizer = weakref.finalize(owner, _owner_dropped, self.pinner, self._pinned)

    @property
    def bytes_pinned(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._pinned.values())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._pinned

    def pin(self, tensor: torch.Tensor, register: bool = True) -> bool:
        """Page-lock ``tensor`` (a contiguous host buffer); False when there is no pinner or it refused.

        ``register=False`` only books the request (the owner knows the pinner refuses now).
        """
        key = tensor.data_ptr()
        if key in self._pinned:
            return True
        nbytes = tensor.numel() * tensor.element_size()
        self._requested[key] = nbytes
        self.bytes_requested = sum(self._requested.values())
        if self.pinner is None or nbytes == 0 or not register:
            return False
        try:
            granted = bool(self.pinner.register(tensor))
        except RuntimeError as error:
            log.warning("[layerwise-offload] page-locking %s failed (%s)", format_bytes(nbytes), error)
            granted = False
        if granted:
            self._pinned[key] = tensor
        return granted

    def unpin(self, tensor: torch.Tensor) -> None:
        """Unlock ``tensor`` if it is locked and forget its request. Call with the copy stream quiet."""
        key = tensor.data_ptr()
        self._requested.pop(key, None)
        self.bytes_requested = sum(self._requested.values())
        held = self._pinned.pop(key, None)
        if held is not None:
            self.pinner.unregister(held)

    def unpin_all(self) -> None:
        _unpin_all(self.pinner, self._pinned)
        self._requested.clear()
        self.bytes_requested = 0


def copy_finished(handle, wait: bool) -> bool:
    """Whether the copy behind ``handle`` (a backend's ``CopyHandle``; None: no copy) has finished reading its source;
    ``wait``: block the host until it has. What lets a host buffer be refilled."""
    event = getattr(handle, "done", None)
    if event is None:
        return True
    if wait:
        event.synchronize()
        return True
    return bool(event.query())


def _owner_dropped(pinner: Optional[Pinner], pinned: Dict[int, torch.Tensor]) -> None:
    _unpin_all(pinner, pinned)
    trim_after_next_collection()


def _unpin_all(pinner: Optional[Pinner], pinned: Dict[int, torch.Tensor]) -> None:
    for tensor in list(pinned.values()):
        try:
            pinner.unregister(tensor)
        except Exception as error:  # at interpreter exit the runtime may be gone already
            log.debug("[layerwise-offload] unpinning at teardown failed: %s", error)
    pinned.clear()


_LIBC = None
_TRIM_PENDING = False


def trim_after_next_collection() -> None:
    """Return freed heap pages once the garbage collector has run to its end.

    A store dropped with its model (ComfyUI unloading it and clearing its cache) goes with the
    model's other weights, which are freed only as the collection that found them finishes; a
    trim right away would come too early. ``gc.callbacks`` runs this after every collection,
    and does nothing unless something was dropped since.
    """
    global _TRIM_PENDING
    _TRIM_PENDING = True
    if _trim_when_collected not in gc.callbacks:
        gc.callbacks.append(_trim_when_collected)


def _trim_when_collected(phase: str, info: dict) -> None:
    global _TRIM_PENDING
    if phase == "stop" and _TRIM_PENDING:
        _TRIM_PENDING = False
        return_freed_host_memory()


def return_freed_host_memory() -> bool:
    """Ask glibc to hand freed heap pages back to the OS (``malloc_trim(0)``); False where there is no glibc.

    Packing frees ComfyUI's CPU weights block by block; glibc keeps such pages in its heap for reuse
    unless trimmed, so RSS (and a container's memory cgroup) would count the model twice.
    """
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            _LIBC = libc if hasattr(libc, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True
