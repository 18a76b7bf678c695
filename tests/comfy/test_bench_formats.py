"""The benchmark's weight-format comparison (``comfy_bench.py --formats``, bench/bench_formats.py) at the tiny Wan
on the CPU loopback: the same blocks in bf16, fp8 mixed precision (ComfyUI's QuantizedTensor) and GGUF Q4_0
(ComfyUI-GGUF, where shared/peers has it), each streamed at its stored size and bitwise equal to its own full load.
"""

import csv

import pytest

from layerwise_offload.bench import bench_formats, comfy_bench

RESIDENTS = (0, 2)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    config = comfy_bench.BenchConfig(preset="tiny_wan", device="cpu", steps=3, residents=RESIDENTS, prefetch=(1,),
                                     policies=("leading",), out=tmp_path_factory.mktemp("formats"), quiet=True,
                                     formats=bench_formats.FORMATS)
    return comfy_bench.run_formats_bench(config)


def ran_formats(skipped):
    return [f for f in bench_formats.FORMATS if not any(line.startswith(f + ":") for line in skipped)]


def test_each_format_is_loaded_as_the_weight_type_its_loader_makes(result):
    rows, skipped, _ = result
    formats = ran_formats(skipped)
    assert formats[:2] == ["bf16", "fp8_mixed"]  # only GGUF may be skipped (no ComfyUI-GGUF source here)
    kinds = {"bf16": "Parameter", "fp8_mixed": "QuantizedTensor", "gguf_q4_0": "GGMLTensor"}
    for fmt in formats:
        mine = [r for r in rows if r["format"] == fmt]
        assert [(r["mode"], r["resident"]) for r in mine] == [("full", 4)] + [("layerwise", r) for r in RESIDENTS]
        assert {r["weight_type"] for r in mine} == {kinds[fmt]}


def test_bytes_per_forward_are_the_streamed_blocks_stored_bytes(result):
    rows, _, _ = result
    for row in (r for r in rows if r["mode"] == "layerwise"):
        assert row["streamed_blocks"] == 4 - row["resident"]
        # What the counters saw moved is exactly what the layout packs for the streamed blocks ...
        assert row["h2d_bytes_per_forward"] == row["streamed_bytes_per_forward"], row
        # ... which is the weights' stored parts plus alignment padding, never their dequantized size. Each tensor
        # starts on a page of its own (offload/host/packing.py): a tiny block's tensors (an fp8 weight's scale too)
        # pad it by up to 12 % here, a real block's by well under 1 %.
        stored = row["streamed_stored_bytes"]
        assert stored <= row["streamed_bytes_per_forward"] < stored * 1.15, row
    ratio = {(r["format"], r["resident"]): r["vs_bf16"] for r in rows if r["mode"] == "layerwise"}
    for resident in RESIDENTS:
        assert ratio["bf16", resident] == 1.0
        assert 0.45 < ratio["fp8_mixed", resident] < 0.55  # 1 byte per weight + a scale per tensor, bf16 vectors
        if ("gguf_q4_0", resident) in ratio:
            assert 0.25 < ratio["gguf_q4_0", resident] < 0.32  # 18 bytes per 32 weights, float32 vectors


def test_every_output_is_bitwise_its_formats_full_load(result):
    rows, _, _ = result
    assert rows and all(r["bitwise_equal"] is True and not r["error"] for r in rows)


def test_csv_and_markdown_hold_every_row(result):
    rows, skipped, files = result
    with open(files["csv"], newline="") as f:
        read = list(csv.DictReader(f))
    assert [(r["format"], r["mode"], r["resident"]) for r in read] == \
        [(r["format"], r["mode"], str(r["resident"])) for r in rows]
    markdown = open(files["md"]).read()
    assert markdown.count("| layerwise |") == len([r for r in rows if r["mode"] == "layerwise"])
    assert all(line in markdown for line in skipped)


def test_gguf_without_its_peer_is_skipped_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_formats.peers, "peer_tarball", lambda *a, **k: None)
    lines = []
    loaders, skipped = bench_formats._loaders(("gguf_q4_0",), {}, tmp_path, lines.append)
    assert loaders == {} and skipped == lines and len(skipped) == 1
    assert skipped[0].startswith("gguf_q4_0: skipped, no shared/peers/ComfyUI-GGUF")
