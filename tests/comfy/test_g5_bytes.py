"""bench/g5_bytes.py: ComfyUI's own partial load run on the meta device, and the node's plan under the same budget."""

from layerwise_offload.bench import g5_bytes


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
