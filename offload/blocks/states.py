"""Each block's state on the device, as the manager's step moves it: copied in (materialized), waited for, running,
released; and hidden, a block prefetched by the last forward whose parameters point back at its host copy until
its own pre-hook queues the wait for its copy (see ``LayerwiseOffloadManager.end_forward``)."""

from __future__ import annotations

from typing import Dict, List, Optional


class BlockStates:
    """The per-block state of one manager's plan; :meth:`clear` when the plan's device memory is given back."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.clear()

    def clear(self) -> None:
        self.materialized: List[bool] = [False] * self.num_blocks  # change it only through copied_in / released
        self.count = 0  # of materialized blocks, kept as they change: the peak counters read it at every copy
        self.running: List[int] = [0] * self.num_blocks  # calls of the block in progress (re-entrant models)
        # The prefetch before the block ran left copies (of pageable blocks, or for want of a slot) to the pass after.
        self.deferred: List[bool] = [False] * self.num_blocks
        self._pending: List[Optional[object]] = [None] * self.num_blocks  # the copy compute has not waited for yet
        self._device_views: Dict[int, list] = {}  # what a materialized block's parameters view on the device
        self._hidden: set = set()
        self.head_pending: Dict[int, object] = {}  # streamed block -> its head's copy, not waited for yet

    def materialized_blocks(self) -> List[int]:
        return [i for i, m in enumerate(self.materialized) if m]

    def copied_in(self, index: int, views: list, handle) -> None:
        """Block ``index``'s copy into ``views`` is queued (``handle``) and its parameters point there."""
        self._pending[index] = handle
        self._device_views[index] = views
        self._hidden.discard(index)
        if not self.materialized[index]:
            self.materialized[index] = True
            self.count += 1

    def released(self, index: int) -> None:
        if self.materialized[index]:
            self.materialized[index] = False
            self.count -= 1
        self._pending[index] = None
        self._hidden.discard(index)
        self._device_views.pop(index, None)

    def take_pending(self, index: int):
        """The copy of ``index`` compute must wait for now (None: waited for already), then forgotten."""
        handle, self._pending[index] = self._pending[index], None
        return handle

    def hide_pending(self) -> List[int]:
        """The materialized blocks whose copy nobody waited for yet, now hidden (the caller points them at the host)."""
        hidden = [i for i, handle in enumerate(self._pending) if handle is not None and i not in self._hidden]
        self._hidden.update(hidden)
        return hidden

    def unhide(self, index: int) -> Optional[list]:
        """The device views to point a hidden block at again once its wait is queued (None: it was not hidden)."""
        if index not in self._hidden:
            return None
        self._hidden.discard(index)
        return self._device_views[index]
