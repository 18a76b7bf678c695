"""bench/g5_bytes.py: ComfyUI's own partial load run on the meta device, and the node's plan under the same budget."""

from layerwise_offload.bench import g5_bytes


def test_both_figures_stream_what_the_budget_leaves_and_no_less():
    row, = g5_bytes.rows(keys=["flux1_dev"], fractions=(0.7,))
    weights, budget = row["weights_bytes"], row["budget_bytes"]
    comfy, ours = row["comfy_lowvram_bytes_per_step"], row["ours_bytes_per_step"]
    # ComfyUI leaves unloaded what B does not hold plus its offload streams' share (three of its largest modules:
    # Flux's largest linear is a single block's linear1, 3072 x 21504 bf16, 126 MiB)
    assert weights - budget < comfy <= weights - budget + 3 * 3072 * 21504 * 2
    # ours: what B does not hold plus the two slots of the largest streamed block (Flux's double block, 648 MiB)
    assert weights - budget < ours <= weights - budget + 2 * 680 * 2**20
    assert row["ours_over_comfy"] == round(ours / comfy, 3) and 0 < row["ours_resident"] < 57
