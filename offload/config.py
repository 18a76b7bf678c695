"""Validated settings of a layerwise offload, and the rule that turns ``resident_layers`` into a block count."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

log = logging.getLogger("layerwise_offload")

POLICIES = ("leading", "strided")
RELEASED_PARAMS = ("placeholder", "host")
HOST_STORES = ("auto", "ram", "disk")

ResidentLayers = Union[int, float]


def check_resident_layers(resident_layers) -> None:
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, numbers.Real):
        raise ValueError(
            f"resident_layers must be a number (a block count, or a fraction between 0 and 1), "
            f"got {resident_layers!r} of type {type(resident_layers).__name__}")
    if math.isnan(resident_layers) or math.isinf(resident_layers):
        raise ValueError(f"resident_layers must be a finite number, got {resident_layers!r}")
    if resident_layers < 0:
        raise ValueError(
            f"resident_layers must be >= 0, got {resident_layers!r}; use 0 to stream every block")


@dataclass(frozen=True)
class OffloadConfig:
    """How many blocks stay on the device, how far ahead streamed blocks are copied, and how.

    resident_layers: block count (>= 1) or fraction (0 < x < 1) that stays on the device; 0 streams all.
    prefetch_size: streamed blocks copied ahead of the one computing (>= 1).
    policy: ``leading`` keeps the first blocks the model runs; ``strided`` spreads the streamed
        blocks evenly over the step so their copies overlap more compute.
    pin_memory: page-lock the host store; ``None`` means "when the compute device is an accelerator".
    measure_time: record copy and stall timings (CUDA events on a GPU, a clock on the CPU loopback): the
        ``copy_seconds`` / ``stall_seconds`` the Stats node and the run line read (GB/s, time waiting for copies),
        so on by default; off, a streamed block's copy records just the one event the compute stream waits on
        instead of three (its start, its end, the compute stream's arrival at the wait).
    released_params: what a released block's parameters point at. ``placeholder`` (empty tensors)
        makes any use of a released block fail loudly; ``host`` (views of the host store) keeps the
        module a valid, partly offloaded model for code that runs it without the hooks, such as
        ComfyUI loading a sibling clone of the same model.
    host_store: where the blocks' host copies live. ``ram`` (the host store); ``disk`` (a packed cache file,
        read back ahead of use through a small staging ring, see disk/tier.py); ``auto`` keeps them in RAM while
        the host keeps a margin free and puts the rest on disk, the blocks latest in the step first.
    streamed_tail_bytes: 0 streams each streamed block whole. N > 0 keeps each streamed block's leading weights on
        the device (its head, copied once, like a resident) and streams only its last weights, at most N bytes (at
        least its last weight): the slots shrink to the largest tail, so a VRAM budget streams fewer bytes per step
        than whole blocks could. A tuple gives each block its own cap, in call order (auto plans one, see
        planner.plan_streamed_tails). A block on disk streams whole.
    """

    resident_layers: ResidentLayers = 0
    prefetch_size: int = 1
    policy: str = "leading"
    pin_memory: Optional[bool] = None
    measure_time: bool = True
    released_params: str = "placeholder"
    host_store: str = "ram"
    streamed_tail_bytes: Union[int, Tuple[int, ...]] = 0

    def __post_init__(self):
        check_resident_layers(self.resident_layers)
        if (isinstance(self.prefetch_size, bool) or not isinstance(self.prefetch_size, numbers.Integral)
                or self.prefetch_size < 1):
            raise ValueError(
                f"prefetch_size must be an integer >= 1, got {self.prefetch_size!r}; "
                f"1 copies the next streamed block while the current one computes")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.released_params not in RELEASED_PARAMS:
            raise ValueError(f"released_params must be one of {', '.join(RELEASED_PARAMS)}, "
                             f"got {self.released_params!r}")
        if self.host_store not in HOST_STORES:
            raise ValueError(f"host_store must be one of {', '.join(HOST_STORES)}, got {self.host_store!r}")
        caps = self.streamed_tail_bytes
        if isinstance(caps, list):
            caps = tuple(caps)
            object.__setattr__(self, "streamed_tail_bytes", caps)
        if not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) and c >= 0
                   for c in (caps if isinstance(caps, tuple) else (caps,))):
            raise ValueError(f"streamed_tail_bytes must be an integer >= 0 (0 streams whole blocks) or a tuple of "
                             f"them, one per block, got {self.streamed_tail_bytes!r}")
        if self.pin_memory not in (None, True, False):
            raise ValueError(f"pin_memory must be True, False or None (automatic), got {self.pin_memory!r}")

    def resident_count(self, num_blocks: int) -> int:
        """``resident_layers`` as a count of ``num_blocks`` blocks: the one place this rule lives.

        ``0 < x < 1`` is a fraction of the blocks (``round(x * n)``); ``x >= 1`` is a count
        (``floor(x)``), clamped to ``n`` with one log line; ``0`` streams every block.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        value = float(self.resident_layers)
        if 0 < value < 1:
            return int(round(value * num_blocks))
        count = int(math.floor(value))
        if count > num_blocks:
            log.info("[layerwise-offload] resident_layers=%s exceeds the %d blocks; keeping all %d resident",
                     self.resident_layers, num_blocks, num_blocks)
            return num_blocks
        return count

    def capped(self, max_resident: "int | None", num_blocks: int) -> "OffloadConfig":
        """This plan with at most ``max_resident`` resident blocks (None: no cap)."""
        if max_resident is None or self.resident_count(num_blocks) <= max_resident:
            return self
        return dataclasses.replace(self, resident_layers=max_resident)

    def tail_caps(self, num_blocks: int) -> Optional[Tuple[int, ...]]:
        """``streamed_tail_bytes`` as one cap per block (None: every streamed block streams whole)."""
        caps = self.streamed_tail_bytes
        if isinstance(caps, tuple):
            if len(caps) != num_blocks:
                raise ValueError(f"streamed_tail_bytes has {len(caps)} caps for {num_blocks} blocks; give one per "
                                 f"block, in call order, or one number for all")
            return caps if any(caps) else None
        return (int(caps),) * num_blocks if caps else None
