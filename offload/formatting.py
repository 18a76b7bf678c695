"""How the engine's messages write sizes, rates and durations, so that every part of it (and the nodes) writes
them alike."""

from __future__ import annotations

__all__ = ["format_bytes", "format_mib", "format_rate", "format_seconds"]


def format_bytes(nbytes: int) -> str:
    """``11.2 GiB`` from 0.1 GiB up, else MiB / KiB / B; keeps the sign."""
    sign = "-" if nbytes < 0 else ""
    value = abs(nbytes)
    for unit, scale, floor in (("GiB", 2**30, 2**30 // 10), ("MiB", 2**20, 2**20 // 10), ("KiB", 2**10, 2**10 // 10)):
        if value >= floor:
            return f"{sign}{value / scale:.1f} {unit}"
    return f"{sign}{value} B"


def format_mib(nbytes: float) -> str:
    """``512 MiB``: whole MiB, for a line whose figures are read side by side (the host RAM plan and its
    refusal, whose sum is checked in whole MiB)."""
    return f"{nbytes / 2**20:.0f} MiB"


def format_rate(bytes_per_s: float) -> str:
    """``2.50 GB/s``, ``150 MB/s``, ``8.2 MB/s``, ``1.0 kB/s`` (decimal units, as disks and links are sold)."""
    for unit, scale, digits in (("GB/s", 1e9, 2), ("MB/s", 10e6, 0), ("MB/s", 1e6, 1)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / (1e6 if unit == 'MB/s' else scale):.{digits}f} {unit}"
    return f"{bytes_per_s / 1e3:.1f} kB/s"


def format_seconds(value: float) -> str:
    """``0.42 s``, or ``12 ms`` below a tenth of a second (a tiny model's steps), ``0.4 ms`` below one."""
    if value >= 0.1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.0f} ms" if value >= 0.001 else f"{value * 1e3:.1f} ms"
