"""The plan a run chooses with residency_policy auto: the timing model (:mod:`.step`) fed this card and this model at
this latent, over the candidate policies and prefetch depths that fit.

The card is a CUDA device's own figures, measured once per process, or a reference card named by
``$LAYERWISE_OFFLOAD_TIMING_GPU`` (how the CPU loopback plans as that card would).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from ..schedule import choose_resident_blocks, footprint
from .costs import GPUS, GpuSpec, ModelCosts, block_flops, model_costs
from .step import Prediction, predict

__all__ = ["TIMING_GPU_ENV", "CLOSE_STEP", "SETTINGS", "CardTiming", "PlanChoice", "timing_for", "gpu_for",
           "measure_device", "choose_plan"]

TIMING_GPU_ENV = "LAYERWISE_OFFLOAD_TIMING_GPU"  # a name of GPUS: plan as on that card (tests, the CPU loopback)
CLOSE_STEP = 1.01  # predicted steps this close to the fastest count as equal: the plan with fewer device bytes wins

# The policy x prefetch depths auto chooses from. Deeper rings only for leading: where the residents are the model's
# biggest blocks and come first (Flux's double blocks), the copy engine idles while they compute unless the ring can
# take the copies of that whole stretch; strided needs no deeper ring (it keeps smaller blocks resident instead, and
# streams more bytes).
SETTINGS: Tuple[Tuple[str, int], ...] = (("leading", 1), ("strided", 1), ("leading", 2), ("strided", 2),
                                         ("leading", 3), ("strided", 3), ("leading", 4), ("strided", 4),
                                         ("leading", 6), ("leading", 8), ("leading", 12), ("leading", 16))


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


def choose_plan(costs: ModelCosts, gpu: GpuSpec, candidates: Sequence[tuple], model=predict) -> PlanChoice:
    """The fastest of ``candidates`` ((policy, prefetch, resident count), or with a fourth item, per block the bytes
    it streams (streamed tails); each fitting the device) as ``model`` predicts them on ``gpu``; among those within
    :data:`CLOSE_STEP` of the fastest step, the one holding the fewest device bytes (ties: the earlier candidate)."""
    if not candidates:
        raise ValueError("choose_plan needs at least one candidate")
    scored = []
    for policy, prefetch, count, *rest in candidates:
        tails = tuple(rest[0]) if rest and rest[0] else ()
        nbytes = footprint(costs.block_bytes, choose_resident_blocks(costs.num_blocks, count, policy), prefetch,
                           tails or None).total
        scored.append(PlanChoice(policy, prefetch, count, nbytes,
                                 model(costs, gpu, count, policy, prefetch, tails=tails or None), tails))
    fastest = min(c.prediction.step_s for c in scored)
    close = [c for c in scored if c.prediction.step_s <= fastest * CLOSE_STEP]
    return min(close, key=lambda c: c.device_bytes)



@dataclass(frozen=True)
class CardTiming:
    """The timing model on one card: the settings residency_policy auto chooses among, and the choice."""

    gpu: GpuSpec
    settings: Tuple[Tuple[str, int], ...] = SETTINGS

    @property
    def name(self) -> str:
        return self.gpu.name

    def choose(self, candidates: Sequence[tuple], blocks: Sequence[nn.Module], block_bytes: Sequence[int],
               tokens: int, batch: int, compute_itemsize: int,
               lora_weights: Optional[Sequence[int]] = None) -> PlanChoice:
        """:func:`choose_plan` over ``candidates`` for these blocks (their bytes as the manager stores them) at
        ``tokens`` x ``batch``, computing in ``compute_itemsize``-byte elements; ``lora_weights``: per block, the
        weights a LoRA patches on the device (None: no LoRA)."""
        costs = model_costs(blocks, block_bytes, [block_flops(b, tokens, batch) for b in blocks], compute_itemsize,
                            lora_weights)
        return choose_plan(costs, self.gpu, candidates)


def timing_for(device) -> Optional[CardTiming]:
    """The timing model for ``device`` (:func:`gpu_for`), or None where no card is known (the plain CPU loopback,
    other devices): then auto keeps the node's own policy and prefetch."""
    gpu = gpu_for(device)
    return None if gpu is None else CardTiming(gpu)
