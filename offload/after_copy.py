"""A per-block transform of the weights just copied to the device (a LoRA applied there, say).

The host store then keeps what the caller wants kept in RAM (the unpatched weights), and the device
copy of a block is what the model computes with. The transform runs every time a block is copied in:
once for a resident when the plan is armed, at every copy for a streamed block. It is queued on the
copy stream right after the copy and before the copy's completion event, so the compute stream's wait
for that event covers it, and the next copy into the same slot waits for the compute stream as before.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .resident_staging import PinnedBounce, bounce_for

# transform(block index, the block's weights on the device in ``BlockLayout.weights`` order); in place.
BlockTransform = Callable[[int, Sequence[torch.Tensor]], None]


class AfterCopyMixin:
    """The transform hook of :class:`LayerwiseOffloadManager`."""

    _after_copy: Optional[BlockTransform] = None
    _bounce: Optional[PinnedBounce] = None  # the page-locked ring residents are copied through while arming
    _bounce_refused = False  # the pinner refused it this arming: the residents copy from pageable memory
    resident_bounce_bytes: Optional[int] = None  # the ring's chunk size (None: resident_staging.CHUNK_BYTES)

    @property
    def after_copy(self) -> Optional[BlockTransform]:
        return self._after_copy

    def set_after_copy(self, transform: Optional[BlockTransform]) -> None:
        """Apply ``transform`` to every block copied to the device from now on (None: plain copies).

        Blocks on the device were copied with the old transform, so a different one releases them
        (residents included); the next forward copies them again.
        """
        if transform is self._after_copy:
            return
        if self.store is not None:
            self.release_all()
        self._after_copy = transform

    def _copy_in(self, index: int, device_buffer: torch.Tensor, host_buffer: torch.Tensor, after,
                 device_weights: Sequence[torch.Tensor]):
        transform = self._after_copy
        then = None
        if transform is not None:
            def then():
                with torch.no_grad():
                    transform(index, device_weights)
        bounce = self._resident_bounce(index)
        if bounce is not None:  # the host read the store buffer itself, synchronously
            return bounce.copy(self.backend, device_buffer, host_buffer, after=after, then=then)
        handle = self.backend.copy(device_buffer, host_buffer, after=after, then=then)
        self._host_reads[index] = handle  # the last copy reading the block's host buffer (host_side._sync_pinning)
        return handle

    def _resident_bounce(self, index: int) -> Optional[PinnedBounce]:
        """The bounce ring for a resident whose host copy is pageable, on an asynchronous device (resident_staging.py)."""
        if not (self.schedule.resident[index] and self.pin_memory and self.pinner is not None
                and self._copy_is_pageable(index)):
            return None
        if self._bounce is None and not self._bounce_refused:
            self._bounce = bounce_for(self.pinner, self.resident_bounce_bytes)
            self._bounce_refused = self._bounce is None
        return self._bounce

    def _retire_bounce(self, wait: bool = False) -> None:
        """Free the bounce ring once its copies are done (``wait``: wait for them); the next arming may ask again."""
        if self._bounce is not None and (wait or self._bounce.idle()):
            self._bounce.close()
            self._bounce = None
        if wait:
            self._bounce_refused = False
