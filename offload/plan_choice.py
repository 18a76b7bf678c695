"""The plan a run chooses with residency_policy auto: the timing model (:mod:`.timing_model`) fed this card and
this model at this latent, over the candidate policies and prefetch depths that fit.

The card is a CUDA device's own figures, measured once per process, or a reference card named by
``$LAYERWISE_OFFLOAD_TIMING_GPU`` (how the CPU loopback plans as that card would). A block's FLOPs come from a rule
of thumb over its linear weights (:func:`block_flops`); bench/timing_table.py counts the templates' exactly.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .gpu_costs import GPUS, GpuSpec, ModelCosts
from .timing_model import Prediction, predict

__all__ = ["TIMING_GPU_ENV", "CLOSE_STEP", "PlanChoice", "block_flops", "gpu_for", "choose_plan"]

TIMING_GPU_ENV = "LAYERWISE_OFFLOAD_TIMING_GPU"  # a name of GPUS: plan as on that card (tests, the CPU loopback)
CLOSE_STEP = 1.01  # predicted steps this close to the fastest count as equal: the plan with fewer device bytes wins


def block_flops(block: nn.Module, tokens: int, batch: int = 1) -> float:
    """One forward of ``block`` over ``tokens`` tokens per item: ``2 x linear weights x tokens + 4 x tokens^2 x
    width`` per item, ``width`` its narrowest linear input (the hidden size), every linear seeing every token.
    bench/timing_table.py counts the templates' FLOPs exactly on the meta device; this rule of thumb is what a
    run can afford, and within a few percent of the count for the DiT blocks it was checked on."""
    elements, width = 0, None
    for module in block.modules():
        weight = getattr(module, "weight", None)
        in_features = getattr(module, "in_features", None)
        if isinstance(in_features, int) and weight is not None:
            elements += weight.numel() if weight.dim() == 2 else in_features * getattr(module, "out_features", 0)
            width = in_features if width is None else min(width, in_features)
    return float(batch) * (2.0 * elements * tokens + 4.0 * tokens * tokens * (width or 0))


@functools.lru_cache(maxsize=None)
def _measured_gpu(index: int) -> Optional[GpuSpec]:
    """This CUDA device's own figures, measured once per process (:func:`measure_device`)."""
    return measure_device(torch.device("cuda", index), torch.cuda)


def measure_device(device: torch.device, module, copy_bytes: int = 64 * 2 ** 20,
                   matmul_size: int = 4096) -> Optional[GpuSpec]:
    """``device``'s figures from three short timings: a pinned host-to-device copy, a bf16 matmul, a
    device-to-device copy. ``module`` answers for ``torch.cuda``. None when the device has no room for them.

    The work and its timing events go on ``device``'s own current stream, whichever device is current: an event
    recorded with no stream lands on the current device's, and would time nothing of this one's."""
    try:
        stream = module.current_stream(device)

        def timed(work, repeats=5):
            work()
            start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
            best = float("inf")
            for _ in range(repeats):
                start.record(stream)
                work()
                end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            return best
        with module.stream(stream):  # torch.cuda.stream also makes the stream's device the current one
            host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            dst = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
            h2d = copy_bytes / timed(lambda: dst.copy_(host, non_blocking=True))
            src = torch.empty_like(dst)
            hbm = 2 * copy_bytes / timed(lambda: dst.copy_(src))
            del host, src, dst
            n = matmul_size
            a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
            b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
            matmul = 2.0 * n ** 3 / timed(lambda: a @ b)
            del a, b
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return None
    properties = module.get_device_properties(device)
    return GpuSpec(properties.name, properties.total_memory, h2d, matmul, hbm, "measured at the first run")


def gpu_for(device) -> Optional[GpuSpec]:
    """The card ``device`` is, as the timing model needs it: the reference card named by $LAYERWISE_OFFLOAD_TIMING_GPU
    (so the CPU loopback plans as that card would), else a CUDA device's measured figures; None for anything else."""
    named = os.environ.get(TIMING_GPU_ENV)
    if named:
        if named not in GPUS:
            raise ValueError(f"[layerwise-offload] ${TIMING_GPU_ENV}={named!r} is not a reference GPU; use one of "
                             f"{', '.join(map(repr, GPUS))}, or unset it")
        return GPUS[named]
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _measured_gpu(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class PlanChoice:
    """One candidate plan and what the model predicts for it."""

    policy: str
    prefetch: int
    resident_count: int
    device_bytes: int
    prediction: Prediction
    tails: Tuple[int, ...] = ()  # per block, the bytes it streams (streamed tails); (): whole blocks


def choose_plan(costs: ModelCosts, gpu: GpuSpec, candidates: Sequence[tuple]) -> PlanChoice:
    """The fastest of ``candidates`` ((policy, prefetch, resident count), or with a fourth item, per block the bytes
    it streams (streamed tails); each fitting the device) as predicted on ``gpu``; among those within
    :data:`CLOSE_STEP` of the fastest step, the one holding the fewest device bytes (ties: the earlier candidate)."""
    from .schedule import Schedule, choose_resident_blocks

    if not candidates:
        raise ValueError("choose_plan needs at least one candidate")
    scored = []
    for policy, prefetch, count, *rest in candidates:
        tails = tuple(rest[0]) if rest and rest[0] else ()
        nbytes = Schedule(choose_resident_blocks(costs.num_blocks, count, policy)).device_bytes(
            costs.block_bytes, prefetch, tails or None)
        scored.append(PlanChoice(policy, prefetch, count, nbytes,
                                 predict(costs, gpu, count, policy, prefetch, tails=tails or None), tails))
    fastest = min(c.prediction.step_s for c in scored)
    close = [c for c in scored if c.prediction.step_s <= fastest * CLOSE_STEP]
    return min(close, key=lambda c: c.device_bytes)

