"""A new plan applied over what the engine holds: what stays on the device stays, the rest is released."""

from __future__ import annotations

from .config import OffloadConfig
from .engine import BlockEngine
from .hooks import compiler_disable
from .schedule import Schedule


@compiler_disable
def keep_what_stays(engine: BlockEngine, config: OffloadConfig) -> None:
    """Release what the plan under ``config`` no longer holds where it is now, and unarm ``engine``, so that its next
    forward arms that plan over what stayed (see ``LayerwiseOffloadManager.apply``)."""
    memory, states = engine.device_memory, engine.states
    if engine.store is None or not engine.holds_device_memory():
        engine.reset_device_state()
        return
    try:
        schedule = Schedule.for_config(config, engine.num_blocks)
        ring = engine.geometry.footprint(schedule, config)
        keep_ring = memory.ring_is(ring.slot_count, ring.slot_size)
        splits = engine.geometry.splits(schedule, config)
        for index in range(engine.num_blocks):
            resident = index in memory.residents
            if resident and schedule.resident[index]:
                continue  # stays, copied and pointed as it is
            split_changed = splits[index] != engine.splits[index]
            if index in memory.heads and split_changed:  # its head is freed (another split, or now resident)
                engine.backend.wait_host(states.head_pending.pop(index, None))
                if states.materialized[index]:
                    engine.backend.wait_host(states.take_pending(index))
                    engine.mover.release(index)
                memory.drop_head(index)
                engine.params.drop_views(index)
            if resident or (states.materialized[index] and (schedule.resident[index] or not keep_ring
                                                            or split_changed)):
                # Its memory is freed or changes hands: a copy into it nobody waited for must be done first.
                engine.backend.wait_host(states.take_pending(index))
                engine.mover.release(index)
                if resident:
                    memory.drop_resident(index)
                    engine.params.drop_device_views(index)
        if not keep_ring:
            memory.drop_ring()
            engine.params.drop_device_views()
        engine.schedule = None
        engine.calls.set_plan(None)
    except BaseException:
        engine.release_all()
        raise


