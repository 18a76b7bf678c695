"""What packing the host store really adds to host RAM, and which blocks must live on disk instead.

Packing a block copies its weights into one fresh buffer and then lets ComfyUI's copy go, block by block. So
the net growth of a block is its packed size minus the bytes of ComfyUI's copy that nobody else holds (a LoRA
backup or another model sharing the storage keeps it alive), and the peak is one block above the running net
growth (the new buffer exists before the old copy is freed). A block whose host copy lives on disk is written in
chunks straight from its weights (no block-sized buffer) and then frees ComfyUI's copy, so the blocks bound for
disk are packed first: the RAM they free is there before any RAM block needs its one block of headroom. The
disk tier's staging ring (a few chunks, whatever the block size: ``disk/tier.py`` ``staging_ring_bytes``) is
allocated at the first read, after packing, when that RAM is free again; where RAM leaves no choice but the disk,
its chunks are the small ones (8 MiB of ring instead of 32).

The auto tier (``host_store="auto"``) never asks for more RAM than ComfyUI's own copy of the model holds: where
packing every block into RAM adds nothing (ComfyUI's copies are freed as they are packed) and its one-block peak
fits, every block stays in RAM. Otherwise (weights that packing cannot free: a mapped checkpoint, shared
storages) it keeps blocks in RAM while the host keeps ``margin`` free after packing, and puts the rest on disk,
the blocks latest in the step first (the leading ones are the residents, read back most often when ComfyUI asks
for VRAM back). Among the plans it considers it takes one that fits over one that does not.

How fast the disk reads decides part of that (:mod:`.read_rate`: measured once per file system, or
``$LAYERWISE_OFFLOAD_DISK_READ_RATE``). The blocks RAM leaves no choice for go to disk whatever the disk: those
without which packing would not fit or would leave less than :data:`RAM_FLOOR_BYTES` free. The further blocks that
only keep the margin (:data:`RAM_MARGIN_BYTES`) go to disk only as far as reading them every step takes at most
:data:`DISK_STALL_BUDGET_S` (a disk block is read once per step where it is streamed, and the reads are counted
as if none hid behind compute: the chunked ring reads little ahead); the rest stay in RAM, and the host keeps less
than the margin free. The budget is a time, not a share of the step: packing happens when the model loads, before
any latent says how long a step computes. The plan's ``reason`` says which blocks went where and why, with the
rate and the predicted read time per step (the packing log line and the Stats node show it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .checkpoint import is_mapped
from ..config import HOST_STORES
from .mappings import MappedFiles
from ..formatting import format_mib, format_rate, format_seconds

__all__ = ["DISK_STALL_BUDGET_S", "HOST_STORES", "PACKING_SLACK_BYTES", "RAM_FLOOR_BYTES", "RAM_MARGIN_BYTES",
           "TierPlan", "freed_by_packing", "plan_host_tiers", "refusal", "shortfall_sum"]


# Allocator rounding, Python objects, the packing loop's own temporaries: what packing may take beyond its bytes.
PACKING_SLACK_BYTES = 64 * 2**20
# Auto keeps this much host memory free after packing (ComfyUI, the sampler and the OS still need some)...
RAM_MARGIN_BYTES = 512 * 2**20
# ... where the disk is fast enough; on a slower disk only this much (RAM then leaves no choice).
RAM_FLOOR_BYTES = 256 * 2**20
# What the blocks auto puts on disk only to keep its margin may cost a step in reads: a fraction of a large model's
# step, in which an SSD reads many blocks and a hard disk less than one (docs/internals.md).
DISK_STALL_BUDGET_S = 0.5


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
    tight_ring: RAM leaves no choice but the disk, so the staging ring is of its small chunks (``ring_bytes``
    counts them; ``disk/tier.py`` :data:`TIGHT_CHUNK_BYTES`).
    device_share_bytes: what a device living in host RAM (the CPU loopback) takes from it once the plan is armed,
    after packing: its streaming slots, residents and scratch (a GPU holds them in VRAM). Packing's peak and its
    temporaries are gone by then, so the two are weighed apart: packing needs ``peak_bytes`` + its slack, the armed
    plan ``growth_bytes`` + ``device_share_bytes``.
    """

    disk: Tuple[bool, ...]
    peak_bytes: int
    growth_bytes: int
    ring_bytes: int
    available_bytes: Optional[int]
    margin_bytes: int
    reason: str = ""
    read_rate: Optional[float] = None  # bytes per second of the disk blocks' file system, where it was asked for
    tight_ring: bool = False
    device_share_bytes: int = 0

    @property
    def disk_blocks(self) -> int:
        return sum(self.disk)

    def needed_bytes(self, slack: int = PACKING_SLACK_BYTES) -> int:
        """The host RAM the plan needs at its most: packing's peak with its slack, or the armed plan's growth
        beside what the device takes from RAM, whichever is more."""
        return max(self.peak_bytes + slack, self.growth_bytes + self.device_share_bytes)

    def free_after(self) -> Optional[int]:
        """Host RAM left once packed and armed (None: unknown)."""
        if self.available_bytes is None:
            return None
        return self.available_bytes - self.growth_bytes - self.device_share_bytes

    def shortfall(self, slack: int = PACKING_SLACK_BYTES) -> Optional[int]:
        """Bytes missing for packing to complete and the plan to arm (None: it fits, or the available memory is
        unknown)."""
        if self.available_bytes is None:
            return None
        missing = self.needed_bytes(slack) - self.available_bytes
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
                    ring_bytes: Optional[Callable[[Tuple[bool, ...], bool], int]] = None,
                    margin: int = RAM_MARGIN_BYTES,
                    waiting: Optional[Sequence[bool]] = None, already_disk: Sequence[bool] = (),
                    chunk_bytes: int = 0, slack: int = PACKING_SLACK_BYTES,
                    padding_bytes: Sequence[int] = (),
                    read_rate: Optional[Callable[[], Tuple[Optional[float], str]]] = None,
                    stall_budget_s: float = DISK_STALL_BUDGET_S, floor: int = RAM_FLOOR_BYTES,
                    device_share: int = 0) -> TierPlan:
    """Choose each block's tier for ``mode`` (auto | ram | disk) and the cost of packing.

    ``sizes``: packed bytes per block; ``freed``: bytes of ComfyUI's copy each block's packing frees;
    ``ring_bytes(disk, tight)``: the staging ring's bytes for a tier choice, of its usual or its small chunks
    (``tight``: where RAM leaves no choice but the disk, and for host_store = disk where the usual ring would not
    fit); ``waiting``: blocks not packed yet (the
    others cost nothing more and keep their tier, ``already_disk``); ``chunk_bytes``: the buffer a disk block is
    written through (0: the whole block); ``padding_bytes``: per block, the alignment padding among its bytes.
    ``read_rate()``: (bytes per second, how it was found, in words) of the file system the disk blocks are read
    from (None: unknown), asked only where some block may go to disk; auto weighs its optional disk blocks by it
    (``stall_budget_s``, ``floor``: see the module docstring). ``device_share``: what a device living in host RAM
    takes from it once armed, after packing (:attr:`TierPlan.device_share_bytes`); the margin and the floor are
    what is left beside it.
    """
    if mode not in HOST_STORES:
        raise ValueError(f"host_store must be one of {', '.join(HOST_STORES)}, got {mode!r}")
    n = len(sizes)
    waiting = tuple(waiting) if waiting is not None else (True,) * n
    fixed = tuple(already_disk) + (False,) * (n - len(already_disk))
    ring = ring_bytes or (lambda disk, tight: 0)
    rate_known: List[Tuple[Optional[float], str]] = []

    def rate() -> Tuple[Optional[float], str]:
        if not rate_known:
            rate_known.append(read_rate() if read_rate is not None else (None, "not measured"))
        return rate_known[0]

    def plan(disk: Tuple[bool, ...], reason: str = "", tight: bool = False) -> TierPlan:
        costs = [(s, f, d) for s, f, d, w in zip(sizes, freed, disk, waiting) if w]
        needs_ring = any(d for _, _, d in costs) and not any(fixed)
        ring_now = ring(disk, tight) if any(disk) else 0
        peak, growth = _costs([c[0] for c in costs], [c[1] for c in costs], [c[2] for c in costs],
                              ring_now if needs_ring else 0, chunk_bytes)
        known = rate_known[0][0] if rate_known else None
        return TierPlan(disk, peak, growth, ring_now, available, margin, reason, known, tight and any(disk),
                        device_share)

    def fits(candidate: TierPlan) -> bool:
        return candidate.shortfall(slack) is None

    def reading(disk: Sequence[bool], said: bool = False) -> str:
        """What reading the disk blocks costs a step, in words (``said``: how the rate was found is said already)."""
        nbytes = sum(s for s, d in zip(sizes, disk) if d)
        per_s, how = rate()
        if per_s is None:
            return "" if said else f"the disk's read rate is unknown ({how})"
        return (f"reading their {format_mib(nbytes)} takes {format_seconds(nbytes / per_s)} per step where all are "
                f"streamed, at {format_rate(per_s)}" + ("" if said else f" ({how})"))

    if mode == "ram":
        return plan(tuple(f and not w for f, w in zip(fixed, waiting)))
    if mode == "disk":
        every = (True,) * n
        usual = plan(every, f"host_store = disk; {reading(every)}")
        return usual if fits(usual) else plan(every, usual.reason, tight=True)
    # The store aligns each tensor (packing.ENTRY_ALIGNMENT_BYTES): its bytes exceed ComfyUI's by that padding alone.
    padding = sum(p for p, w in zip(padding_bytes or (0,) * n, waiting) if w)

    def as_comfyui_alone(candidate: TierPlan) -> bool:
        # Beside a device in host RAM (the CPU loopback) the plan takes the device's share more than ComfyUI alone:
        # it is as alone only where it still leaves the slack free beside it, for the forward's own temporaries
        # (ComfyUI alone has them). Where it does not, blocks go to disk and free ComfyUI's copies for the share.
        leaves_room = not device_share or candidate.free_after() >= slack
        return candidate.growth_bytes <= padding and fits(candidate) and leaves_room

    start = tuple(f and not w for f, w in zip(fixed, waiting))
    in_ram = plan(start)
    if available is None or as_comfyui_alone(in_ram) or (in_ram.free_after() >= margin and fits(in_ram)):
        return in_ram  # no more RAM than ComfyUI's copy held, or the margin kept with every block in RAM
    # The blocks latest in the step go first (the leading ones are the residents).
    order = [i for i in reversed(range(n)) if not start[i] and waiting[i]]

    def with_disk(count: int, tight: bool = False) -> TierPlan:
        disk = list(start)
        for index in order[:count]:
            disk[index] = True
        return plan(tuple(disk), tight=tight)

    def fewest(keeps: Callable[[TierPlan], bool], tight: bool = False) -> int:
        """The fewest blocks on disk, in ``order``, that leave a plan ``keeps`` accepts (all of them if none does)."""
        return next((count for count in range(len(order) + 1) if keeps(with_disk(count, tight))), len(order))

    # RAM leaves no choice below the floor, or where packing would not fit at all: judged with the small ring,
    # which such a plan then reads through (every MiB of ring is one less for ComfyUI and the sampler).
    forced = fewest(lambda p: (p.free_after() >= min(floor, margin) and fits(p)) or as_comfyui_alone(p), tight=True)
    tight = forced > 0
    keeps_margin = fewest(lambda p: p.free_after() >= margin or as_comfyui_alone(p), tight)
    optional = order[forced:keeps_margin]
    count, why = max(forced, keeps_margin), ""
    if optional:
        per_s, how = rate()
        optional_bytes = sum(sizes[i] for i in optional)
        if per_s is not None and optional_bytes / per_s > stall_budget_s:
            afford, spent = 0, 0
            for index in optional:  # the disk blocks it reads within the budget, in the same order
                if (spent + sizes[index]) / per_s > stall_budget_s:
                    break
                spent += sizes[index]
                afford += 1
            count = forced + afford
            why = (f"disk too slow for auto's {format_mib(margin)} RAM margin: {len(optional) - afford} blocks "
                   f"that keep it would take {format_seconds((optional_bytes - spent) / per_s)} more per step to "
                   f"read at {format_rate(per_s)} ({how}), over the {format_seconds(stall_budget_s)} auto allows, so "
                   f"they stay in RAM")
        elif per_s is None:
            why = (f"the disk's read rate is unknown ({how}): {len(optional)} blocks on disk keep auto's "
                   f"{format_mib(margin)} RAM margin, as on a fast disk")
        else:
            why = (f"disk fast enough: {len(optional)} blocks on disk keep auto's {format_mib(margin)} RAM margin "
                   f"({format_mib(optional_bytes)}, {format_seconds(optional_bytes / per_s)} per step at "
                   f"{format_rate(per_s)} ({how}), within the {format_seconds(stall_budget_s)} auto allows)")
    best = with_disk(count, tight)
    if not fits(best) and fits(in_ram):
        best = in_ram  # the disk plan's ring does not fit where packing into RAM does
    if not best.disk_blocks and not why:
        return best
    free_after = best.free_after()
    kept_free = min(floor, margin)
    forced_words = ("" if not forced else
                    f"RAM short: {forced} blocks must go to disk to leave {format_mib(kept_free)} free"
                    if free_after >= kept_free else
                    f"RAM short: {forced} blocks must go to disk for the plan to fit (less than the "
                    f"{format_mib(kept_free)} auto keeps free where it can)")
    beside = (f" beside the {format_mib(device_share)} the CPU loopback's slots and residents take"
              if device_share else "")
    head = (f"host RAM: {format_mib(available)} available, {format_mib(free_after)} left{beside} with "
            f"{best.disk_blocks} blocks on disk")
    parts = [head] + [words for words in (forced_words, why) if words]
    if best.disk_blocks:
        parts.append(reading(best.disk, said=bool(why)))
    known = rate_known[0][0] if rate_known else None
    return TierPlan(best.disk, best.peak_bytes, best.growth_bytes, best.ring_bytes, available, margin,
                    "; ".join(parts), known, best.tight_ring, device_share)


def _mib_up(nbytes: int) -> int:
    return -(-nbytes // 2**20)


def _mib_down(nbytes: int) -> int:
    return nbytes // 2**20


def shortfall_sum(plan: TierPlan, slack: int = PACKING_SLACK_BYTES) -> str:
    """The refusal's figures in one sum a user can check, in whole MiB (what is needed rounded up, what is
    available rounded down, the difference of the two as shown): what binds, packing's peak with its slack or
    the armed plan beside what the CPU loopback takes from RAM, against what is available."""
    available = _mib_down(plan.available_bytes or 0)
    if plan.peak_bytes + slack >= plan.growth_bytes + plan.device_share_bytes:
        peak, kept = _mib_up(plan.peak_bytes), _mib_up(slack)
        need = peak + kept
        what = (f"packing the blocks needs {peak} MiB at its peak (ComfyUI's copy of each block is freed as it is "
                f"packed) + {kept} MiB kept for packing's own temporaries = {need} MiB")
    else:
        share = _mib_up(plan.device_share_bytes)
        if plan.growth_bytes >= 0:
            growth = _mib_up(plan.growth_bytes)
            need = growth + share
            what = (f"the packed blocks add {growth} MiB + the CPU loopback's streaming slots and residents take "
                    f"{share} MiB of RAM (VRAM on a GPU) = {need} MiB")
        else:
            freed = _mib_down(-plan.growth_bytes)
            need = share - freed
            what = (f"the CPU loopback's streaming slots and residents take {share} MiB of RAM (VRAM on a GPU) - "
                    f"packing frees {freed} MiB = {need} MiB")
    return f"{what}, but {available} MiB is available: {need - available} MiB short"


def refusal(plan: TierPlan, settings: str, ring: str, num_blocks: int,
            no_disk_tier: Optional[str] = None, disk_fits: bool = True) -> str:
    """The message refusing a packing ``plan`` that does not fit, with what helps (``settings``: the caller's
    settings as the user named them; ``ring``: the staging ring's size in words; ``no_disk_tier``: why
    this platform has none, so the disk tier is not offered; ``disk_fits``: whether every block on disk would
    fit, else the disk tier is not offered either: advice must work when followed)."""
    if not disk_fits and no_disk_tier is None:
        no_disk_tier = "even with every block on disk the staging ring would not fit"
    every_on_disk = plan.disk_blocks == num_blocks
    where = (f"with every block on disk (a staging ring of {_mib_up(plan.ring_bytes)} MiB), " if every_on_disk
             else "")
    head = f"[layerwise-offload] host memory is short: {where}{shortfall_sum(plan)} ({settings})."
    if not every_on_disk:
        disk = (f"host_store = disk (the blocks' host copies live in a cache file on disk, RAM holds a staging ring "
                f"of {ring}), " if no_disk_tier is None else "")
        platform = f" (No disk tier here: {no_disk_tier}.)" if no_disk_tier is not None else ""
        return (f"{head} Every block is kept in host RAM whatever resident_layers is, so raising it does not help. "
                f"What helps: {disk}unload other models (or restart ComfyUI), a smaller checkpoint or an fp8/GGUF "
                f"one, pin_memory off, or more RAM.{platform}")
    return f"{head} What helps: unload other models (or restart ComfyUI), an fp8/GGUF checkpoint, or more RAM."
