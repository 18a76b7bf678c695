"""What packing the host store really adds to host RAM, and which blocks must live on disk instead.

Packing a block copies its weights into one fresh buffer and then lets ComfyUI's copy go, block by block. So
the net growth of a block is its packed size minus the bytes of ComfyUI's copy that nobody else holds (a LoRA
backup or another model sharing the storage keeps it alive), and the peak is one block above the running net
growth (the new buffer exists before the old copy is freed). A block whose host copy lives on disk is written in
chunks straight from its weights (no block-sized buffer) and then frees ComfyUI's copy, so the blocks bound for
disk are packed first: the RAM they free is there before any RAM block needs its one block of headroom. The
disk tier's staging ring (a few chunks, whatever the block size: ``disk/tier.py`` ``staging_ring_bytes``) is
allocated at the first read, after packing, when that RAM is free again.

The auto tier (``host_store="auto"``) never asks for more RAM than ComfyUI's own copy of the model holds: where
packing every block into RAM adds nothing (ComfyUI's copies are freed as they are packed) and its one-block peak
fits, every block stays in RAM. Otherwise (weights that packing cannot free: a mapped checkpoint, shared
storages) it keeps blocks in RAM while the host keeps ``margin`` free after packing, and puts the rest on disk,
the blocks latest in the step first (the leading ones are the residents, read back most often when ComfyUI asks
for VRAM back). Among the plans it considers it takes one that fits over one that does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .checkpoint import is_mapped
from ..config import HOST_STORES
from .mappings import MappedFiles

__all__ = ["HOST_STORES", "PACKING_SLACK_BYTES", "RAM_MARGIN_BYTES", "TierPlan", "freed_by_packing",
           "plan_host_tiers", "refusal"]


# Allocator rounding, Python objects, the packing loop's own temporaries: what packing may take beyond its bytes.
PACKING_SLACK_BYTES = 64 * 2**20
# Auto keeps this much host memory free after packing (ComfyUI, the sampler and the OS still need some).
RAM_MARGIN_BYTES = 512 * 2**20


def _holders(tensor: torch.Tensor, out: List[torch.Tensor]) -> None:
    """The plain tensor objects that hold a weight's storage (a wrapper subclass's inner tensors)."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            _holders(getattr(tensor, name), out)
    else:
        out.append(tensor)


def freed_by_packing(params: Sequence[torch.Tensor], mapped_files: Optional[MappedFiles] = None) -> int:
    """Host bytes freed once ``params`` (one block's weights) point into the store instead of their storages.

    A storage is freed when the block's own tensors are its only holders: PyTorch's storage use count then equals
    their number (plus the one reference this function holds while it counts). Device storages free no host
    memory, nor do storages over a mapped file (a checkpoint our loader mapped, or one in ``mapped_files``, as
    ComfyUI-GGUF maps the .gguf): their bytes are page cache. Without the use-count API (a PyTorch that lacks it)
    every other host storage is taken as freed, which is what packing does to weights nobody else shares.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    holders: List[torch.Tensor] = []
    for param in params:
        _holders(param, holders)
    storages = {}
    for tensor in holders:
        if tensor.device.type != "cpu" or is_mapped(tensor) or (
                mapped_files is not None and mapped_files.holds_storage(tensor)):
            continue
        storage = tensor.untyped_storage()
        entry = storages.setdefault(storage.data_ptr(), [storage, 0])
        entry[1] += 1
    freed = 0
    for storage, ours in storages.values():
        if use_count is None or use_count(storage._cdata) <= ours + 1:
            freed += storage.nbytes()
    return freed


@dataclass(frozen=True)
class TierPlan:
    """Where each block's host copy goes, and what packing them all takes from host RAM.

    disk: per block, whether its host copy lives on disk. peak_bytes: the most packing adds at any moment
    (ring included); growth_bytes: what it adds once done (negative: it frees more than it takes).
    available_bytes: the host memory available when planned (None: unknown). reason: why blocks are on disk.
    """

    disk: Tuple[bool, ...]
    peak_bytes: int
    growth_bytes: int
    ring_bytes: int
    available_bytes: Optional[int]
    margin_bytes: int
    reason: str = ""

    @property
    def disk_blocks(self) -> int:
        return sum(self.disk)

    def shortfall(self, slack: int = PACKING_SLACK_BYTES) -> Optional[int]:
        """Bytes missing for packing to complete (None: it fits, or the available memory is unknown)."""
        if self.available_bytes is None:
            return None
        missing = self.peak_bytes + slack - self.available_bytes
        return missing if missing > 0 else None


def _costs(sizes: Sequence[int], freed: Sequence[int], disk: Sequence[bool], ring_bytes: int,
           chunk_bytes: int = 0) -> Tuple[int, int]:
    """(peak, final growth) of packing blocks with ``disk`` tiers: the disk blocks first (each written through
    a ``chunk_bytes`` buffer, then ComfyUI's copy freed), then the RAM blocks; the staging ring last (it is
    allocated at the first read)."""
    running, peak = 0, 0
    for size, gone, on_disk in zip(sizes, freed, disk):
        if on_disk:
            peak = max(peak, running + min(size, chunk_bytes or size))
            running -= gone
    for size, gone, on_disk in zip(sizes, freed, disk):
        if not on_disk:
            peak = max(peak, running + size)
            running += size - gone
    if any(disk):
        running += ring_bytes
    return max(peak, running), running


def plan_host_tiers(sizes: Sequence[int], freed: Sequence[int], mode: str, available: Optional[int],
                    ring_bytes: Optional[Callable[[Tuple[bool, ...]], int]] = None, margin: int = RAM_MARGIN_BYTES,
                    waiting: Optional[Sequence[bool]] = None, already_disk: Sequence[bool] = (),
                    chunk_bytes: int = 0, slack: int = PACKING_SLACK_BYTES,
                    padding_bytes: Sequence[int] = ()) -> TierPlan:
    """Choose each block's tier for ``mode`` (auto | ram | disk) and the cost of packing.

    ``sizes``: packed bytes per block; ``freed``: bytes of ComfyUI's copy each block's packing frees;
    ``ring_bytes(disk)``: the staging ring's bytes for a tier choice; ``waiting``: blocks not packed yet (the
    others cost nothing more and keep their tier, ``already_disk``); ``chunk_bytes``: the buffer a disk block is
    written through (0: the whole block); ``padding_bytes``: per block, the alignment padding among its bytes.
    """
    if mode not in HOST_STORES:
        raise ValueError(f"host_store must be one of {', '.join(HOST_STORES)}, got {mode!r}")
    n = len(sizes)
    waiting = tuple(waiting) if waiting is not None else (True,) * n
    fixed = tuple(already_disk) + (False,) * (n - len(already_disk))
    ring = ring_bytes or (lambda disk: 0)

    def plan(disk: Tuple[bool, ...], reason: str = "") -> TierPlan:
        costs = [(s, f, d) for s, f, d, w in zip(sizes, freed, disk, waiting) if w]
        needs_ring = any(d for _, _, d in costs) and not any(fixed)
        peak, growth = _costs([c[0] for c in costs], [c[1] for c in costs], [c[2] for c in costs],
                              ring(disk) if needs_ring else 0, chunk_bytes)
        return TierPlan(disk, peak, growth, ring(disk) if any(disk) else 0, available, margin, reason)

    def fits(candidate: TierPlan) -> bool:
        return candidate.shortfall(slack) is None

    if mode == "ram":
        return plan(tuple(f and not w for f, w in zip(fixed, waiting)))
    if mode == "disk":
        return plan((True,) * n, "host_store = disk")
    # The store aligns each tensor (host_store.ALIGNMENT_BYTES): its bytes exceed ComfyUI's by that padding alone.
    padding = sum(p for p, w in zip(padding_bytes or (0,) * n, waiting) if w)

    def as_comfyui_alone(candidate: TierPlan) -> bool:
        return candidate.growth_bytes <= padding and fits(candidate)

    disk = [f and not w for f, w in zip(fixed, waiting)]
    in_ram = plan(tuple(disk))
    if available is None or as_comfyui_alone(in_ram) or available - in_ram.growth_bytes >= margin:
        return in_ram  # no more RAM than ComfyUI's copy held, or the margin kept with every block in RAM
    best = in_ram
    for index in reversed(range(n)):
        if disk[index] or not waiting[index]:
            continue
        disk[index] = True
        best = plan(tuple(disk))
        if available - best.growth_bytes >= margin or as_comfyui_alone(best):
            break
    if not fits(best) and fits(in_ram):
        best = in_ram  # the disk plan's ring does not fit where packing into RAM does
    if not best.disk_blocks:
        return best
    free_after = available - best.growth_bytes
    reason = (f"host RAM: {available / 2**20:.0f} MiB available, {margin / 2**20:.0f} MiB kept free; "
              f"{free_after / 2**20:.0f} MiB left with {best.disk_blocks} blocks on disk")
    return TierPlan(best.disk, best.peak_bytes, best.growth_bytes, best.ring_bytes, available, margin, reason)


def refusal(plan: TierPlan, settings: str, ring: str, num_blocks: int,
            no_disk_tier: Optional[str] = None, disk_fits: bool = True) -> str:
    """The message refusing a packing ``plan`` that does not fit, with what helps (``settings``: the caller's
    settings as the user named them; ``ring``: the staging ring's size in words; ``no_disk_tier``: why
    this platform has none, so the disk tier is not offered; ``disk_fits``: whether every block on disk would
    fit, else the disk tier is not offered either: advice must work when followed)."""
    if not disk_fits and no_disk_tier is None:
        no_disk_tier = "even with every block on disk the staging ring would not fit"
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    head = (f"[layerwise-offload] host memory is short: packing the blocks needs {mib(plan.peak_bytes)} more "
            f"at its peak (ComfyUI's copy of each block is freed as it is packed) but only "
            f"{mib(plan.available_bytes)} is available ({settings}).")
    if plan.disk_blocks < num_blocks:
        disk = (f"host_store = disk (the blocks' host copies live in a cache file on disk, RAM holds a staging ring "
                f"of {ring}), " if no_disk_tier is None else "")
        platform = f" (No disk tier here: {no_disk_tier}.)" if no_disk_tier is not None else ""
        return (f"{head} Every block is kept in host RAM whatever resident_layers is, so raising it does not help. "
                f"What helps: {disk}unload other models (or restart ComfyUI), a smaller checkpoint or an fp8/GGUF "
                f"one, pin_memory off, or more RAM.{platform}")
    return (f"{head} Even with every block on disk the staging ring ({mib(plan.ring_bytes)}) does not fit. "
            f"What helps: unload other models (or restart ComfyUI), an fp8/GGUF checkpoint, or more RAM.")
