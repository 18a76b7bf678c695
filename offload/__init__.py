"""Resident layerwise offload for transformer blocks, in pure PyTorch.

The leading (or strided) blocks stay on the compute device; the rest stream from a host store
with a prefetch window on a side stream. Nothing here imports ComfyUI.
"""

from .activation_model import block_width
from .disk.checkpoint import CheckpointError, CheckpointFile, locate
from .config import HOST_STORES, POLICIES, OffloadConfig
from .device.backend import normalize_device
from .disk.cache_file import disk_tier_unsupported, remove_stale_files
from .hooks import cuda_graph_refusal
from .memory.ram import available_host_bytes
from .host.environment import DISK_DIR_ENV, HostEnvironment, default_disk_folder
from .host.packing import block_parameters
from .manager import LayerwiseOffloadManager
from .memory.pinning import clear_cuda_error, return_freed_host_memory
from .formatting import format_bytes, format_mib, format_rate, format_seconds
from .planner import (ResidencyPlan, describe, estimate_activation_bytes, forward_activation_bytes, plan_residency,
                      plan_streamed_tails, plan_weight_units, streamed_tails_plan)
from .schedule import Footprint, Schedule, choose_resident_blocks, footprint, largest_fitting
from .request import OffloadRequest
from .stats import OffloadStats
from .units import WeightUnits, weight_units
from .weights import point_param_at, weight_nbytes, weight_parts
from .timing import TIMING_GPU_ENV, timing_for

__all__ = [
    "timing_for",
    "TIMING_GPU_ENV",
    "DISK_DIR_ENV",
    "Footprint",
    "HOST_STORES",
    "HostEnvironment",
    "POLICIES",
    "CheckpointError",
    "CheckpointFile",
    "LayerwiseOffloadManager",
    "OffloadConfig",
    "OffloadRequest",
    "OffloadStats",
    "ResidencyPlan",
    "Schedule",
    "apply_layerwise_offload",
    "available_host_bytes",
    "block_parameters",
    "block_width",
    "choose_resident_blocks",
    "clear_cuda_error",
    "cuda_graph_refusal",
    "default_disk_folder",
    "describe",
    "disk_tier_unsupported",
    "estimate_activation_bytes",
    "footprint",
    "format_bytes",
    "format_mib",
    "format_rate",
    "format_seconds",
    "forward_activation_bytes",
    "largest_fitting",
    "locate",
    "normalize_device",
    "plan_residency",
    "plan_streamed_tails",
    "plan_weight_units",
    "WeightUnits",
    "weight_units",
    "streamed_tails_plan",
    "point_param_at",
    "remove_stale_files",
    "return_freed_host_memory",
    "weight_nbytes",
    "weight_parts",
]


def apply_layerwise_offload(blocks, device, plan=None, *, root=None, environment=None, backend=None, hooks=True,
                            **settings) -> LayerwiseOffloadManager:
    """Offload ``blocks`` (in call order) for compute on ``device`` under ``plan`` (an :class:`OffloadConfig`;
    ``settings`` are its fields, or override them) and install the hooks (``hooks=False``: a caller that runs each
    model call through ``manager.running()`` installs them there).

    Weights move into the host store at the first forward, not here, so building a pipeline never
    holds device memory other stages need. ``environment`` and ``backend`` as for :class:`LayerwiseOffloadManager`.
    Call ``detach()`` on the returned manager to undo.
    """
    manager = LayerwiseOffloadManager(blocks, device, plan or OffloadConfig(), environment, backend, **settings)
    return manager.attach(root) if hooks else manager
