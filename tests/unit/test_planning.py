"""One planning function: a request and a run's facts in, one plan out (offload/planning.py)."""

import pytest

from layerwise_offload.offload import OffloadRequest
from layerwise_offload.offload.planning import RunFacts, plan_run
from layerwise_offload.offload.request import AUTO, WEIGHTS

MB = 2**20
SIZES = [10 * MB] * 8


def facts(free_mb, **overrides):
    return RunFacts(sizes=SIZES, tail_options=[(2 * MB, 5 * MB, 10 * MB)] * len(SIZES), free_bytes=free_mb * MB,
                    reserve_bytes=MB, activation_bytes=MB, **overrides)


def test_a_fixed_count_is_the_plan_and_nothing_is_planned_for_it():
    planned = plan_run(OffloadRequest(resident_layers=3, policy="strided", prefetch_size=2), facts(1000))
    assert (planned.config.resident_layers, planned.config.policy, planned.config.prefetch_size) == (3, "strided", 2)
    assert planned.residency is None and planned.config.released_params == "host"


@pytest.mark.parametrize("free_mb,resident", [(1000, 8), (22, 0), (62, 4)])
def test_auto_keeps_as_many_blocks_as_fit_beside_the_slots(free_mb, resident):
    # 2 MB of reserve and activations, two slots of 10 MB: the rest holds residents of 10 MB (all 8 fit in 1000).
    planned = plan_run(OffloadRequest(resident_layers=AUTO, policy="leading"), facts(free_mb))
    assert planned.config.resident_layers == planned.residency.resident_count == resident
    assert planned.residency.fits


def test_auto_keeps_the_held_count_when_one_more_block_would_fit():
    request = OffloadRequest(resident_layers=AUTO, policy="leading")
    held = plan_run(request, facts(52)).config  # 3 resident
    planned = plan_run(request, facts(62, held=held))  # 4 would fit: one more is not worth a replan
    assert planned.config.resident_layers == 3 and planned.declined.resident_count == 4
    assert plan_run(request, facts(72, held=held)).config.resident_layers == 5  # two more: it moves
    assert plan_run(request, facts(42, held=held)).config.resident_layers == 2  # smaller always shrinks


def test_a_count_that_does_not_fit_the_budget_is_capped_before_its_fit_is_checked():
    request = OffloadRequest(resident_layers=6, policy="leading")
    assert plan_run(request, facts(52, resident_cap=3)).choice == ("leading", 1, 3)
    assert plan_run(request, facts(52)).choice == ("leading", 1, None)  # 6 do not fit: no candidate to prefer


def test_weights_plan_streams_the_fewest_bytes_that_fit():
    planned = plan_run(OffloadRequest(resident_layers=AUTO, granularity=WEIGHTS), facts(62))
    assert planned.residency.fits and planned.config.policy == "leading"
    assert planned.config.resident_layers == planned.residency.resident_count
    assert planned.config.streamed_tail_bytes == (planned.residency.tails or 0)


def test_requests_name_the_bad_value():
    with pytest.raises(ValueError, match="prefetch_size must be an integer >= 1, got 0"):
        OffloadRequest(prefetch_size=0)
    with pytest.raises(ValueError, match="set resident_layers to auto, not 2"):
        OffloadRequest(resident_layers=2, granularity=WEIGHTS)
    with pytest.raises(ValueError, match="resident_layers must be >= 0, got -1"):
        OffloadRequest(resident_layers=-1)
