"""The one interface a copy sees of where a block's host copy lives (:class:`HostTier`), and the RAM tier."""

from __future__ import annotations

from typing import Dict, Protocol, Sequence, Union, runtime_checkable

import torch

from ..disk.tier import DiskSource
from .packing import HostStore


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
