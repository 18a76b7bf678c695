"""Each block's state on the device, as the manager's step moves it: copied in (materialized), waited for and
pointed at, running, released.

A block copied in is not pointed at its device copy until its own pre-hook has queued the compute stream's wait
for that copy: until then its bytes may still be in flight, and code that reads the parameters outside the hooks
(ComfyUI, another model's run, a model that uses a block's weights without calling it) must not see them. It keeps
pointing at its host copy (or the placeholders) meanwhile, as a released block does."""

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
        self._unpointed: set = set()  # materialized blocks not yet pointed at their device views
        self.head_pending: Dict[int, object] = {}  # streamed block -> its head's copy, not waited for yet

    def materialized_blocks(self) -> List[int]:
        return [i for i, m in enumerate(self.materialized) if m]

    def copied_in(self, index: int, views: list, handle) -> None:
        """Block ``index``'s copy into ``views`` is queued (``handle``); its parameters point there from its
        pre-hook on (:meth:`to_point`)."""
        self._pending[index] = handle
        self._device_views[index] = views
        self._unpointed.add(index)
        if not self.materialized[index]:
            self.materialized[index] = True
            self.count += 1

    def released(self, index: int) -> None:
        if self.materialized[index]:
            self.materialized[index] = False
            self.count -= 1
        self._pending[index] = None
        self._unpointed.discard(index)
        self._device_views.pop(index, None)

    def take_pending(self, index: int):
        """The copy of ``index`` compute must wait for now (None: waited for already), then forgotten."""
        handle, self._pending[index] = self._pending[index], None
        return handle

    def pointed(self, index: int) -> bool:
        """Whether block ``index``'s parameters view its device copy."""
        return self.materialized[index] and index not in self._unpointed

    def to_point(self, index: int) -> Optional[list]:
        """The device views to point block ``index`` at now that the wait for its copy is queued (None: it points
        there already)."""
        if index not in self._unpointed:
            return None
        self._unpointed.discard(index)
        return self._device_views[index]
