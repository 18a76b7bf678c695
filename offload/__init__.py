"""Resident layerwise offload for transformer blocks, in pure PyTorch.

The leading (or strided) blocks stay on the compute device; the rest stream from a host store
with a prefetch window on a side stream. Nothing here imports ComfyUI.
"""

from .config import POLICIES, OffloadConfig, resolve_resident_count
from .manager import LayerwiseOffloadManager
from .planner import ResidencyPlan, estimate_activation_bytes, plan_residency
from .schedule import Footprint, Schedule, choose_resident_blocks, footprint, largest_fitting
from .stats import OffloadStats

__all__ = [
    "POLICIES",
    "LayerwiseOffloadManager",
    "OffloadConfig",
    "OffloadStats",
    "ResidencyPlan",
    "Schedule",
    "Footprint",
    "apply_layerwise_offload",
    "choose_resident_blocks",
    "footprint",
    "largest_fitting",
    "estimate_activation_bytes",
    "plan_residency",
    "resolve_resident_count",
]


def apply_layerwise_offload(blocks, device, root=None, **settings) -> LayerwiseOffloadManager:
    """Offload ``blocks`` (in call order) for compute on ``device`` and install the hooks.

    Weights move into the host store at the first forward, not here, so building a pipeline never
    holds device memory other stages need. ``settings`` are :class:`OffloadConfig` fields.
    Call ``detach()`` on the returned manager to undo.
    """
    return LayerwiseOffloadManager(blocks, device, OffloadConfig(**settings)).attach(root)
