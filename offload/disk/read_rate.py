"""How fast the disk tier's file system reads: measured once per file system, or set by hand.

Auto's host tier (:mod:`.budget`) weighs a disk block's cost per step by it: an HDD reads a Flux block in seconds
where an NVMe SSD takes a tenth of one. The rate is measured at the first plan that puts blocks on disk, with a
short read bounded in bytes and time (:data:`PROBE_BYTES`, :data:`PROBE_SECONDS`), in the disk tier's own request
size and number of readers, and kept per file system (``st_dev``) for the life of the process:

- the cache file's folder: a probe file is written, synced and dropped from the page cache, then read back;
- a checkpoint the blocks are read from (:mod:`.checkpoint`, :mod:`.mappings`): the file's own first bytes.

Reads bypass the page cache (O_DIRECT into page-aligned buffers), so a file read a moment ago does not pass for a
fast disk; where the file system refuses O_DIRECT (tmpfs, some network file systems) the pages are dropped
(``posix_fadvise(DONTNEED)``) before a buffered read, which is what the tier itself does there. A tmpfs reads at
RAM speed, and that is its true rate.

``$LAYERWISE_OFFLOAD_DISK_READ_RATE`` sets the rate instead (bytes per second, or with a unit: ``150MB/s``,
``2.5 GB/s``, ``800MiB/s``): for a disk the probe misjudges, and for tests.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict

from .cache_file import ALIGN, PROBE_PREFIX, aligned_buffer
from ..formatting import format_mib, format_seconds

__all__ = ["DISK_READ_RATE_ENV", "PROBE_BYTES", "PROBE_SECONDS", "DiskReadRate", "disk_read_rate",
           "forget_measured_rates", "parse_read_rate"]

DISK_READ_RATE_ENV = "LAYERWISE_OFFLOAD_DISK_READ_RATE"
PROBE_BYTES = 64 * 2**20  # the most the probe reads (and writes, in a cache-file folder)
PROBE_SECONDS = 0.5  # ... and for how long at most: an HDD or a throttled disk is judged in half a second
PROBE_REQUEST_BYTES = 1 * 2**20  # one read request (the tier's are 4 MiB: small ones let a slow disk finish a few)
PROBE_READERS = 4  # requests in flight, as the tier's reader threads keep them

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([kmgt]i?)?\s*(?:b(?:ytes?)?)?\s*(?:/\s*s(?:ec)?)?\s*$",
                   re.IGNORECASE)

_MEASURED: Dict[int, "DiskReadRate"] = {}  # st_dev -> its measured rate, for the life of the process
_LOCK = threading.Lock()


def parse_read_rate(text: str) -> float:
    """Bytes per second from ``text``: a number, optionally with a decimal (k, M, G, T) or binary (Ki, Mi, Gi, Ti)
    unit, optionally followed by ``B`` and ``/s`` (``150MB/s``, ``2.5 GB/s``, ``800MiB/s``, ``1.5e9``)."""
    found = _RATE.match(text)
    value = None
    if found:
        number, exponent, unit = found.groups()
        value = float(f"{number}e{exponent or 0}") * _UNITS[(unit or "").lower()]
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(f"[layerwise-offload] ${DISK_READ_RATE_ENV}={text!r} is not a read rate: give bytes per "
                         f"second above 0, as a number with an optional unit (150MB/s, 2.5GB/s, 800MiB/s, 1.5e9), "
                         f"or unset it to have the disk measured")
    return value


@dataclass(frozen=True)
class DiskReadRate:
    """A file system's read rate (bytes per second) and how it was found (in words, for the plan line)."""

    bytes_per_s: float
    how: str


def disk_read_rate(path: str) -> DiskReadRate:
    """The read rate of the file system holding ``path`` (a cache-file folder, made if missing, or a file the blocks
    are read from): ``$LAYERWISE_OFFLOAD_DISK_READ_RATE`` where set, else measured once per file system. Raises
    ValueError for a malformed setting and OSError where the probe cannot read or write there."""
    setting = os.environ.get(DISK_READ_RATE_ENV, "").strip()
    if setting:
        return DiskReadRate(parse_read_rate(setting), f"set by ${DISK_READ_RATE_ENV}")
    if not os.path.isfile(path):
        os.makedirs(path, exist_ok=True)
    device = os.stat(path).st_dev
    with _LOCK:  # one probe per file system, even when two models plan at once
        known = _MEASURED.get(device)
        if known is None:
            known = _MEASURED[device] = (_probe_file(path) if os.path.isfile(path) else _probe_folder(path))
    return known


def forget_measured_rates() -> None:
    """Measure every file system again at its next use (tests; a disk swapped under a running process)."""
    with _LOCK:
        _MEASURED.clear()


def _probe_folder(folder: str) -> DiskReadRate:
    """Write a probe file in ``folder`` (a hidden name that a killed process's next start removes as it does cache
    files), sync it, drop it from the page cache, read it back, delete it."""
    path = os.path.join(folder, f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        chunk = aligned_buffer(PROBE_REQUEST_BYTES)
        # Random bytes: a compressing or deduplicating file system would read zeros back at no cost.
        chunk.copy_(_random_bytes(chunk.numel()))
        view = memoryview(chunk.numpy()).cast("B")
        for offset in range(0, PROBE_BYTES, PROBE_REQUEST_BYTES):
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], offset + written)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rate, how = _timed_read(path, PROBE_BYTES)
    finally:
        os.close(fd)
        os.unlink(path)
    return DiskReadRate(rate, f"measured on {folder} ({how})")


def _probe_file(path: str) -> DiskReadRate:
    size = os.path.getsize(path) // ALIGN * ALIGN
    if size < PROBE_READERS * PROBE_REQUEST_BYTES:  # a few KiB time the latency, not the rate: not kept
        raise OSError(f"{path} is too small to measure a read rate on ({os.path.getsize(path)} bytes)")
    rate, how = _timed_read(path, min(size, PROBE_BYTES))
    return DiskReadRate(rate, f"measured on {os.path.dirname(path) or '.'} ({how})")


def _random_bytes(nbytes: int):
    import torch
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def _open_uncached(path: str):
    """(descriptor, whether O_DIRECT) for reading ``path`` past the page cache."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, os.O_RDONLY | direct), True
        except OSError:  # EINVAL: this file system has no O_DIRECT
            pass
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd, False


def _timed_read(path: str, nbytes: int):
    """(bytes per second, how) reading the first ``nbytes`` of ``path`` (a 4 KiB multiple) in rounds of
    :data:`PROBE_READERS` requests, until every byte is read or :data:`PROBE_SECONDS` have passed (one round at
    least)."""
    fd, direct = _open_uncached(path)
    buffers = [memoryview(aligned_buffer(PROBE_REQUEST_BYTES).numpy()).cast("B") for _ in range(PROBE_READERS)]

    def read(slot: int, offset: int) -> int:
        view = buffers[slot][:min(PROBE_REQUEST_BYTES, nbytes - offset)]
        return os.preadv(fd, [view], offset)

    try:
        offsets = list(range(0, nbytes, PROBE_REQUEST_BYTES))
        done, started = 0, time.perf_counter()
        with ThreadPoolExecutor(max_workers=PROBE_READERS, thread_name_prefix="layerwise-offload-probe") as pool:
            for first in range(0, len(offsets), PROBE_READERS):
                batch = offsets[first:first + PROBE_READERS]
                done += sum(pool.map(read, range(len(batch)), batch))
                if time.perf_counter() - started >= PROBE_SECONDS:
                    break
        elapsed = max(time.perf_counter() - started, 1e-6)
    finally:
        os.close(fd)
    if done <= 0:
        raise OSError(f"nothing could be read from {path} to measure its read rate")
    mode = "O_DIRECT" if direct else "page cache dropped first"
    return done / elapsed, f"{format_mib(done)} in {format_seconds(elapsed)}, {mode}"
