"""The host side of a manager: where each block's host copy lives (RAM or disk), packing, pinning; the tiers are
planned by :class:`~.tier_planning.TierPlanner`."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..disk.checkpoint import drop_cached_pages
from ..disk.budget import TierPlan
from ..disk.tier import CHUNK_BYTES, DiskSource, DiskTier
from ..disk.mappings import MappedFiles, checkpoint_extents
from ..formatting import format_bytes
from ..memory.ram import pinnable_bytes
from ..memory.pinning import default_pinner, return_freed_host_memory
from .environment import DEVICE_DEFAULT, HostEnvironment
from .packing import HostStore, _packed_sources, block_parameters, params_are_inference, plan_layout
from .tier_planning import TierPlanner
from .tiers import HostTier, RamTier

log = logging.getLogger("layerwise_offload")


class HostSide:
    """Where the blocks' host copies live, and how a copy gets its bytes: the host store's RAM tier and, for the
    blocks that do not fit in RAM, the disk tier. Both answer one interface (``holds``, ``read_ahead``,
    ``source``: the host tensor to copy from, or a disk block's chunked source; ``copied``: the copy from it is
    queued; ``pageable``).

    ``settings()`` reads the manager's config, which only the manager holds (host_store, prefetch_size,
    pin_memory); ``environment`` is what the machine provides (:class:`HostEnvironment`). Which tier each block
    gets, and whether the host RAM allows packing, is the ``planner``'s (:class:`~.tier_planning.TierPlanner`).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device, settings: Callable[[], Any],
                 environment: Optional[HostEnvironment] = None):
        self.blocks = blocks
        self.device = device
        self._settings = settings
        self.environment = environment = environment or HostEnvironment()
        self.pinner = default_pinner(device) if environment.pinner == DEVICE_DEFAULT else environment.pinner
        self.planner = TierPlanner(blocks, settings, environment)
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
        """The disk tier's staging chunks (:attr:`.tier_planning.TierPlanner.ring_size`)."""
        return self.planner.ring_size

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
            plan = self.tier_plan = self.planner.plan(indices, mapped_files=mapped_files, disk=self.disk)
            if plan.reason:  # blocks on disk, or kept in RAM off a slow disk: which, and why
                log.info("[layerwise-offload] host store: %d of %d blocks on disk (%s); cache folder %s",
                         plan.disk_blocks, len(self.blocks), plan.reason, self.environment.cache_folder())
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

    def _disk_tier(self, expected_bytes: int) -> DiskTier:
        if self.disk is None:
            pinner = self.pinner if self.pin_memory else None
            self.disk = DiskTier(self.environment.cache_folder(), self.ring_size, pinner=pinner,
                                 expected_bytes=expected_bytes)
        plan = self.tier_plan
        self.disk.tight = plan is not None and plan.tight_ring
        return self.disk

    def tiers(self) -> List[str]:
        """Where each block's host copy lives now: "ram" or "disk" (before packing: the tier it will get)."""
        if self.store is None or not self.store.built:
            plan = self.planner.plan(range(len(self.blocks)), disk=self.disk)
            return ["disk" if d else "ram" for d in plan.disk]
        return ["disk" if self.disk is not None and self.disk.holds(i) else "ram" for i in range(len(self.blocks))]

    def _pack(self, index: int, mapped_files: Optional[MappedFiles] = None) -> list:
        plan = self.tier_plan
        on_disk = (self.disk is not None and self.disk.holds(index)) or (plan is not None and plan.disk[index])
        named = block_parameters(self.blocks[index])
        nbytes = plan_layout(named).nbytes
        # What would really fail: the block's new buffer (a disk block's write chunk) before ComfyUI's copy goes.
        need = min(nbytes, CHUNK_BYTES) if on_disk else nbytes
        self.planner.check_room(need, plan, self.disk, self.pin_memory)
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
            available = self.planner.available_bytes()
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
                log.warning("[layerwise-offload] page-locking %s of %s of streamed blocks to keep host memory "
                            "free (pinned memory cannot be swapped); the rest stays pageable and copies from it are "
                            "slower", format_bytes(total), format_bytes(requested))
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
        return self.planner.shortfall(waiting, mode, self.disk, self.pin_memory, settings)


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
