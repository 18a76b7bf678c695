"""The strict CPU loopback: block weights read from their host copy during a model call fail loudly.

On the loopback the device is the host, so a block whose weights were not brought in by its hooks (released, or
copied ahead and not yet waited for) still computes from its host copy, and a test passes where a GPU would fail
(a plain Linear: device mismatch) or quietly copy every call (ComfyUI's cast Linear). With
``$LAYERWISE_OFFLOAD_STRICT_LOOPBACK=1`` the host store's buffers are remembered as they are allocated, and while a
manager runs a model call any kernel that reads them raises. The manager's own copies out of them (``copy_``)
and views into them are what the store is for and pass.
"""

from __future__ import annotations

import os
from typing import Dict

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["STRICT_LOOPBACK_ENV", "strict_loopback", "note_host_copy", "HostCopyGuard"]

STRICT_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_STRICT_LOOPBACK"

_HOST_COPIES: Dict[int, StorageWeakRef] = {}  # storage address -> the host store's storage there
_PASSING = {torch.ops.aten.copy_.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
            torch.ops.aten.lift_fresh.default}


def strict_loopback() -> bool:
    return os.environ.get(STRICT_LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def note_host_copy(tensor: torch.Tensor) -> None:
    """``tensor``'s storage holds blocks' host copies (remembered only in strict mode)."""
    if strict_loopback():
        storage = tensor.untyped_storage()
        _HOST_COPIES[storage.data_ptr()] = StorageWeakRef(storage)


def _is_host_copy(tensor: torch.Tensor) -> bool:
    address = tensor.untyped_storage().data_ptr()
    ref = _HOST_COPIES.get(address)
    if ref is None:
        return False
    if ref.expired():
        del _HOST_COPIES[address]
        return False
    return True


class HostCopyGuard(TorchDispatchMode):
    """Raises when a kernel reads a block's host copy (see the module's docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _HOST_COPIES and func not in _PASSING and not getattr(func, "is_view", False):
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, torch.Tensor) and _is_host_copy(value):
                    raise RuntimeError(
                        f"[layerwise-offload] strict loopback: {func} read a block's weights from its host copy "
                        f"({tuple(value.shape)}, {value.dtype}) during a model call; on a GPU that is a device "
                        "mismatch or a copy at every call. Something used the weights of a block that was not "
                        "brought in by its own hooks (released, or not yet waited for).")
        return func(*args, **kwargs)
