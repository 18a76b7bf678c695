"""Building the host store from the blocks, and keeping it in step with them."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable, List, Optional, Sequence

import torch

from .checkpoint_file import drop_cached_pages, locate
from .disk_budget import PACKING_SLACK_BYTES, RAM_MARGIN_BYTES, TierPlan, freed_by_packing, plan_host_tiers
from .disk_file import padded
from .disk_tier import DiskTier
from .host_memory import pinnable_bytes
from .pinning import return_freed_host_memory
from .host_store import HostStore, _packed_sources, block_parameters, params_are_inference, plan_layout
from .tensor_subclass import point_param_at, weight_pointer

log = logging.getLogger("layerwise_offload")

DISK_DIR_ENV = "LAYERWISE_OFFLOAD_DISK_DIR"


def default_disk_folder() -> str:
    """Where the disk tier writes when nobody chose: $LAYERWISE_OFFLOAD_DISK_DIR, else the system temp folder."""
    return os.environ.get(DISK_DIR_ENV) or os.path.join(tempfile.gettempdir(), "layerwise-offload")


class HostSideMixin:
    """The host half of :class:`LayerwiseOffloadManager`: packing (into RAM or the disk tier), pinning, resync."""

    _disk: Optional[DiskTier] = None  # the disk tier's file and staging ring, while some block lives on disk
    _store_mode: Optional[str] = None  # the host_store setting the store was packed under
    _tier_plan: Optional[TierPlan] = None
    disk_folder: Optional[str] = None  # None: default_disk_folder()

    def prepare(self, progress: Optional[Callable[[int, int], None]] = None) -> List[int]:
        """Build the host store from the blocks' current parameters, or bring it up to date.

        The first call packs every block. Later calls repack only blocks whose parameters were
        replaced or moved by someone else (a LoRA bake swapping Parameter objects, a whole-model
        ``.to()``), and return their indices; an unchanged model costs a pointer comparison.
        ``progress(done, total)`` is called after each packed block (a UI progress bar).
        """
        inference = bool(block_parameters(self.blocks[0])) and block_parameters(self.blocks[0])[0][1].is_inference()
        old_disk = None
        if self.store is None or inference != self.inference_tensors or self._store_mode != self.config.host_store:
            # Parameters made under inference_mode (ComfyUI loads models inside it) are inference
            # tensors and accept only inference tensors as .data: every buffer follows their kind.
            # A new host_store setting repacks every block from where it is now (RAM or the old file).
            self.inference_tensors = inference
            if self.armed:
                self.release_all()
            if self.store is not None:
                if self.store.built:  # released blocks may point at placeholders: repack from the old copies
                    for index in range(self.num_blocks):
                        self._point_at(index, self.store.weight_views(index))
                self.store.clear()
            old_disk, self._disk = self._disk, None
            self.store = HostStore([plan_layout(named) for named in self._named_params], self.pinner)
            self._store_mode = self.config.host_store
            changed = list(range(self.num_blocks))
        else:
            changed = [i for i in range(self.num_blocks) if not self._block_is_ours(i)]
        if changed and self.armed:
            self.release_all()
        if changed:
            self._tier_plan = self._plan_tiers(changed)
            if self._tier_plan.disk_blocks:
                log.info("[layerwise-offload] host store: %d of %d blocks on disk (%s) in %s", self._tier_plan.disk_blocks,
                         self.num_blocks, self._tier_plan.reason, self.disk_folder or default_disk_folder())
        self._pack_blocks(changed, progress)
        disk = self._disk
        if changed and disk is not None and disk.extents:
            log.info("[layerwise-offload] host store: %d disk blocks read straight from the checkpoint (nothing "
                     "written for them), %d from the cache file", len(disk.extents), len(disk.regions) - len(disk.extents))
        if old_disk is not None:
            old_disk.close()
        return changed

    # ----------------------------------------------------------------- tiers
    def _plan_tiers(self, waiting: Sequence[int], mode: Optional[str] = None) -> TierPlan:
        """Which blocks' host copies go to disk under ``config.host_store``, and what packing ``waiting`` costs."""
        waiting_set = set(waiting)
        named = [block_parameters(block) for block in self.blocks]
        sizes = [plan_layout(n).nbytes for n in named]
        freed = [freed_by_packing([p for _, p in n]) if i in waiting_set else 0 for i, n in enumerate(named)]
        disk = self._disk
        ring = self._ring_size()
        return plan_host_tiers(
            sizes, freed, mode or self.config.host_store, self.available_host_bytes(),
            ring_bytes=lambda tiers: ring * max((padded(s) for s, d in zip(sizes, tiers) if d), default=0),
            margin=RAM_MARGIN_BYTES, waiting=[i in waiting_set for i in range(self.num_blocks)],
            already_disk=[disk is not None and disk.holds(i) for i in range(self.num_blocks)])

    def _ring_size(self) -> int:
        return self.config.prefetch_size + 2  # the copies in flight, plus reads ahead of them

    def _disk_tier(self, expected_bytes: int) -> DiskTier:
        if self._disk is None:
            pinner = self.pinner if self.pin_memory else None
            self._disk = DiskTier(self.disk_folder or default_disk_folder(), self._ring_size(), pinner=pinner,
                                  expected_bytes=expected_bytes)
        return self._disk

    def host_tiers(self) -> List[str]:
        """Where each block's host copy lives now: "ram" or "disk" (before packing: the tier it will get)."""
        if self.store is None or not self.store.built:
            plan = self._plan_tiers(range(self.num_blocks))
            return ["disk" if d else "ram" for d in plan.disk]
        return ["disk" if self._disk is not None and self._disk.holds(i) else "ram" for i in range(self.num_blocks)]

    def _copy_source(self, index: int) -> torch.Tensor:
        """The host tensor block ``index`` is copied from: its store buffer, or the staging buffer it was read into."""
        disk = self._disk
        if disk is None or not disk.holds(index):
            return self.store.buffers[index]
        ahead = self._disk_lookahead(index)
        source = disk.source(index, protect=ahead)
        disk.read_ahead(ahead)
        return source

    def _copy_sourced(self, index: int, handle) -> None:
        if self._disk is not None and self._disk.holds(index):
            self._disk.copied(index, handle)

    def _disk_lookahead(self, index: int) -> List[int]:
        """The disk blocks the model runs after ``index``, as far as the ring reaches (learned call order first)."""
        if self.schedule is None:
            return []
        count = self.config.prefetch_size + self._ring_size()
        order = self._order
        position = order.locate(index, self._expected) if order is not None else None
        upcoming = (order.window(position, count) if position is not None
                    else self.schedule.upcoming_streamed(index, count))
        return [i for i in upcoming if i != index and self._disk.holds(i)]

    def repack_block(self, index: int) -> None:
        """Re-read one block's parameters (new objects or new values) into the host store."""
        if self.armed:
            self.release_all()
        if self.store is None:
            self.prepare()
        else:
            self._pack_blocks([index])

    def _pack_blocks(self, indices: Sequence[int], progress=None) -> None:
        for done, index in enumerate(indices, 1):
            self._pack(index)
            # The CPU weights packing replaced: glibc keeps freed heap pages unless trimmed, and on a host
            # short of RAM the next block's buffer must find them returned.
            return_freed_host_memory()
            if progress is not None:
                progress(done, len(indices))
        if indices:
            if self._disk is not None:
                self._disk.finish()
            self._sync_pinning()

    def _sync_pinning(self, schedule=None) -> None:
        """Page-lock exactly the streamed blocks (as many as the host can spare), nothing else.

        Residents are copied once per arming, so their host copy stays pageable. The store is
        already allocated, so pinning it takes no more RAM; the margin keeps the host from having
        all its memory locked. Streamed blocks late in the step are pinned first.
        """
        store = self.store
        if store is None or not store.built:
            return
        schedule = schedule or self.schedule or self._make_schedule()
        disk = self._disk
        streamed = [i for i in schedule.streamed_blocks if disk is None or not disk.holds(i)] if self.pin_memory else []
        sizes = {i: store.buffers[i].numel() for i in streamed}
        requested = sum(sizes.values())
        chosen = set()
        if requested:
            available = self.available_host_bytes()
            # The blocks are allocated already: what they take is available to lock them with.
            spare = None if available is None else available + requested
            allowed = pinnable_bytes(requested, cap=self.pin_cap_bytes, available=spare)
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
        for index in [i for i in range(self.num_blocks) if (i in chosen) != pinned[i]]:
            # (Un)registering memory a queued copy reads is undefined: wait for that block's last copy, not the
            # whole copy stream, and leave the blocks whose membership stayed alone (gigabytes to re-register).
            self.backend.wait_host(self._host_reads.pop(index, None))
            store.set_pinned(index, index in chosen)

    def _copy_is_pageable(self, index: int) -> bool:
        if self._disk is not None and self._disk.holds(index):
            return self.backend.asynchronous and not self._disk.pinned
        return self.backend.asynchronous and not self.store.is_pinned(index)

    def _drop_store(self, target: torch.device) -> None:
        """Give every parameter its own copy on ``target``, then unlock and free the store."""
        for index, layout in enumerate(self.store.layouts):
            with torch.inference_mode(params_are_inference(self._named_params[index])):
                if index in self.store.mapped and target.type == "cpu":
                    copies = self.store.views(index)  # the checkpoint's own tensors: no copy of a model bigger than RAM
                else:
                    copies = [view.to(target, copy=True) for view in self.store.views(index)]
                for weight, view in zip(layout.weights, layout.weights_from(copies)):
                    point_param_at(weight.param, view)
        self.store.clear()
        self.store = None
        if self._disk is not None:
            self._disk.close()
            self._disk = None
        self._store_mode = None
        return_freed_host_memory()

    def host_memory_shortfall(self, settings: Optional[str] = None, host_store: Optional[str] = None) -> Optional[str]:
        """Why packing the blocks not in the store yet would fail for want of host memory, or None.

        Counts what packing really adds: each block's buffer less the bytes of ComfyUI's copy it frees, one
        block above that at the peak, and the disk tier's staging ring where blocks go to disk
        (:mod:`.disk_budget`). ``settings`` names the caller's settings in the message (the node's inputs, say);
        ``host_store`` plans under that setting instead of the manager's own.
        """
        mode = host_store or self.config.host_store
        stale = self.store is None or self._store_mode != mode
        waiting = [i for i in range(self.num_blocks) if stale or self.store.buffers[i] is None]
        if not waiting:
            return None
        plan = self._plan_tiers(waiting, mode)
        missing = plan.shortfall()
        if missing is None:
            return None
        return self._refusal(plan, settings)

    def _refusal(self, plan: TierPlan, settings: Optional[str] = None) -> str:
        config = self.config
        settings = settings or (f"resident_layers={config.resident_layers}, prefetch_size={config.prefetch_size}, "
                                f"pin_memory={self.pin_memory}, host_store={config.host_store}")
        mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
        head = (f"[layerwise-offload] host memory is short: packing the blocks needs {mib(plan.peak_bytes)} more "
                f"at its peak (ComfyUI's copy of each block is freed as it is packed) but only "
                f"{mib(plan.available_bytes)} is available ({settings}).")
        if plan.disk_blocks < self.num_blocks:
            return (f"{head} Every block is kept in host RAM whatever resident_layers is, so raising it does not help. "
                    f"What helps: host_store = disk (the blocks' host copies live in a cache file on disk, RAM holds "
                    f"a staging ring of {config.prefetch_size + 2} blocks), unload other models (or restart "
                    f"ComfyUI), a smaller checkpoint or an fp8/GGUF one, pin_memory off, or more RAM.")
        return (f"{head} Even with every block on disk the staging ring ({mib(plan.ring_bytes)}) does not fit. "
                f"What helps: prefetch_size 1, unload other models (or restart ComfyUI), an fp8/GGUF checkpoint, "
                f"or more RAM.")

    def _pack(self, index: int) -> None:
        plan = self._tier_plan
        on_disk = (self._disk is not None and self._disk.holds(index)) or (plan is not None and plan.disk[index])
        ring = plan.ring_bytes if plan is not None else 0
        named = block_parameters(self.blocks[index])
        nbytes = plan_layout(named).nbytes
        available = self.available_host_bytes()
        # What would really fail: the block's new buffer (or the first staging ring) before ComfyUI's copy goes.
        need = (0 if self._disk is not None else ring) if on_disk else nbytes
        if available is not None and available < need + PACKING_SLACK_BYTES:
            tiers = plan.disk if plan is not None else (False,) * self.num_blocks
            raise MemoryError(self._refusal(TierPlan(tiers, need, need, ring, available, 0)))
        with torch.inference_mode(self.inference_tensors):
            named = block_parameters(self.blocks[index])
            self._named_params[index] = named
            layout = self.store.layouts[index] = plan_layout(named)
            sources = _packed_sources(layout)
            found = checkpoint_extents(layout, sources) if on_disk else None
            extents = None if found is None else found[0]
            if extents is not None:  # the checkpoint is the block's host copy: nothing to write
                self.store.set_pinned(index, False)
                self._disk_tier(0).place(index, layout.nbytes, extents, found[1], layout)
                self.store.keep_mapped(index, sources)
            elif on_disk:
                self.store.set_pinned(index, False)
                tier = self._disk_tier(sum(self.block_nbytes()))
                tier.expected_bytes = max(tier.expected_bytes, sum(self.block_nbytes()))
                self.store.buffers[index] = tier.write(index, layout.nbytes, lambda buffer: _fill(buffer, layout))
            else:
                if self._disk is not None:
                    self._disk.forget(index)
                self.store.pack_block(index, pin=False)  # page-locked by _sync_pinning, streamed blocks only
            if extents is None:
                # Packed from a mapped checkpoint: the pages read on the way are the file's, not needed again.
                drop_cached_pages(sources)
            del sources
            self._drop_views(index)
            self._materialized[index] = False
            self._point_released(index)

    def _block_is_ours(self, index: int) -> bool:
        expected = self._expected_pointers[index]
        named = block_parameters(self.blocks[index])
        if expected is None or len(named) != len(self._named_params[index]):
            return False
        return all(param is known and weight_pointer(param) == pointer
                   for (_, param), (_, known), pointer in zip(named, self._named_params[index], expected))


# A block is read from the checkpoint when at most this share of its bytes is not the file's (a converted scale
# of a quantized layer, say): those few bytes stay in RAM and are copied into the staging buffer with the reads.
CONVERTED_SHARE_LIMIT = 1 / 16


def checkpoint_extents(layout, sources):
    """``(extents, kept)`` for a block read from a mapped checkpoint: extents [(path, file offset, nbytes, offset in
    the layout)] of the entries that are byte for byte a contiguous tensor of the file, kept [(entry index,
    tensor)] for the rest (held in RAM); None when no entry is the file's, or the rest is more than
    :data:`CONVERTED_SHARE_LIMIT` of the block (``sources``: the entries' tensors now)."""
    extents, kept, kept_bytes = [], [], 0
    for position, (entry, source) in enumerate(zip(layout.entries, sources)):
        where = locate(source)
        if where is None or where[2] != entry.span_elements * entry.dtype.itemsize or source.dtype != entry.dtype:
            kept.append((position, source))
            kept_bytes += entry.span_elements * entry.dtype.itemsize
        else:
            extents.append((where[0], where[1], where[2], entry.offset))
    if not extents or kept_bytes > layout.nbytes * CONVERTED_SHARE_LIMIT:
        return None
    return extents, kept


def _fill(buffer: torch.Tensor, layout) -> None:
    """Pack a block's current parameter bytes into ``buffer`` (what HostStore.pack_block does into its own)."""
    with torch.no_grad():
        for view, source in zip(layout.views(buffer), _packed_sources(layout)):
            view.copy_(source)
