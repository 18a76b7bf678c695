"""bench/g5_bytes.py: ComfyUI's own partial load run on the meta device, and the node's plan under the same budget."""

import pytest

from layerwise_offload.bench import g5_bytes
from layerwise_offload.devtools import dit_presets, dynamic_vram_standin, template_memory


def test_both_figures_stream_what_the_budget_leaves_and_no_less():
    row, = g5_bytes.rows(keys=["flux1_dev"], fractions=(0.7,))
    weights, budget = row["weights_bytes"], row["budget_bytes"]
    comfy, ours = row["comfy_lowvram_bytes_per_step"], row["ours_bytes_per_step"]
    # ComfyUI leaves unloaded what B does not hold plus its offload streams' share (three of its largest modules:
    # Flux's largest linear is a single block's linear1, 3072 x 21504 bf16, 126 MiB)
    assert weights - budget < comfy <= weights - budget + 3 * 3072 * 21504 * 2
    # ours, streamed tails: what B does not hold plus the two slots of the largest tail, and less than a weight's
    # worth more (the tails come in whole weights; Flux's smallest large weights are 18 MiB)
    tail = row["ours_largest_tail_bytes"]
    assert row["ours_policy"] == "tails" and row["ours_resident"] == 0 and 0 < tail < 680 * 2**20
    assert weights - budget + 2 * tail <= ours <= weights - budget + 2 * tail + 64 * 2**20
    assert row["ours_over_comfy"] == round(ours / comfy, 3)
    # whole blocks only: what B does not hold plus the two slots of the largest streamed block (Flux's double
    # block, 648 MiB); streamed tails move less
    whole = row["ours_whole_bytes_per_step"]
    assert weights - budget < whole <= weights - budget + 2 * 680 * 2**20
    assert ours < whole and row["ours_whole_over_comfy"] == round(whole / comfy, 3)
    # weight units (each module's weights stream on their own): what B does not hold plus two of the largest tail
    # streamed (a weight, not a block), less than streamed tails and than ComfyUI's own partial loading
    units, unit_tail = row["ours_weight_units_bytes_per_step"], row["ours_weight_units_largest_tail_bytes"]
    assert unit_tail < tail and weights - budget < units <= weights - budget + 2 * unit_tail + 64 * 2**20
    assert units < ours and units <= comfy and row["ours_weight_units_over_comfy"] == round(units / comfy, 4)


# ------------------------------------------------------------------------------ against ComfyUI 0.33's dynamic VRAM
MiB = 2**20


def test_dynamic_vram_keeps_the_first_pages_and_casts_what_reaches_past_them():
    """comfy-aimdo's rule on allocations laid out by hand: 32 MiB pages, the first W resident, a weight reaching past
    page W cast every forward through two cast buffers (16 MiB chunks) as large as the largest weight cast."""
    large = [(48 * MiB * k, 48 * MiB) for k in range(10)]  # 480 MiB: pages 0-14
    small = [(480 * MiB + 4 * MiB * k, 4 * MiB) for k in range(8)]  # 32 MiB: page 15
    allocations = large + small
    streamed = g5_bytes.dynamic_streamed_bytes
    assert streamed(0, allocations, 512 * MiB) == 0  # 16 pages hold all
    # 15 pages and two 16 MiB buffers for the small weights do not fit in 511; 14 pages cast the last large weight
    # too (its last page is 15), and the buffers grow to 48 MiB each; 12 pages (the ninth large one ends on page 14)
    # and 96 MiB of buffers fit
    assert streamed(0, allocations, 511 * MiB) == 2 * 48 * MiB + 32 * MiB
    assert streamed(0, allocations, 480 * MiB) == 2 * 48 * MiB + 32 * MiB
    assert streamed(0, allocations, 479 * MiB) == 3 * 48 * MiB + 32 * MiB
    # what is placed outright comes off the budget first
    assert streamed(32 * MiB, allocations, 512 * MiB) == 2 * 48 * MiB + 32 * MiB
    # room for the buffers only, or not even that: every weight is cast
    assert streamed(0, allocations, 96 * MiB) == streamed(0, allocations, 0) == 512 * MiB


@pytest.mark.skipif(not dynamic_vram_standin.available(), reason="needs ComfyUI 0.33+'s ModelPatcherDynamic")
def test_comfyui_033s_own_dynamic_load_lays_out_the_vbar():
    outright, allocations = g5_bytes.dynamic_load_layout(next(
        t for t in template_memory._templates(dit_presets) if t.key == "flux1_dev"))
    sizes = [size for _, size in allocations]
    # 0.33 puts the large weights in the VBAR largest first (the highest priority: the lowest pages) and the small
    # ones (norms, biases of tiny modules) on the device outright
    large = [s for s in sizes if s >= 64 * 1024]
    assert large == sorted(large, reverse=True) and large[0] == 3072 * 21504 * 2 + 21504 * 2  # linear1 + its bias
    assert all(offset % 512 == 0 for offset, _ in allocations)
    assert all(b[0] >= a[0] + a[1] for a, b in zip(allocations, allocations[1:]))
    weights = 23802816640  # the template's bf16 bytes (the lowvram row's weights_bytes)
    assert 0 < outright < 64 * MiB and weights <= outright + sum(sizes) <= weights + 1024 * len(sizes)


@pytest.mark.skipif(not dynamic_vram_standin.available(), reason="needs ComfyUI 0.33+'s ModelPatcherDynamic")
def test_ours_against_dynamic_vram_at_equal_vram():
    row, = g5_bytes.dynamic_rows(keys=["flux1_dev"], fractions=(0.7,))
    weights, budget = row["weights_bytes"], row["budget_bytes"]
    dynamic, ours = row["comfy_dynamic_bytes_per_step"], row["ours_bytes_per_step"]
    # dynamic VRAM casts what B does not hold, plus its two cast buffers and a page's rounding
    assert weights - budget < dynamic <= weights - budget + 2 * 128 * MiB + 32 * MiB
    assert row["ours_policy"] == "tails" and row["ours_over_dynamic"] == round(ours / dynamic, 3)
    lowvram, = g5_bytes.rows(keys=["flux1_dev"], fractions=(0.7,))
    assert ours == lowvram["ours_bytes_per_step"]
