"""How much host memory there is to spend, and how much of it may be pinned.

``available_host_bytes()`` is the smaller of what the OS reports as available and what the
process's memory cgroup (containers, systemd slices) still allows. ``pinnable_bytes()`` caps a
pinning request so the host keeps a margin: page-locked memory cannot be swapped or reclaimed,
and pinning a large host store into the last free gigabytes gets the process (or the desktop)
killed rather than slowed.

Every reader can be replaced by a callable (or a fixed value) so tests pass fake figures instead
of patching psutil or /proc.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Union

log = logging.getLogger("layerwise_offload")

__all__ = ["GiB", "available_host_bytes", "system_available_bytes", "cgroup_headroom_bytes",
           "meminfo_available_bytes", "pinnable_bytes"]

GiB = 2**30

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX rounded to the page size (0x7FFFFFFFFFFFF000 on
# 4 KiB pages); anything this large is no limit.
_UNLIMITED = 2**60

ReadText = Callable[[str], Optional[str]]
ByteReader = Callable[[], Optional[int]]


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "r") as handle:
            return handle.read()
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------- the OS figure
def meminfo_available_bytes(text: Optional[str] = None) -> Optional[int]:
    """``MemAvailable`` from /proc/meminfo (or from ``text``), in bytes; None when not there."""
    text = _read_text("/proc/meminfo") if text is None else text
    if not text:
        return None
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemAvailable" in fields:
        return fields["MemAvailable"]
    # Kernels before 3.14 have no MemAvailable; free + page cache is the usual stand-in.
    if "MemFree" in fields:
        return fields["MemFree"] + fields.get("Cached", 0) + fields.get("Buffers", 0)
    return None


def system_available_bytes() -> Optional[int]:
    """psutil's ``virtual_memory().available``; /proc/meminfo when psutil is not installed."""
    try:
        import psutil  # imported here: optional, and slow-ish to import
    except ImportError:
        return meminfo_available_bytes()
    try:
        return int(psutil.virtual_memory().available)
    except Exception as error:  # psutil raises OSError subclasses on odd platforms
        log.debug("[layerwise-offload] psutil.virtual_memory() failed (%s); reading /proc/meminfo", error)
        return meminfo_available_bytes()


# ----------------------------------------------------------------- the cgroup figure
def _parse_int(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(text: Optional[str], key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _ancestors(path: str) -> Iterable[str]:
    """``/a/b`` -> ``/a/b``, ``/a``, ``""`` (the mount root)."""
    parts = [p for p in path.strip().split("/") if p]
    for depth in range(len(parts), -1, -1):
        yield "/" + "/".join(parts[:depth]) if depth else ""


def _headroom_at(directory: str, limit_file: str, usage_file: str, read_text: ReadText) -> Optional[int]:
    limit = _parse_int(read_text(f"{directory}/{limit_file}"))
    if limit is None or limit >= _UNLIMITED:
        return None
    usage = _parse_int(read_text(f"{directory}/{usage_file}"))
    if usage is None:
        return None
    # Usage counts page cache, which the kernel reclaims before it OOM-kills: every clean file page, active or
    # not (shared memory, dirty pages and pages under writeback excepted). That is what a ComfyUI alone can grow
    # into, so it counts as available; at least the inactive file pages (the "working set" that docker and the
    # kubelet report) where the finer fields are missing.
    stat = read_text(f"{directory}/memory.stat")
    names = _STAT_NAMES[limit_file]
    clean = _stat_field(stat, names["file"]) - sum(_stat_field(stat, names[k]) for k in ("shmem", "dirty", "writeback"))
    usage -= min(usage, max(clean, _stat_field(stat, names["inactive_file"])))
    return max(0, limit - usage)


_STAT_NAMES = {
    "memory.max": {"file": "file", "shmem": "shmem", "dirty": "file_dirty", "writeback": "file_writeback",
                   "inactive_file": "inactive_file"},
    "memory.limit_in_bytes": {"file": "total_cache", "shmem": "total_shmem", "dirty": "total_dirty",
                              "writeback": "total_writeback", "inactive_file": "total_inactive_file"},
}


def cgroup_headroom_bytes(read_text: ReadText = _read_text, mount: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes the process's memory cgroup still allows (limit minus usage), or None when unlimited or unreadable.

    Reads /proc/self/cgroup for the process's cgroup, then walks from it up to the mount root,
    taking the smallest headroom of any limited level (a parent's limit binds its children). Inside
    a container with a cgroup namespace the process's path is not under the mount; the mount root
    is then the container's own cgroup and is read directly. cgroup v2 (``memory.max`` /
    ``memory.current``) first, then v1 (``memory.limit_in_bytes`` / ``memory.usage_in_bytes``).
    """
    membership = read_text("/proc/self/cgroup") or ""
    v2_path, v1_path = None, None
    for line in membership.splitlines():
        fields = line.strip().split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    candidates = []
    if v2_path is not None:
        candidates.append((mount, v2_path, "memory.max", "memory.current"))
    candidates.append((f"{mount}/memory", v1_path or "/", "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: Optional[int] = None
    for root, path, limit_file, usage_file in candidates:
        for sub in _ancestors(path):
            headroom = _headroom_at(root + sub, limit_file, usage_file, read_text)
            if headroom is not None:
                best = headroom if best is None else min(best, headroom)
    return best


# ----------------------------------------------------------------- the answers
def available_host_bytes(system: Union[ByteReader, int, None] = None,
                         cgroup: Union[ByteReader, int, None] = None) -> Optional[int]:
    """Host memory this process may still use: min(OS available, cgroup limit - usage).

    ``system`` and ``cgroup`` replace the readers (:func:`system_available_bytes`,
    :func:`cgroup_headroom_bytes`) with a callable or a fixed figure; a reader answering None
    (no cgroup limit, unreadable file) does not count. Returns None when neither answers (no
    psutil, no /proc/meminfo, no cgroup files): unknown, which callers must not read as 0 or as
    plenty (:func:`pinnable_bytes` pins nothing then).
    """
    figures = []
    for reader, default in ((system, system_available_bytes), (cgroup, cgroup_headroom_bytes)):
        reader = default if reader is None else reader
        value = reader() if callable(reader) else reader
        if value is not None:
            figures.append(max(0, int(value)))
    return min(figures) if figures else None


def pinnable_bytes(requested: int, margin_fraction: float = 0.1, margin_min: int = 2 * GiB,
                   cap: Optional[int] = None, available: Union[ByteReader, int, None] = None) -> int:
    """How many of ``requested`` bytes may be page-locked while the host keeps a margin.

    The margin is ``max(margin_min, margin_fraction * available)``; the answer is
    ``min(requested, available - margin, cap)``, never below 0. ``available`` is a figure or a
    callable; by default :func:`available_host_bytes`. When the available memory is unknown (the
    reader answers None) nothing is pinned. Pinned memory that is already held is not in
    ``available``, so ask before pinning, once, for the whole store.
    """
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"requested must be an integer >= 0 bytes, got {requested!r}")
    if not 0 <= margin_fraction < 1:
        raise ValueError(f"margin_fraction must be within [0, 1), got {margin_fraction!r}")
    if margin_min < 0:
        raise ValueError(f"margin_min must be >= 0 bytes, got {margin_min!r}")
    if cap is not None and cap < 0:
        raise ValueError(f"cap must be >= 0 bytes or None, got {cap!r}")
    if available is None:
        available = available_host_bytes()
    elif callable(available):
        available = available()
    if available is None:
        log.warning("[layerwise-offload] could not read the available host memory (no psutil, /proc/meminfo "
                    "or cgroup files); pinning nothing")
        return 0
    available = max(0, int(available))
    margin = max(int(margin_min), int(margin_fraction * available))
    allowed = min(requested, max(0, available - margin))
    if cap is not None:
        allowed = min(allowed, int(cap))
    return allowed
