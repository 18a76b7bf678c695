"""What a step costs, whatever the schedule: the reference GPUs' figures, a model's per-block bytes and FLOPs
(:class:`ModelCosts`, :func:`block_flops`), the host's time per streamed block by weight format, and the bound
``max(compute, streamed bytes / H2D)`` (docs/internals.md). :mod:`.step` times a plan's schedule with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..schedule import footprint
from ..weights import cast_nbytes, weight_format

__all__ = ["GpuSpec", "GPUS", "DIT_EFFICIENCY", "HOST_S_PER_STREAMED_BLOCK", "HOST_S_PER_STREAMED_BLOCK_FP8",
           "HOST_S_PER_STREAMED_BLOCK_QUANTIZED", "HOST_S_PER_STREAMED_BLOCK_GGUF",
           "HOST_S_PER_STREAMED_BLOCK_BY_FORMAT", "LAUNCH_S_PER_BLOCK", "COPY_LATENCY_S", "LORA_BYTES_PER_WEIGHT",
           "ModelCosts", "block_flops", "bound_seconds", "model_costs"]

# ----------------------------------------------------------------------------------------------- figures

DIT_EFFICIENCY = 0.7  # a DiT block's kernels (GEMMs, flash attention, norms, RoPE, gates) vs a big square GEMM
# The manager's Python time per streamed block, by weight format: the worst median of the "after" rows of
# bench/results/host_time.csv (how it was measured, and what it leaves out: docs/internals.md).
HOST_S_PER_STREAMED_BLOCK = 0.116e-3  # plain bf16 / fp16 weights
HOST_S_PER_STREAMED_BLOCK_FP8 = 0.082e-3  # plain fp8 weights (e4m3fn, unscaled)
HOST_S_PER_STREAMED_BLOCK_QUANTIZED = 0.217e-3  # ComfyUI's QuantizedTensor weights (fp8 scaled)
HOST_S_PER_STREAMED_BLOCK_GGUF = 0.156e-3  # ComfyUI-GGUF's GGMLTensor weights
HOST_S_PER_STREAMED_BLOCK_BY_FORMAT = {"bf16": HOST_S_PER_STREAMED_BLOCK, "fp8": HOST_S_PER_STREAMED_BLOCK_FP8,
                                       "quantized": HOST_S_PER_STREAMED_BLOCK_QUANTIZED,
                                       "gguf": HOST_S_PER_STREAMED_BLOCK_GGUF}
LAUNCH_S_PER_BLOCK = 0.15e-3  # launching one block's ~25-40 kernels from Python, hooks included
COPY_LATENCY_S = 10e-6  # per queued copy: DMA set-up, event records
# Device-memory bytes per weight of a LoRA patched on the device with ComfyUI's float32 math (the weight cast to
# float32, the low-rank product added, the sum rounded back to the weight's dtype); bench/timing_table.py's LoRA rows.
LORA_BYTES_PER_WEIGHT = 28


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the model sees it.

    h2d_bytes_per_s: pinned host-to-device copy rate of one copy engine (measured figures, not the link's raw rate).
    matmul_flops_per_s: achievable dense bf16 matmul rate (fp32 accumulate, as PyTorch runs bf16 GEMMs).
    hbm_bytes_per_s: device memory bandwidth (casts, dequantisation, LoRA math are bound by it).
    """

    name: str
    vram_bytes: int
    h2d_bytes_per_s: float
    matmul_flops_per_s: float
    hbm_bytes_per_s: float
    source: str = ""

    @property
    def dit_flops_per_s(self) -> float:
        return self.matmul_flops_per_s * DIT_EFFICIENCY


GiB = 2 ** 30
GPUS: Dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("RTX 3060 12GB", 12 * GiB, 24e9, 0.9 * 25.5e12, 360e9,
            "GA106, 28 SMs at 1.777 GHz boost: 51 TFLOP/s dense fp16 with fp16 accumulate, half that (25.5) "
            "with fp32 accumulate on GeForce Ampere (GA102 whitepaper's rate per SM); x0.9 achievable. PCIe 4.0 x16, "
            "pinned H2D ~24 GB/s. GDDR6 192-bit 360 GB/s."),
    GpuSpec("RTX 4090 24GB", 24 * GiB, 25e9, 0.9 * 165.2e12, 1008e9,
            "Ada whitepaper: 165.2 TFLOP/s dense bf16/fp16 with fp32 accumulate (330.3 with fp16 accumulate; "
            "82.6 is the non-tensor fp32 rate); x0.9 achievable. PCIe 4.0 x16 pinned H2D ~25 GB/s. GDDR6X 1008 GB/s."),
    GpuSpec("RTX 5090 32GB", 32 * GiB, 54e9, 0.9 * 209.5e12, 1792e9,
            "Blackwell GeForce: 419 TFLOP/s dense fp16 tensor (838 sparse), 209.5 with fp32 accumulate; x0.9 "
            "achievable. PCIe 5.0 x16 pinned H2D 53-56 GB/s. GDDR7 1792 GB/s."),
    GpuSpec("H200 141GB", 141 * 10 ** 9, 55e9, 790e12, 4.8e12,
            "790 TFLOP/s on an 8192^3 bf16 matmul (datasheet 989 dense). PCIe 5.0 x16 pinned H2D ~55 GB/s "
            "(bench/results/gpu/README.md). HBM3e 4.8 TB/s."),
)}

# ----------------------------------------------------------------------------------------------- costs

@dataclass(frozen=True)
class ModelCosts:
    """What one model costs per block, whatever the GPU.

    block_bytes: bytes each block copies (its stored size: bf16, fp8 or GGUF bytes).
    block_flops: FLOPs of one forward of each block at the workflow's shape (cond and uncond batched).
    outside_flops: FLOPs of the forward outside the blocks (embedders, final layer).
    cast_bytes: per block, device-memory bytes its per-forward weight casts or dequantisation move (0 for bf16).
    lora_bytes: per block, device-memory bytes of the LoRA math an after-copy transform does (None: no LoRA).
    tail_bytes: per block, the bytes a streamed copy of it moves (its tail, with streamed tails; None: the block).
    host_s_per_streamed_block, launch_s_per_block: host costs (see the module docstring).
    """

    block_bytes: Tuple[int, ...]
    block_flops: Tuple[float, ...]
    outside_flops: float = 0.0
    cast_bytes: Optional[Tuple[int, ...]] = None
    lora_bytes: Optional[Tuple[int, ...]] = None
    tail_bytes: Optional[Tuple[int, ...]] = None
    host_s_per_streamed_block: float = HOST_S_PER_STREAMED_BLOCK
    launch_s_per_block: float = LAUNCH_S_PER_BLOCK

    def __post_init__(self):
        if len(self.block_bytes) != len(self.block_flops):
            raise ValueError(f"block_bytes has {len(self.block_bytes)} blocks, block_flops {len(self.block_flops)}")
        for name in ("cast_bytes", "lora_bytes", "tail_bytes"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.block_bytes):
                raise ValueError(f"{name} has {len(value)} blocks, block_bytes {len(self.block_bytes)}")

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)

    @property
    def streamed_copy_bytes(self) -> Tuple[int, ...]:
        """Per block, the bytes one streamed copy of it moves."""
        return self.tail_bytes if self.tail_bytes is not None else self.block_bytes

    def streamed_bytes(self, resident: Sequence[bool]) -> int:
        """The bytes one step copies under the plan ``resident`` (per block); the prefetch depth does not change
        them."""
        return footprint(self.block_bytes, resident, 1, self.tail_bytes).streamed_bytes

    def block_seconds(self, gpu: GpuSpec) -> List[float]:
        cast = self.cast_bytes or (0,) * self.num_blocks
        return [f / gpu.dit_flops_per_s + c / gpu.hbm_bytes_per_s for f, c in zip(self.block_flops, cast)]

    def compute_seconds(self, gpu: GpuSpec) -> float:
        return sum(self.block_seconds(gpu)) + self.outside_flops / gpu.dit_flops_per_s


def bound_seconds(costs: ModelCosts, gpu: GpuSpec, resident: Sequence[bool]) -> float:
    """The bound of one step: ``max(compute, streamed bytes / H2D)``."""
    return max(costs.compute_seconds(gpu), costs.streamed_bytes(resident) / gpu.h2d_bytes_per_s)


def model_costs(blocks: Sequence[nn.Module], block_bytes: Sequence[int], block_flops: Sequence[float],
                compute_itemsize: int, lora_weights: Optional[Sequence[int]] = None,
                outside_flops: float = 0.0) -> ModelCosts:
    """The costs of a loaded model as a run sees them: its blocks' weight format sets the host time per streamed
    block, their narrow weights (fp8, quantized) the casts each forward does at ``compute_itemsize`` bytes an
    element, and ``lora_weights`` (per block, the weights a LoRA patches on the device; None: no LoRA) the LoRA
    math."""
    cast = tuple(cast_nbytes(block, compute_itemsize) for block in blocks)
    return ModelCosts(tuple(block_bytes), tuple(block_flops), outside_flops=outside_flops,
                      cast_bytes=cast if any(cast) else None,
                      lora_bytes=None if lora_weights is None else tuple(LORA_BYTES_PER_WEIGHT * n for n in lora_weights),
                      host_s_per_streamed_block=HOST_S_PER_STREAMED_BLOCK_BY_FORMAT[weight_format(blocks)])


def block_flops(block: nn.Module, tokens: int, batch: int = 1) -> float:
    """One forward of ``block`` over ``tokens`` tokens per item: ``2 x linear weights x tokens + 4 x tokens^2 x
    width`` per item, ``width`` its narrowest linear input (the hidden size), every linear seeing every token.
    A rule of thumb a run can afford; bench/template_costs.py counts the templates' FLOPs exactly."""
    elements, width = 0, None
    for module in block.modules():
        weight = getattr(module, "weight", None)
        in_features = getattr(module, "in_features", None)
        if isinstance(in_features, int) and weight is not None:
            elements += weight.numel() if weight.dim() == 2 else in_features * getattr(module, "out_features", 0)
            width = in_features if width is None else min(width, in_features)
    return float(batch) * (2.0 * elements * tokens + 4.0 * tokens * tokens * (width or 0))
