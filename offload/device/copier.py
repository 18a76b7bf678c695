"""Copying one block's host bytes into its device buffer, with an optional transform of the copy.

The transform (a LoRA applied on the device, say) lets the host store keep what the caller wants kept in RAM
(the unpatched weights) while the device copy is what the model computes with. It runs every time a block is
copied in: once for a resident when the plan is armed, at every copy for a streamed block. The backend queues it on
a stream of its own once the copy's bytes are in, and the copy's completion event follows it, so the compute
stream's wait for that event covers it, the next copy into the same slot waits for the compute stream as before,
and the copy stream goes on to the next block's copy without waiting for the LoRA math.

A resident whose host copy is pageable goes through a small page-locked bounce ring (device/resident_copy.py). A
disk block has no host copy in RAM: its source (``disk/tier.py`` ``DiskSource``) reads it chunk by chunk through the
disk tier's own small staging ring and queues each chunk's copy into its place, the transform after the last.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .resident_copy import PinnedBounce, bounce_for

# transform(block index, the block's weights on the device in ``BlockLayout.weights`` order); in place. A weight the
# copy did not write is None: a streamed block's head is copied (and transformed) once, its tail at every copy.
BlockTransform = Callable[[int, Sequence[Optional[torch.Tensor]]], None]


class BlockCopier:
    """The copies of one manager: the transform after each, and the bounce ring residents are copied through."""

    def __init__(self):
        self.transform: Optional[BlockTransform] = None
        self.bounce: Optional[PinnedBounce] = None  # page-locked ring for the residents' copies while arming
        self._bounce_refused = False  # the pinner refused it this arming: the residents copy from pageable memory
        self.bounce_bytes: Optional[int] = None  # the ring's chunk size (None: resident_staging.CHUNK_BYTES)

    def copy(self, backend, index: int, device_buffer: torch.Tensor, host_buffer, after,
             device_weights: Sequence[torch.Tensor], bounce_pinner=None, written: Optional[Sequence[bool]] = None):
        """Queue the copy of block ``index`` after the compute mark ``after``, then the transform; returns the
        handle of its completion. ``host_buffer``: the host tensor, or a disk block's ``DiskSource`` (it stages
        itself). ``bounce_pinner``: copy through a bounce ring page-locked by it (if it can). ``written``: per weight,
        whether this copy writes it (a part of the block: its head or its tail); None: all of them."""
        transform = self.transform
        if transform is not None and written is not None:
            device_weights = [w if k else None for w, k in zip(device_weights, written)]

        def apply_transform():
            with torch.no_grad():
                transform(index, device_weights)
        then = apply_transform if transform is not None else None
        if not isinstance(host_buffer, torch.Tensor):  # a disk block: read and copied chunk by chunk (disk/tier.py)
            return host_buffer.copy_to(backend, device_buffer, after=after, then=then)
        bounce = self._bounce(bounce_pinner) if bounce_pinner is not None else None
        if bounce is not None:  # the host reads the host buffer itself, synchronously
            return bounce.copy(backend, device_buffer, host_buffer, after=after, then=then)
        return backend.copy(device_buffer, host_buffer, after=after, then=then)

    def _bounce(self, pinner) -> Optional[PinnedBounce]:
        if self.bounce is None and not self._bounce_refused:
            self.bounce = bounce_for(pinner, self.bounce_bytes)
            self._bounce_refused = self.bounce is None
        return self.bounce

    def retire_bounce(self, wait: bool = False) -> None:
        """Free the bounce ring once its copies are done (``wait``: wait for them); the next arming may ask again."""
        if self.bounce is not None and (wait or self.bounce.idle()):
            self.bounce.close()
            self.bounce = None
        if wait:
            self._bounce_refused = False
