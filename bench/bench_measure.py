"""Measurement: byte accounting of the offload plans, the hooks that drive and count ComfyUI's own partial
loading, the per-step clock and the host-to-device bandwidth probe."""

from __future__ import annotations

import contextlib
import re
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..offload import choose_resident_blocks, footprint, largest_fitting

# ----------------------------------------------------------------------------------------------- small helpers
def size_text(nbytes) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def gib(nbytes) -> str:
    return "" if nbytes is None or nbytes == "" else f"{nbytes / 2**30:.3f}"


def tensor_nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.nelement() * t.element_size()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included), not numeric equality."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


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
    keep = choose_resident_blocks(len(block_nbytes), resident, policy)
    return sum(b for b, k in zip(block_nbytes, keep) if not k)


def equivalent_blocks(block_nbytes: Sequence[int], nbytes: float) -> float:
    """How many leading blocks ``nbytes`` would hold (fractional): where ComfyUI's point goes on a resident axis."""
    x = 0.0
    for size in block_nbytes:
        if nbytes <= 0:
            break
        x += min(1.0, nbytes / size)
        nbytes -= size
    return x


def largest_fitting_resident(block_nbytes, non_block, budget, prefetch, policy) -> Optional[int]:
    def fits(count: int) -> bool:
        return our_footprint(block_nbytes, non_block, count, prefetch, policy) <= budget
    count = largest_fitting(fits, len(block_nbytes))
    return count if fits(count) else None


# ----------------------------------------------------------------------------------------------- ComfyUI hooks
@contextlib.contextmanager
def comfy_weight_budget(patcher, budget: int):
    """Make ComfyUI load ``patcher`` with a weight budget of ``budget`` bytes, through its own lowvram path.

    ``load_models_gpu`` turns free VRAM into a weight budget (``lowvram_model_memory``) and hands it to
    ``LoadedModel.model_load``, which calls ``patcher.partially_load(device, budget)`` -> ``load()``. We replace
    only that number, for this patcher only, and keep every other step of ComfyUI's loading and sampling.

    Why not fake ``comfy.model_management.get_free_memory``: (1) the weight budget ComfyUI derives from free memory
    subtracts its activation estimate (``memory_required`` of the latent shape + 0.8 GiB + reserved VRAM), which
    differs per model and resolution, so "the same budget B" for both modes would be fuzzy; (2) ``calc_cond_batch``
    also reads ``get_free_memory`` to decide whether cond and uncond run as one batch, so a faked small value would
    change the number of forwards per step and the work done, not just the placement; (3) on the CPU
    ``load_models_gpu`` never computes a budget at all (the device is "DISABLED"), while ``model_load`` still runs.
    The number passed is budget minus what is already loaded, as ``load_models_gpu`` does (``... - loaded_memory``);
    ComfyUI's own "nothing more" value 0.1 when that is not positive (0 would mean "load everything").
    """
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


class CastCounter:
    """Counts the bytes ComfyUI casts per forward for lowvram modules (``comfy.ops.cast_bias_weight``).

    A module is lowvram when ``ModelPatcher.load`` gave it ``prev_comfy_cast_weights`` (it did not fit the
    budget), or when its weight is not on the device the input is on. Every ``comfy.ops`` layer looks the
    function up in ``comfy.ops`` at call time, so patching the module attribute sees every cast.
    """

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    @contextlib.contextmanager
    def installed(self):
        import comfy.ops

        original = comfy.ops.cast_bias_weight

        def counting(s, input=None, dtype=None, device=None, *args, **kwargs):
            target = device if device is not None else (input.device if input is not None else None)
            weight = getattr(s, "weight", None)
            lowvram = hasattr(s, "prev_comfy_cast_weights") or (
                weight is not None and target is not None and weight.device != torch.device(target))
            if lowvram:
                self.bytes += tensor_nbytes(weight) + tensor_nbytes(getattr(s, "bias", None))
                self.calls += 1
            return original(s, input, dtype, device, *args, **kwargs)

        comfy.ops.cast_bias_weight = counting
        try:
            yield self
        finally:
            comfy.ops.cast_bias_weight = original


def lowvram_module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the modules ComfyUI's last ``load()`` left lowvram (cast to the device every forward)."""
    total = 0
    for module in model.modules():
        if hasattr(module, "prev_comfy_cast_weights"):
            total += sum(tensor_nbytes(p) for p in module.parameters(recurse=False))
    return total


# ----------------------------------------------------------------------------------------------- timing
class StepClock:
    """The sampler's per-step callback: marks the end of every step (a CUDA event or the clock).

    At the first callback it synchronises the GPU and calls ``on_first`` (counter snapshots), then starts
    timing: step 1 (loading, arming, first-touch) is never in the measurement.
    """

    def __init__(self, cuda: bool, on_first: Callable[[], None]):
        self.cuda = cuda
        self.on_first = on_first
        self.marks: list = []

    def __call__(self, step, x0, x, total_steps):
        if not self.marks:
            if self.cuda:
                torch.cuda.synchronize()
            self.on_first()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_seconds(self) -> List[float]:
        if len(self.marks) < 2:
            return []
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def measure_h2d_gbps(nbytes: int, device: torch.device, repeats: int = 8) -> float:
    """Host-to-device GB/s of one ``nbytes`` copy: pinned host -> device on a GPU, a plain copy_ on the CPU."""
    nbytes = max(int(nbytes), 1 << 20)
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        del src, dst
    else:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - begin)
    return nbytes / statistics.median(times) / 1e9
