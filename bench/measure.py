"""Measuring code the benchmarks share: clocks, host-to-device copy timing, ComfyUI's own partial loading driven
and counted, the offload plans' byte accounting, and the small helpers every entry point needs.

An entry point run by path starts with devtools/comfy_env.py's ``enter_pack``: the pack is registered as the package
``layerwise_offload`` (never the repository root on sys.path: its nodes/ would shadow ComfyUI's), so relative imports
work."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..offload import choose_resident_blocks, footprint, largest_fitting

CPU_LOOPBACK_ENV = "LAYERWISE_OFFLOAD_CPU_LOOPBACK"  # the node's real path on the CPU (host-to-host copies)
RESULTS = Path(__file__).resolve().parent / "results"


def comfyui_version() -> str:
    try:
        import comfyui_version
        return comfyui_version.__version__
    except ImportError:  # older checkouts have no such file; the preflight runs without ComfyUI
        return "unknown"


@contextlib.contextmanager
def cpu_loopback(cpu: bool, threads: Optional[int] = None):
    """For one run on the CPU: the CPU loopback (the node passes the model through on the CPU otherwise) and one torch
    thread by default (two cores shared with other work make multi-threaded timings swing by 10x)."""
    if not cpu:
        yield
        return
    old_env, old_threads = os.environ.get(CPU_LOOPBACK_ENV), torch.get_num_threads()
    os.environ[CPU_LOOPBACK_ENV] = "1"
    torch.set_num_threads(threads or 1)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        if old_env is None:
            del os.environ[CPU_LOOPBACK_ENV]
        else:
            os.environ[CPU_LOOPBACK_ENV] = old_env


def tensor_nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.nelement() * t.element_size()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included), not numeric equality."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


def write_csv(path, rows, columns) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: f"{row[c]:.6g}" if isinstance(row.get(c), float) else row.get(c, "") for c in columns})
    return str(path)


# ----------------------------------------------------------------------------------------------- byte accounting
def parse_budget(text: str, non_block: int, block_total: int) -> Tuple[str, int]:
    """'0.5' -> non-block weights + half the blocks' bytes; '12GiB' / '800MiB' / '10GB' -> that many bytes."""
    t = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(GiB|MiB|GB|MB)", t, re.IGNORECASE)
    if m:
        scale = {"gib": 2**30, "mib": 2**20, "gb": 10**9, "mb": 10**6}[m.group(2).lower()]
        return t, int(float(m.group(1)) * scale)
    try:
        fraction = float(t)
    except ValueError:
        raise ValueError(f"budget {text!r}: give a fraction of the blocks' bytes (0.5) or a size (12GiB, 800MiB)")
    if not 0 <= fraction <= 1:
        raise ValueError(f"budget fraction {text!r} must be within 0..1 (a fraction of the blocks' total bytes)")
    return f"{fraction:g}", int(non_block + fraction * block_total)


def our_footprint(block_nbytes: Sequence[int], non_block: int, resident: int, prefetch: int, policy: str) -> int:
    """What the node reports as ``model_size()``: non-block weights + resident blocks + (prefetch+1) slots."""
    return non_block + footprint(block_nbytes, choose_resident_blocks(len(block_nbytes), resident, policy),
                                 prefetch).total


def streamed_bytes(block_nbytes: Sequence[int], resident: int, policy: str) -> int:
    return footprint(block_nbytes, choose_resident_blocks(len(block_nbytes), resident, policy), 1).streamed_bytes


def largest_fitting_resident(block_nbytes, non_block, budget, prefetch, policy) -> Optional[int]:
    def fits(count: int) -> bool:
        return our_footprint(block_nbytes, non_block, count, prefetch, policy) <= budget
    count = largest_fitting(fits, len(block_nbytes))
    return count if fits(count) else None


# ----------------------------------------------------------------------------------------------- ComfyUI hooks
@contextlib.contextmanager
def comfy_weight_budget(patcher, budget: int):
    """Make ComfyUI load ``patcher`` with a weight budget of ``budget`` bytes, through its own lowvram path:
    ``load_models_gpu`` hands ``LoadedModel.model_load`` a weight budget (``lowvram_model_memory``), which calls
    ``partially_load`` -> ``load()``; only that number is replaced, for this patcher only.

    Not a faked ``get_free_memory``: (1) the budget ComfyUI derives from free memory subtracts its activation
    estimate, which differs per model and resolution, so "the same B" for both modes would be fuzzy; (2)
    ``calc_cond_batch`` also reads it to decide whether cond and uncond run as one batch, which would change the
    work done; (3) on the CPU ``load_models_gpu`` computes no budget at all, while ``model_load`` still runs.
    As ``load_models_gpu`` does, what is already loaded is subtracted; 0.1 is ComfyUI's "nothing more" (0 would
    mean "load everything")."""
    import comfy.model_management as mm

    original = mm.LoadedModel.model_load

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        if self.model is patcher:
            lowvram_model_memory = max(budget - self.model.loaded_size(), 0.1)
        return original(self, lowvram_model_memory, force_patch_weights=force_patch_weights)

    mm.LoadedModel.model_load = model_load
    try:
        yield
    finally:
        mm.LoadedModel.model_load = original


def cast_bytes(s, input=None, device=None) -> int:
    """The bytes one classic ``cast_bias_weight(s, input, dtype, device)`` call moves: the weight and bias of a
    module left lowvram (``prev_comfy_cast_weights``) or whose weight is not on the target device; else 0."""
    target = device if device is not None else (input.device if input is not None else None)
    weight = getattr(s, "weight", None)
    if hasattr(s, "prev_comfy_cast_weights") or (
            weight is not None and target is not None and weight.device != torch.device(target)):
        return tensor_nbytes(weight) + tensor_nbytes(getattr(s, "bias", None))
    return 0


class CastCounter:
    """Counts the bytes ComfyUI casts per forward for lowvram modules (``comfy.ops.cast_bias_weight``): those
    ``ModelPatcher.load`` gave ``prev_comfy_cast_weights``, or whose weight is not on the input's device. Every
    ``comfy.ops`` layer looks the function up in ``comfy.ops`` at call time, so patching it sees every cast."""

    def __init__(self):
        self.bytes = 0

    @contextlib.contextmanager
    def installed(self):
        import comfy.ops

        original = comfy.ops.cast_bias_weight

        def counting(s, input=None, dtype=None, device=None, *args, **kwargs):
            self.bytes += cast_bytes(s, input, device)
            return original(s, input, dtype, device, *args, **kwargs)

        comfy.ops.cast_bias_weight = counting
        try:
            yield self
        finally:
            comfy.ops.cast_bias_weight = original


def lowvram_module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the modules ComfyUI's last ``load()`` left lowvram (cast to the device every forward)."""
    return sum(tensor_nbytes(p) for m in model.modules() if hasattr(m, "prev_comfy_cast_weights")
               for p in m.parameters(recurse=False))


def block_lora(patcher, rank: int) -> dict:
    """A seeded rank-``rank`` LoRA over every 2-D weight of the model's blocks, in the keys ComfyUI's LoraLoader
    reads; apply it with :func:`with_lora`."""
    generator = torch.Generator().manual_seed(7)
    lora = {}
    for key, tensor in patcher.model.state_dict().items():
        if ".blocks." in key and key.endswith(".weight") and tensor.ndim == 2:
            stem = key[:-len(".weight")]
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
    if not lora:
        raise RuntimeError("[layerwise-offload] no block weights found to put a LoRA on")
    return lora


def with_lora(patcher, lora: dict):
    import comfy.sd
    return comfy.sd.load_lora_for_models(patcher, None, lora, 0.8, 0)[0]


# ----------------------------------------------------------------------------------------------- timing
def mark(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream on a GPU, the clock on the CPU."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(a, b) -> float:
    """Seconds between two marks (waits for the later CUDA event)."""
    if isinstance(a, float):
        return b - a
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def seconds(fn: Callable[[], object], cuda: bool, inner: int = 1) -> float:
    """Seconds per call of ``fn`` over ``inner`` calls (on a GPU after a sync, so nothing queued before counts)."""
    if cuda:
        torch.cuda.synchronize()
    start = mark(cuda)
    for _ in range(inner):
        fn()
    return elapsed(start, mark(cuda)) / inner


def page_aligned_host(nbytes: int) -> torch.Tensor:
    """A pageable host buffer that starts on a page and spans whole pages (registration locks whole pages)."""
    page = 4096
    size = -(-nbytes // page) * page
    raw = torch.empty(size + page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    return raw[start:start + size]


def copy_seconds(nbytes: int, device: torch.device, kind: str = "pinned", repeats: int = 5) -> float:
    """Median seconds of one host -> device copy of ``nbytes`` from ``kind`` memory (registered: page-locked with
    cudaHostRegister, as the host store does | pinned | pageable); on the CPU a plain host copy."""
    cuda = device.type == "cuda"
    pinner = None
    if not cuda:
        src = torch.empty(nbytes, dtype=torch.uint8)
    elif kind == "pinned":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        src = page_aligned_host(nbytes)
        if kind == "registered":
            from ..offload.memory.pinning import CudaHostRegisterPinner  # looks inside: the host store's own pinner
            pinner = CudaHostRegisterPinner()
            if not pinner.register(src):
                raise RuntimeError(f"cudaHostRegister refused {nbytes} bytes")
    src.fill_(1)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    copy = lambda: dst.copy_(src, non_blocking=cuda and kind != "pageable")  # noqa: E731
    try:
        copy()  # first touch of both buffers
        return statistics.median(seconds(copy, cuda) for _ in range(repeats))
    finally:
        if pinner is not None:
            torch.cuda.synchronize()
            pinner.unregister(src)


class StepClock:
    """The sampler's per-step callback: marks the end of every step (a CUDA event or the clock). At the first
    callback it synchronises and calls ``on_first`` (counter snapshots): step 1 (loading, arming, first touch) is
    never in the measurement."""

    def __init__(self, cuda: bool, on_first: Callable[[], None] = lambda: None):
        self.cuda = cuda
        self.on_first = on_first
        self.marks: list = []

    def __call__(self, step, x0, x, total_steps):
        if not self.marks:
            if self.cuda:
                torch.cuda.synchronize()
            self.on_first()
        self.marks.append(mark(self.cuda))

    def step_seconds(self) -> List[float]:
        return [elapsed(a, b) for a, b in zip(self.marks, self.marks[1:])]
