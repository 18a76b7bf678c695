"""The strict CPU loopback: block weights used outside their hooks during a model call fail loudly.

On the loopback the device is the host, so a block whose weights were not brought in by its hooks (released, or
copied ahead and not yet waited for) still computes from its host copy, and a test passes where a GPU would fail
(a plain Linear: device mismatch) or quietly copy every call (ComfyUI's cast Linear). With
``$LAYERWISE_OFFLOAD_STRICT_LOOPBACK=1`` such blocks point at empty placeholders while a model call runs, so any use
of their weights fails, and back at their host copies after it (where code outside the calls, a sibling clone run
without the offload, expects them). Quantized wrapper weights, which cannot be empty, keep their host copy.
"""

from __future__ import annotations

import os

__all__ = ["STRICT_LOOPBACK_ENV", "strict_loopback"]

STRICT_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_STRICT_LOOPBACK"


def strict_loopback() -> bool:
    return os.environ.get(STRICT_LOOPBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")
