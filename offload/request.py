"""What a user asks of an offload, checked once where it comes in: a resident count (or auto), the prefetch depth,
the policy (or auto) and the granularity, pinning and the host store. A plan (:class:`OffloadConfig`) is resolved
from it and the facts of a run (planning happens in the node's run planner); the manager applies plans."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Union

from .config import HOST_STORES, POLICIES, OffloadConfig, check_resident_layers

AUTO = "auto"
BLOCKS, WEIGHTS = "blocks", "weights"
GRANULARITIES = (BLOCKS, WEIGHTS)


@dataclass(frozen=True)
class OffloadRequest:
    """resident_layers: a block count, a fraction of the blocks, or :data:`AUTO` (as many as fit, chosen at each
        run's first step; with blocks and a known card, streamed tails where they stream fewer bytes).
    prefetch_size: streamed blocks copied ahead of the one computing; with policy auto, the least auto copies ahead.
    policy: ``leading``, ``strided``, or :data:`AUTO` (the setting the timing model predicts fastest on this card).
    granularity: :data:`BLOCKS` (whole blocks or their tails) or :data:`WEIGHTS` (weight units, always auto-planned).
    pin_memory: page-lock the host copies (only where copies go to an accelerator).
    host_store: ``auto``, ``ram`` or ``disk`` (see :class:`OffloadConfig`).
    """

    resident_layers: Union[int, float, str] = AUTO
    prefetch_size: int = 1
    policy: str = AUTO
    granularity: str = BLOCKS
    pin_memory: bool = True
    host_store: str = "auto"

    def __post_init__(self):
        if self.resident_layers != AUTO:
            check_resident_layers(self.resident_layers)
        if (isinstance(self.prefetch_size, bool) or not isinstance(self.prefetch_size, numbers.Integral)
                or self.prefetch_size < 1):
            raise ValueError(f"prefetch_size must be an integer >= 1, got {self.prefetch_size!r}; 1 copies the next "
                             f"streamed block while the current one computes")
        if self.policy not in (AUTO,) + POLICIES:
            raise ValueError(f"policy must be one of {', '.join((AUTO,) + POLICIES)}, got {self.policy!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.granularity == WEIGHTS and (self.resident_layers != AUTO or self.policy != AUTO):
            raise ValueError(f"streaming by weights plans what stays in VRAM itself, at each run's first step: set "
                             f"resident_layers to auto, not {self.resident_layers!r}")
        if self.host_store not in HOST_STORES:
            raise ValueError(f"host_store must be one of {', '.join(HOST_STORES)}, got {self.host_store!r}")

    @property
    def auto_residents(self) -> bool:
        return self.resident_layers == AUTO

    @property
    def auto_policy(self) -> bool:
        return self.policy == AUTO and self.granularity == BLOCKS

    @property
    def plans_each_run(self) -> bool:
        """Whether each run's first step resolves the plan from that run's facts."""
        return self.auto_residents or self.auto_policy

    def plan(self) -> OffloadConfig:
        """The plan before any run's facts are known: what is asked, auto's part at its floor (nothing resident,
        leading, the node's prefetch). A released block points at its host copy, so the model stays valid for code
        that runs it without the hooks (ComfyUI loading a sibling clone of the same model)."""
        return OffloadConfig(resident_layers=0 if self.auto_residents else self.resident_layers,
                             prefetch_size=self.prefetch_size, policy="leading" if self.policy == AUTO else self.policy,
                             pin_memory=self.pin_memory, host_store=self.host_store, released_params="host")

    def with_pinning(self, allowed: bool) -> "OffloadRequest":
        """This request with pinning off where it cannot help (no accelerator to copy to)."""
        return dataclasses.replace(self, pin_memory=self.pin_memory and allowed)
