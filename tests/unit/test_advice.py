"""The stats node's words: stalls ask for more residents; hidden copies name what could be freed."""

from layerwise_offload.offload.advice import RunReport, recommend

MiB = 2**20


def report(**changes):
    fields = dict(forwards=10, resident_blocks=4, num_blocks=10, resident_bytes=4 * 100 * MiB,
                  bytes_per_forward=6 * 100 * MiB, run_bytes=60 * 100 * MiB, copy_seconds=1.0,
                  stall_seconds=0.0, run_seconds=10.0, peak_device_bytes=0, pinned_host_bytes=0)
    fields.update(changes)
    return RunReport(**fields)


def test_a_stalled_run_asks_for_more_residents():
    text = recommend(report(stall_seconds=4.0), [100 * MiB] * 4)
    assert text.startswith("stalled 40% of the run") and "raise resident_layers" in text


def test_hidden_copies_name_the_count_and_the_memory_freed():
    # 10 forwards of 1 s with 0.1 s of copies each: 0.9 s spare per forward at 6.3 GB/s hides ~5.4 GB,
    # more than the four resident blocks hold, so all four could be streamed.
    text = recommend(report(), [100 * MiB] * 4)
    assert text == "copies fully hidden: lowering resident_layers to 0 would free 0.4 GiB of VRAM at no cost"
    # 26 ms spare per forward at 6.3 GB/s hides ~160 MB: only the last resident block fits in it.
    tight = report(run_seconds=1.26, copy_seconds=1.0)
    assert recommend(tight, [100 * MiB] * 4).startswith("copies fully hidden: lowering resident_layers to 3")
    none_spare = report(run_seconds=1.0, copy_seconds=1.0)
    assert recommend(none_spare, [100 * MiB] * 4).endswith("keep these settings")


def test_synchronous_copies_are_never_called_hidden():
    text = recommend(report(stall_seconds=0.1, asynchronous=False), [100 * MiB] * 4)
    assert text.startswith("copies are synchronous on this device") and "took 1% of the run" in text


def test_figures_read_like_the_log_line():
    text = report(stall_seconds=0.5).figures()
    assert "4/10 blocks resident (0.4 GiB)" in text and "0.6 GiB copied per forward" in text
    assert "stalled 5% of the run" in text
