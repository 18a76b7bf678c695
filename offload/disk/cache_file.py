"""The disk tier's cache file: blocks' packed bytes written once, read back with O_DIRECT.

One file per host store, ``layerwise-offload-<pid>-<token>.bin`` in the tier's folder. It is written under a
``.partial`` name and renamed once the first packing is complete and synced, so a file under the final name is
whole; every block region is written, ``fdatasync``'d and dropped from the page cache before anything reads it.
Regions start at 4 KiB offsets and are padded to 4 KiB, so O_DIRECT reads (no page cache: the file's pages never
take the RAM back) need nothing but a page-aligned buffer. Where the filesystem refuses O_DIRECT (tmpfs, some
network filesystems) reads are buffered and followed by ``posix_fadvise(DONTNEED)``.

The file is deleted when the store is dropped, at interpreter exit, and, if the process was killed, by the next
process that opens a tier in the same folder (files whose pid is no longer alive).
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import re
import sys
import uuid
import weakref
from typing import Optional, Set

import torch

from ..formatting import format_bytes

log = logging.getLogger("layerwise_offload")

__all__ = ["ALIGN", "DiskTierError", "CacheFile", "PROBE_PREFIX", "padded", "remove_stale_files",
           "aligned_buffer", "disk_tier_unsupported"]

# What the disk tier's reads and writes need from the OS: positioned vectored I/O and page-cache advice.
_NEEDED = ("preadv", "pwrite", "posix_fadvise", "fdatasync")


def disk_tier_unsupported() -> Optional[str]:
    """Why this platform cannot hold a disk tier (Windows and macOS lack calls it needs), or None."""
    missing = [name for name in _NEEDED if not hasattr(os, name)]
    if not missing:
        return None
    return (f"the disk tier needs os.{', os.'.join(missing)}, which Python on this platform ({sys.platform}) does "
            f"not have")

ALIGN = 4096
PREFIX = "layerwise-offload-"
# The read-rate probe's file (disk/read_rate.py): hidden, so nothing takes it for a cache file, yet removed as one.
PROBE_PREFIX = f".{PREFIX}probe-"
_NAME = re.compile(rf"^(?:{PREFIX}(\d+)-[0-9a-f]+\.(?:bin|partial)|{re.escape(PROBE_PREFIX)}(\d+)-[0-9a-f]+)$")
_LIVE: Set[str] = set()
_TMPFS_MAGIC_TYPES = ("tmpfs", "ramfs")


class DiskTierError(OSError):
    """The disk tier's folder cannot hold the cache file (missing, unwritable, full); the message names it."""


def padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 host buffer (an anonymous mapping), as O_DIRECT reads into it need."""
    area = mmap.mmap(-1, max(ALIGN, padded(nbytes)))
    return torch.frombuffer(area, dtype=torch.uint8, count=padded(nbytes))


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill there terminates the process instead of probing it
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_files(folder: str) -> int:
    """Delete cache files left by processes that are gone (a killed server); returns how many."""
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        match = _NAME.match(name)
        pid = int(match.group(1) or match.group(2)) if match else None
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            try:
                os.unlink(os.path.join(folder, name))
                removed += 1
            except OSError:
                pass
    if removed:
        log.info("[layerwise-offload] removed %d disk-tier cache file(s) a stopped process left in %s", removed, folder)
    return removed


def _filesystem_type(folder: str) -> Optional[str]:
    """The type of the filesystem ``folder`` is on, from /proc/mounts (None where unreadable)."""
    try:
        with open("/proc/mounts") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) > 2]
    except OSError:
        return None
    real = os.path.realpath(folder)
    best = max((m for m in entries if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


def _fail(folder: str, what: str, error: Optional[BaseException] = None) -> DiskTierError:
    detail = f" ({error.strerror or error})" if isinstance(error, OSError) else ""
    return DiskTierError(
        f"[layerwise-offload] the disk tier cannot use the folder {folder!r}: {what}{detail}. Free space there, "
        f"point LAYERWISE_OFFLOAD_DISK_DIR at a writable folder on a fast disk, or set host_store = ram")


def _remove_at_exit() -> None:
    for path in list(_LIVE):
        try:
            os.unlink(path)
        except OSError:
            pass
    _LIVE.clear()


atexit.register(_remove_at_exit)


def _close_and_delete(state: dict) -> None:
    """Close the file's descriptors and delete it: at close(), or when its store is garbage collected."""
    for fd in state["fds"]:
        try:
            os.close(fd)
        except OSError:
            pass
    state["fds"] = []
    try:
        os.unlink(state["path"])
    except OSError:
        pass
    _LIVE.discard(state["path"])


class CacheFile:
    """The packed cache file of one host store: append regions, map them, read them back, delete it."""

    def __init__(self, folder: str, expected_bytes: int = 0):
        self.folder = folder
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise _fail(folder, "the folder cannot be created", error) from error
        remove_stale_files(folder)
        try:
            stat = os.statvfs(folder)
        except OSError as error:
            raise _fail(folder, "the folder cannot be read", error) from error
        free = stat.f_bavail * stat.f_frsize
        if expected_bytes > free:
            raise _fail(folder, f"it has {format_bytes(free)} free and the blocks need {format_bytes(expected_bytes)}")
        if _filesystem_type(folder) in _TMPFS_MAGIC_TYPES:
            log.warning("[layerwise-offload] the disk tier's folder %s is in RAM (tmpfs): it saves no host memory; "
                        "point LAYERWISE_OFFLOAD_DISK_DIR at a folder on a real disk", folder)
        stem = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(folder, stem + ".partial")
        self.final_path = os.path.join(folder, stem + ".bin")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise _fail(folder, "a file cannot be created there", error) from error
        _LIVE.add(self.path)
        self._state = {"fds": [self.fd], "path": self.path}
        self._finalizer = weakref.finalize(self, _close_and_delete, self._state)
        self.size = 0
        self.read_fd: Optional[int] = None
        self.direct = False

    def append(self, data: torch.Tensor) -> int:
        """Write ``data`` (uint8, a multiple of 4 KiB) at the end, synced and out of the page cache; its offset."""
        offset = self.size
        view = memoryview(data.numpy()).cast("B")
        written = 0
        try:
            while written < len(view):
                written += os.pwrite(self.fd, view[written:], offset + written)
            os.fdatasync(self.fd)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _fail(self.folder, "the disk is full", error) from error
            raise _fail(self.folder, "writing the cache file failed", error) from error
        os.posix_fadvise(self.fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        self.size = offset + len(view)
        return offset

    def finish(self) -> None:
        """Sync and give the file its final name (once), and open it for reads."""
        if self.path != self.final_path:
            os.fsync(self.fd)
            os.rename(self.path, self.final_path)
            _LIVE.discard(self.path)
            _LIVE.add(self.final_path)
            self.path = self._state["path"] = self.final_path
        if self.read_fd is None:
            try:
                self.read_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                self.direct = hasattr(os, "O_DIRECT")
            except OSError:  # EINVAL: this filesystem has no O_DIRECT
                self.read_fd = os.open(self.path, os.O_RDONLY)
                self.direct = False
            self._state["fds"].append(self.read_fd)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The region as a tensor over a private mapping of the file: reads fault pages in (reclaimable page
        cache, never anonymous RAM); writes (ComfyUI hooks writing weights in place) stay private to the process."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        area = mmap.mmap(self.fd, padded(nbytes), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                         offset=offset)
        return torch.frombuffer(area, dtype=torch.uint8, count=nbytes)

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Read ``len(buffer)`` bytes at ``offset`` (both 4 KiB multiples, the buffer page-aligned)."""
        if self.read_fd is None:
            self.finish()
        done = 0
        while done < len(buffer):
            got = os.preadv(self.read_fd, [buffer[done:]], offset + done)
            if got <= 0:
                raise _fail(self.folder, f"the cache file ended at byte {offset + done} (it was changed outside)")
            done += got
        if not self.direct:
            os.posix_fadvise(self.read_fd, offset, len(buffer), os.POSIX_FADV_DONTNEED)
        return done

    def close(self) -> None:
        """Close and delete the file (mapped regions stay readable until their tensors go)."""
        self._finalizer()
        self.read_fd = self.fd = None
