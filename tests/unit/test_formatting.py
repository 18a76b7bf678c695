"""Sizes, rates and durations as the engine's messages write them."""

from layerwise_offload.offload.formatting import format_bytes, format_mib, format_rate, format_seconds

MiB = 2**20
GiB = 2**30


def test_bytes_in_the_largest_unit_from_a_tenth_of_it():
    assert format_bytes(int(11.2 * GiB)) == "11.2 GiB"
    assert format_bytes(300 * MiB) == "0.3 GiB"
    assert format_bytes(5 * MiB) == "5.0 MiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(-2 * GiB) == "-2.0 GiB"


def test_whole_mib():
    assert format_mib(512 * MiB) == "512 MiB"
    assert format_mib(3 * GiB) == "3072 MiB"


def test_rates_in_decimal_units():
    assert [format_rate(r) for r in (2.5e9, 150e6, 8.2e6, 1e3)] == ["2.50 GB/s", "150 MB/s", "8.2 MB/s", "1.0 kB/s"]


def test_seconds_read_at_any_size():
    assert [format_seconds(v) for v in (2.345, 0.1, 0.042, 0.0004)] == ["2.35 s", "0.10 s", "42 ms", "0.4 ms"]
