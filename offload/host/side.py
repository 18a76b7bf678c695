"""The host side of a manager: where each block's host copy lives (RAM or disk), packing, pinning."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any,  Callable, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch

from ..disk.checkpoint import drop_cached_pages
from ..disk.budget import (PACKING_SLACK_BYTES, RAM_MARGIN_BYTES, TierPlan, freed_by_packing, plan_host_tiers,
                          refusal)
from ..disk.cache_file import disk_tier_unsupported
from ..disk import tier as disk_tier
from ..disk.tier import CHUNK_BYTES, DiskSource, DiskTier, staging_ring_bytes
from ..disk.mappings import MappedFiles, checkpoint_extents
from ..disk.checkpoint import locate
from ..disk.read_rate import disk_read_rate
from ..memory.ram import available_host_bytes, pinnable_bytes
from ..memory.pinning import default_pinner, return_freed_host_memory
from .packing import HostStore, _packed_sources, block_parameters, params_are_inference, plan_layout

log = logging.getLogger("layerwise_offload")

DISK_DIR_ENV = "LAYERWISE_OFFLOAD_DISK_DIR"


def default_disk_folder(fallback: Optional[str] = None) -> str:
    """Where the disk tier writes: $LAYERWISE_OFFLOAD_DISK_DIR (read when the file is made), else ``fallback``,
    else the system temp folder."""
    return os.environ.get(DISK_DIR_ENV) or fallback or os.path.join(tempfile.gettempdir(), "layerwise-offload")


DEVICE_DEFAULT = "device default"


@dataclass(frozen=True)
class HostEnvironment:
    """What the machine around a manager provides: given once, when the manager is made, and never changed.

    ``pinner`` page-locks host buffers (None: never); by default the device's own (none for the CPU).
    ``pin_cap`` is an outside cap on page-locked bytes (ComfyUI's own limit): given the bytes this manager holds
    page-locked now, the most it may hold (None: no cap). It is asked each time the pinning is chosen, since other
    models pin and unpin between runs.
    ``available_host_bytes`` reads the host memory free to this process (None: unknown); by default the OS's
    figure, its memory cgroup included (:func:`~.ram.available_host_bytes`).
    ``disk_folder`` is where the disk tier's cache file goes unless $LAYERWISE_OFFLOAD_DISK_DIR says otherwise
    (None: the system temp folder; see :func:`default_disk_folder`).
    ``device_bytes_from_host`` (a device whose memory is host RAM, as the CPU loopback's): what the device will
    take beyond what it holds now (the armed plan's slots and residents, scratch beside them). The host store plans
    with that much less, as it would beside a GPU holding them in VRAM; otherwise it fills the RAM the slots are
    then allocated from (a 10.8 GiB Flux in a 5.2 GiB cgroup: 4.3 GiB packed, then 1.3 GiB of slots, OOM-killed).
    """

    pinner: Any = DEVICE_DEFAULT
    pin_cap: Optional[Callable[[int], Optional[int]]] = None
    available_host_bytes: Optional[Callable[[], Optional[int]]] = None
    disk_folder: Optional[str] = None
    device_bytes_from_host: Optional[Callable[[], int]] = None


@runtime_checkable
class HostTier(Protocol):
    """Where some blocks' host copies live (:class:`RamTier`, :class:`~.disk_tier.DiskTier`), as a copy sees it."""

    def holds(self, index: int) -> bool:
        """Whether block ``index``'s host copy is here."""

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Start bringing the bytes of ``indices`` (the blocks copied next, in order) into staging buffers."""

    def source(self, index: int, protect: Sequence[int] = ()) -> Union[torch.Tensor, DiskSource]:
        """What block ``index``'s copy reads: its host tensor, in full (RAM), or a
        :class:`~..disk.tier.DiskSource` that reads it chunk by chunk as the copy goes (disk: the block is never
        whole in RAM). Reads ahead of ``protect`` (the blocks copied after it) come after its own."""

    def copied(self, index: int, handle) -> None:
        """The copy from :meth:`source` is queued; ``handle`` tells when it no longer reads that tensor."""

    def pageable(self, index: int) -> bool:
        """Whether the host stages that copy (pageable memory, or the disk tier's chunks): the manager issues such
        copies after the running block is launched."""


class RamTier:
    """Blocks whose host copy is their host-store buffer in RAM (page-locked where the plan streams them)."""

    def __init__(self, store: HostStore):
        self.store = store
        self._reads: Dict[int, object] = {}  # block -> the last copy queued from its buffer

    def holds(self, index: int) -> bool:
        return self.store.buffers[index] is not None

    def read_ahead(self, indices: Sequence[int]) -> None:
        """Nothing to read: the bytes are in RAM already."""

    def source(self, index: int, protect: Sequence[int] = ()) -> torch.Tensor:
        return self.store.buffers[index]

    def copied(self, index: int, handle) -> None:
        self._reads[index] = handle

    def pageable(self, index: int) -> bool:
        return not self.store.is_pinned(index)

    def set_pinned(self, backend, index: int, pin: bool) -> None:
        # (Un)registering memory a queued copy reads is undefined: wait for that block's last copy, not the whole
        # copy stream.
        backend.wait_host(self._reads.pop(index, None))
        self.store.set_pinned(index, pin)

    def settled(self) -> None:
        """Every copy has finished (the copy stream was synchronized)."""
        self._reads = {}


class HostSide:
    """Where the blocks' host copies live, and how a copy gets its bytes: the host store's RAM tier and, for the
    blocks that do not fit in RAM, the disk tier. Both answer one interface (``holds``, ``read_ahead``,
    ``source``: the host tensor to copy from, or a disk block's chunked source; ``copied``: the copy from it is
    queued; ``pageable``).

    ``settings()`` reads the manager's config, which only the manager holds (host_store, prefetch_size,
    pin_memory); ``environment`` is what the machine provides (:class:`HostEnvironment`).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device, settings: Callable[[], Any],
                 environment: Optional[HostEnvironment] = None):
        self.blocks = blocks
        self.device = device
        self._settings = settings
        self.environment = environment = environment or HostEnvironment()
        self.pinner = default_pinner(device) if environment.pinner == DEVICE_DEFAULT else environment.pinner
        self.store: Optional[HostStore] = None
        self.ram: Optional[RamTier] = None
        self.disk: Optional[DiskTier] = None  # the disk tier's file and staging ring, while some block lives on disk
        self.inference_tensors = False  # whether the store's buffers are inference tensors (the parameters' kind)
        self.mode: Optional[str] = None  # the host_store setting the store was packed under
        self.tier_plan: Optional[TierPlan] = None
        self._old_disk: Optional[DiskTier] = None  # what a repack reads from, closed once it is done
        self._last_pin_warning = None

    @property
    def pin_memory(self) -> bool:
        pin = self._settings().pin_memory
        return self.device.type != "cpu" if pin is None else pin

    @property
    def ring_size(self) -> int:
        """The disk tier's staging chunks (:data:`~..disk.tier.STAGING_CHUNKS`): a fixed few, whatever the block
        size or prefetch_size."""
        return disk_tier.STAGING_CHUNKS

    # ----------------------------------------------------------------- the copy's source
    def tier(self, index: int) -> HostTier:
        """The tier holding block ``index``'s host copy."""
        disk = self.disk
        return disk if disk is not None and disk.holds(index) else self.ram

    def reads_ahead(self, index: int) -> bool:
        """Whether block ``index``'s tier reads ahead (then :meth:`source` wants the blocks that run after it)."""
        return self.tier(index) is not self.ram

    def source(self, index: int, upcoming: Sequence[int] = ()) -> Union[torch.Tensor, DiskSource]:
        """What block ``index`` is copied from: its host tensor, ready, or a disk block's :class:`DiskSource`
        (read chunk by chunk as the copier copies it); reads of ``upcoming`` (the blocks copied next) are started
        where its tier reads ahead, after its own."""
        tier = self.tier(index)
        ahead = [i for i in upcoming if i != index and self.tier(i) is tier]
        source = tier.source(index, protect=ahead)
        tier.read_ahead(ahead)
        return source

    def copied(self, index: int, handle) -> None:
        """The copy of block ``index`` from :meth:`source` is queued; ``handle`` tells when it has finished."""
        self.tier(index).copied(index, handle)

    def pageable(self, index: int) -> bool:
        """Whether block ``index`` copies from pageable host memory."""
        return self.tier(index).pageable(index)

    def settled(self) -> None:
        """Every copy has finished (release_all synchronized the copy stream): the disk tier's reads ahead are
        waited for too, so a model dropped right after its release frees its cache file at once (a read in flight
        holds the file open until it ends)."""
        if self.ram is not None:
            self.ram.settled()
        if self.disk is not None:
            self.disk.settle_reads()

    # ----------------------------------------------------------------- packing
    def outdated(self, params) -> List[int]:
        """The blocks to pack (again): all of them without a store, for another kind of parameters or another
        host_store setting; else those whose parameters someone else replaced or moved (``params``: the
        manager's :class:`~.block_params.BlockParameters`). An unchanged model costs a pointer comparison."""
        if self._is_stale():
            return list(range(len(self.blocks)))
        return [i for i in range(len(self.blocks)) if not params.is_ours(i)]

    def _is_stale(self) -> bool:
        inference = params_are_inference(block_parameters(self.blocks[0]))
        return self.store is None or inference != self.inference_tensors or self.mode != self._settings().host_store

    def _restart(self, params) -> None:
        """A new, empty store. Parameters made under inference_mode (ComfyUI loads models inside it) are inference
        tensors and accept only inference tensors as .data: every buffer follows their kind. A released block may
        point at placeholders, so it is pointed at its old host copy (RAM or the old file) to repack from."""
        self.inference_tensors = params_are_inference(block_parameters(self.blocks[0]))
        if self.store is not None:
            if self.store.built:
                for index in range(len(self.blocks)):
                    params.point_at(index, self.store.layouts[index], self.store.weight_views(index))
            self.store.clear()
        self._old_disk, self.disk = self.disk, None
        self.store = HostStore([plan_layout(named) for named in params.named], self.pinner)
        self.ram = RamTier(self.store)
        self.mode = self._settings().host_store

    def pack(self, indices: Sequence[int], params, packed: Callable[[int], None], progress=None) -> None:
        """Pack blocks ``indices`` (from :meth:`outdated`) from their parameters now into their tier. After each
        block ``params`` learns its parameters and ``packed(index)`` runs (the manager points them at the new
        copy, which frees ComfyUI's), then ``progress(done, total)`` (a UI progress bar)."""
        if indices and self._is_stale():
            self._restart(params)
        # Another loader's read-only file mappings (ComfyUI-GGUF's .gguf): one snapshot for the pass. Their weights
        # free no RAM when packed, disk blocks are read from the file, and the pages packing reads are given back.
        mapped_files = MappedFiles() if indices else None
        if indices:
            plan = self.tier_plan = self._plan_tiers(indices, mapped_files=mapped_files)
            if plan.reason:  # blocks on disk, or kept in RAM off a slow disk: which, and why
                log.info("[layerwise-offload] host store: %d of %d blocks on disk (%s); cache folder %s",
                         plan.disk_blocks, len(self.blocks), plan.reason, self._disk_folder())
        if indices:  # the blocks bound for disk first: they free ComfyUI's copies before any RAM block needs room
            indices = sorted(indices, key=lambda i: not self.tier_plan.disk[i])
        for done, index in enumerate(indices, 1):
            params.repacked(index, self._pack(index, mapped_files))
            packed(index)
            # The CPU weights packing replaced: glibc keeps freed heap pages unless trimmed, and on a host
            # short of RAM the next block's buffer must find them returned.
            return_freed_host_memory()
            if progress is not None:
                progress(done, len(indices))
        disk = self.disk
        if indices and disk is not None:
            disk.finish()
            if disk.extents:
                log.info("[layerwise-offload] host store: %d disk blocks read straight from the checkpoint (nothing "
                         "written for them), %d from the cache file", len(disk.extents),
                         len(disk.regions) - len(disk.extents))
        if self._old_disk is not None:
            self._old_disk.close()
            self._old_disk = None

    def _plan_tiers(self, waiting: Sequence[int], mode: Optional[str] = None,
                    mapped_files: Optional[MappedFiles] = None) -> TierPlan:
        """Which blocks' host copies go to disk under ``config.host_store``, and what packing ``waiting`` costs.
        Where the platform has no disk tier, auto keeps every block in RAM and disk is refused."""
        mode = mode or self._settings().host_store
        unsupported = disk_tier_unsupported()
        if unsupported is not None:
            if mode == "disk":
                raise ValueError(f"[layerwise-offload] host_store = disk: {unsupported}. Use host_store = auto "
                                 f"or ram (every block's host copy in RAM)")
            mode = "ram"
        waiting_set = set(waiting)
        named = [block_parameters(block) for block in self.blocks]
        layouts = [plan_layout(n) for n in named]
        sizes = [layout.nbytes for layout in layouts]
        padding = [layout.nbytes - sum(e.span_elements * e.dtype.itemsize for e in layout.entries) for layout in layouts]
        if mapped_files is None and waiting_set:
            mapped_files = MappedFiles()
        freed = [freed_by_packing([p for _, p in n], mapped_files) if i in waiting_set else 0
                 for i, n in enumerate(named)]
        disk = self.disk
        ring = self.ring_size
        return plan_host_tiers(
            sizes, freed, mode, self._available_bytes(),
            ring_bytes=lambda tiers, tight: staging_ring_bytes(max((s for s, d in zip(sizes, tiers) if d), default=0),
                                                               ring, tight),
            margin=RAM_MARGIN_BYTES, waiting=[i in waiting_set for i in range(len(self.blocks))], chunk_bytes=CHUNK_BYTES,
            padding_bytes=padding,
            already_disk=[disk is not None and disk.holds(i) for i in range(len(self.blocks))],
            read_rate=lambda: self._read_rate(named, waiting, mapped_files))

    def _read_rate(self, named, waiting: Sequence[int], mapped_files: Optional[MappedFiles]):
        """(bytes per second, in words) of the file system the disk blocks would be read from: the checkpoint where
        the block latest in the step (the first to go to disk) is a mapped file's bytes, else the cache folder.
        (None, why) where it cannot be measured: the disk tier then fails with its own message, if used at all."""
        path = None
        for _, param in named[max(waiting, default=len(named) - 1)]:
            where = locate(param) or (mapped_files.locate(param) if mapped_files is not None else None)
            if where is not None:
                path = where[0]
                break
        path = path or self._disk_folder()
        try:
            rate = disk_read_rate(path)
        except OSError as error:
            return None, f"not measurable on {path}: {error}"
        return rate.bytes_per_s, rate.how

    def _available_bytes(self, beside_device: bool = True) -> Optional[int]:
        """Host RAM free to this process; with ``beside_device``, less what a device living in host RAM will take
        once the plan is armed (see :class:`HostEnvironment`)."""
        probe = self.environment.available_host_bytes
        free = available_host_bytes() if probe is None else probe()
        device_takes = self.environment.device_bytes_from_host
        if free is None or device_takes is None or not beside_device:
            return free
        # Packing's slack (its temporaries) is free again before the first forward takes the slots: kept once.
        return max(0, free - max(0, device_takes() - PACKING_SLACK_BYTES))

    def _disk_folder(self) -> str:
        return default_disk_folder(self.environment.disk_folder)

    def _disk_tier(self, expected_bytes: int) -> DiskTier:
        if self.disk is None:
            pinner = self.pinner if self.pin_memory else None
            self.disk = DiskTier(self._disk_folder(), self.ring_size, pinner=pinner,
                                 expected_bytes=expected_bytes)
        plan = self.tier_plan
        self.disk.tight = plan is not None and plan.tight_ring
        return self.disk

    def tiers(self) -> List[str]:
        """Where each block's host copy lives now: "ram" or "disk" (before packing: the tier it will get)."""
        if self.store is None or not self.store.built:
            plan = self._plan_tiers(range(len(self.blocks)))
            return ["disk" if d else "ram" for d in plan.disk]
        return ["disk" if self.disk is not None and self.disk.holds(i) else "ram" for i in range(len(self.blocks))]

    def _pack(self, index: int, mapped_files: Optional[MappedFiles] = None) -> list:
        plan = self.tier_plan
        on_disk = (self.disk is not None and self.disk.holds(index)) or (plan is not None and plan.disk[index])
        ring = plan.ring_bytes if plan is not None else 0
        named = block_parameters(self.blocks[index])
        nbytes = plan_layout(named).nbytes
        # The device's share is taken when the first forward arms the plan, after packing: this block's peak sees
        # the RAM as it is now (the tier plan already left the device its share of what packing keeps).
        available = self._available_bytes(beside_device=False)
        # What would really fail: the block's new buffer (a disk block's write chunk) before ComfyUI's copy goes.
        need = min(nbytes, CHUNK_BYTES) if on_disk else nbytes
        if available is not None and available < need + PACKING_SLACK_BYTES:
            tiers = plan.disk if plan is not None else (False,) * len(self.blocks)
            raise MemoryError(self._refusal(TierPlan(tiers, need, need, ring, available, 0)))
        with torch.inference_mode(self.inference_tensors):
            named = block_parameters(self.blocks[index])
            layout = self.store.layouts[index] = plan_layout(named)
            sources = _packed_sources(layout)
            found = checkpoint_extents(layout, sources, mapped_files) if on_disk else None
            extents = None if found is None else found[0]
            if extents is not None:  # the checkpoint is the block's host copy: nothing to write
                self.store.set_pinned(index, False)
                self._disk_tier(0).place(index, layout.nbytes, extents, found[1], layout)
                self.store.keep_mapped(index, sources)
            elif on_disk:
                self.store.set_pinned(index, False)
                total = sum(layout.nbytes for layout in self.store.layouts)
                tier = self._disk_tier(total)
                tier.expected_bytes = max(tier.expected_bytes, total)
                self.store.buffers[index] = tier.write(index, layout.nbytes, _block_pieces(layout, sources))
            else:
                if self.disk is not None:
                    self.disk.forget(index)
                self.store.pack_block(index, pin=False)  # page-locked by sync_pinning, streamed blocks only
            if extents is None:
                # Packed from a mapped checkpoint: the pages read on the way are the file's, not needed again.
                drop_cached_pages(sources)
                if mapped_files is not None:
                    mapped_files.drop_pages(sources)
            del sources
        return named

    # ----------------------------------------------------------------- pinning
    def sync_pinning(self, backend, streamed: Sequence[int]) -> None:
        """Page-lock exactly the ``streamed`` blocks in RAM (as many as the host can spare), nothing else.

        Residents are copied once per arming, so their host copy stays pageable. The store is
        already allocated, so pinning it takes no more RAM; the margin keeps the host from having
        all its memory locked. Streamed blocks late in the step are pinned first.
        """
        store = self.store
        if store is None or not store.built:
            return
        ram = self.ram
        streamed = [i for i in streamed if self.tier(i) is ram] if self.pin_memory else []
        sizes = {i: store.buffers[i].numel() for i in streamed}
        requested = sum(sizes.values())
        chosen = set()
        if requested:
            available = self._available_bytes()
            # The blocks are allocated already: what they take is available to lock them with.
            spare = None if available is None else available + requested
            cap = self.environment.pin_cap
            allowed = pinnable_bytes(requested, cap=None if cap is None else cap(store.pinned_nbytes()), available=spare)
            total = 0
            for index in sorted(streamed, reverse=True):
                if total + sizes[index] <= allowed:
                    chosen.add(index)
                    total += sizes[index]
            warning_key = (tuple(streamed), total)
            if total < requested and warning_key != self._last_pin_warning:
                self._last_pin_warning = warning_key
                log.warning("[layerwise-offload] page-locking %.2f of %.2f GiB of streamed blocks to keep host memory "
                            "free (pinned memory cannot be swapped); the rest stays pageable and copies from it are "
                            "slower", total / 2**30, requested / 2**30)
        pinned = store.pinned
        # Only the blocks whose membership changed: re-registering gigabytes that stayed would cost seconds.
        for index in [i for i in range(len(self.blocks)) if (i in chosen) != pinned[i]]:
            ram.set_pinned(backend, index, index in chosen)

    # ----------------------------------------------------------------- giving back
    def give_back(self, params, target: torch.device) -> None:
        """Give every block's parameters (``params``) tensors of their own on ``target``, then :meth:`close`."""
        store = self.store
        for index, layout in enumerate(store.layouts):
            with torch.inference_mode(params_are_inference(params.named[index])):
                if index in store.mapped and target.type == "cpu":
                    copies = store.views(index)  # the checkpoint's own tensors: no copy of a model bigger than RAM
                else:
                    copies = [view.to(target, copy=True) for view in store.views(index)]
                params.point_at(index, layout, layout.weights_from(copies))
        self.close()

    def close(self) -> None:
        """Unlock and free the store, close the disk tier (its cache file is deleted)."""
        if self.store is not None:
            self.store.clear()
        self.store = self.ram = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        self.mode = None
        return_freed_host_memory()

    # ----------------------------------------------------------------- host memory
    def shortfall(self, settings: Optional[str] = None, host_store: Optional[str] = None) -> Optional[str]:
        """Why packing the blocks not in the store yet would fail for want of host memory, or None.

        Counts what packing really adds: each block's buffer less the bytes of ComfyUI's copy it frees, one
        block above that at the peak, and the disk tier's staging ring where blocks go to disk
        (:mod:`.disk_budget`). ``settings`` names the caller's settings in the message (the node's inputs, say);
        ``host_store`` plans under that setting instead of the configured one.
        """
        mode = host_store or self._settings().host_store
        stale = self.store is None or self.mode != mode
        waiting = [i for i in range(len(self.blocks)) if stale or self.store.buffers[i] is None]
        if not waiting:
            return None
        plan = self._plan_tiers(waiting, mode)
        if plan.shortfall() is None:
            return None
        return self._refusal(plan, settings, waiting)

    def _refusal(self, plan: TierPlan, settings: Optional[str] = None, waiting: Optional[Sequence[int]] = None) -> str:
        config = self._settings()
        settings = settings or (f"resident_layers={config.resident_layers}, prefetch_size={config.prefetch_size}, "
                                f"pin_memory={self.pin_memory}, host_store={config.host_store}")
        unsupported = disk_tier_unsupported()
        disk_fits = True
        if unsupported is None and plan.disk_blocks < len(self.blocks):
            waiting = range(len(self.blocks)) if waiting is None else waiting
            disk_fits = self._plan_tiers(waiting, "disk").shortfall() is None
        ring = (f"{self.ring_size} chunks of at most {disk_tier.CHUNK_BYTES / 2**20:.0f} MiB, "
                f"{disk_tier.TIGHT_CHUNK_BYTES / 2**20:.0f} MiB where RAM is short")
        return refusal(plan, settings, ring, len(self.blocks), unsupported, disk_fits)


def _block_pieces(layout, sources) -> Iterator[Tuple[int, torch.Tensor]]:
    """A block's bytes as the store lays them out, entry by entry: (offset in the block, flat uint8 tensor). A
    dense entry is its weight's own bytes (no copy); a strided one is laid out in a buffer of its own span."""
    with torch.no_grad():
        for entry, source in sorted(zip(layout.entries, sources), key=lambda pair: pair[0].offset):
            nbytes = entry.span_elements * entry.dtype.itemsize
            dense = (source.is_contiguous() and source.dtype == entry.dtype and source.numel() == entry.span_elements
                     and tuple(source.stride()) == tuple(entry.stride))
            if dense and source.device.type == "cpu":
                yield entry.offset, source.detach().reshape(-1).view(torch.uint8)
                continue
            spread = torch.zeros(nbytes, dtype=torch.uint8)
            spread.view(entry.dtype).as_strided(entry.shape, entry.stride).copy_(source)
            yield entry.offset, spread
