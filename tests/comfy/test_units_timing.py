"""bench/units_timing.py: the FLOPs of each block split over its weight units' segments, and the plans it times
are the engine's (at the G5 budgets, fewer bytes than ComfyUI's own, predicted no faster than the bound)."""

import math

from layerwise_offload.bench import g5_bytes, timing_table, units_timing
from layerwise_offload.bench.activation_memory import FAMILIES


def test_unit_segments_split_every_blocks_flops_and_follow_the_call_order():
    template, _, _ = next(g5_bytes.templates(["flux1_dev"]))
    spec = FAMILIES[timing_table.FAMILY_OF_CONFIG[template.comfy_config]]
    latent = tuple(template.latent[1:])
    per_block, total, _, _ = timing_table.count_flops(spec, latent, template.cfg_batch)
    per_kind, outside, _, _ = units_timing.unit_segments(spec, latent, template.cfg_batch)
    assert len(per_kind) == len(per_block) == 2  # Flux: a double and a single block
    for (sizes, options, segments), flops in zip(per_kind, per_block):
        assert math.isclose(sum(segments), flops, rel_tol=1e-9)
        assert len(sizes) == len(options) == len(segments) and all(s >= 0 for s in segments)
    assert math.isclose(outside + sum(per_block), total, rel_tol=1e-9)
    double_sizes, _, double_segments = per_kind[0]
    # Flux's double block runs both modulations first: weight-heavy layers with one token of compute
    assert double_segments[0] < 1e-3 * max(double_segments) and double_sizes[0] >= max(double_sizes) / 2


def test_rows_time_the_engines_plans_within_the_budget():
    table = units_timing.rows(keys=["wan21_t2v_14b"], gpus=["RTX 4090 24GB"], prefetches=(1,))
    assert [r["budget_fraction"] for r in table] == list(g5_bytes.FRACTIONS)
    for row in table:
        assert row["ratio"] >= 1.0 and row["predicted_step_ms"] >= row["bound_ms"]
        assert row["g5_over_comfy"] == "" or row["g5_over_comfy"] <= 1.0
        assert row["slot_bytes"] <= 2 * 141.6e6  # two of Wan's largest weights, not two blocks
