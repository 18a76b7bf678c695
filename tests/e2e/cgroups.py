"""Memory cgroups for the end-to-end tests: a child cgroup of this process's memory cgroup (v1 or v2, no swap) with a
limit, usage and peak; a ComfyUI server started inside one; dropping a file's page cache; and the big Wan 2.1 file
that the tests of a DiT bigger than its memory allowance load. A host where no cgroup can be made (not root, no
memory controller) skips the test that asks for one, with the reason."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.devtools.server import ComfyServer

from .conftest import CPU_LOOPBACK_ENV

__all__ = ["BIG_WAN_BLOCKS", "BIG_WAN_CONFIG", "BIG_WAN_NAME", "Cgroup", "ServerInCgroup", "drop_page_cache",
           "memory_cgroup_root", "server_in", "write_big_wan"]

# The big Wan of test_loader_cgroup.py and test_dynamic_server.py: 32 blocks of 64 MiB (2.1 GiB, fp32).
BIG_WAN_NAME = "layerwise_offload_big_wan21.safetensors"
BIG_WAN_BLOCKS = int(os.environ.get("LAYERWISE_OFFLOAD_BIG_DIT_BLOCKS", "32"))
BIG_WAN_CONFIG = dict(tiny_dits.WAN21_TINY_CONFIG, dim=1024, num_heads=8, ffn_dim=4096, num_layers=BIG_WAN_BLOCKS)


def memory_cgroup_root():
    """(folder to make a child cgroup in, limit file, usage file) for this process's memory cgroup, or a reason."""
    try:
        membership = Path("/proc/self/cgroup").read_text()
    except OSError as error:
        return None, f"no /proc/self/cgroup ({error})"
    for line in membership.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return (Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes",
                    "memory.usage_in_bytes"), None
        if hierarchy == "0" and controllers == "":
            v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
                return (v2, "memory.max", "memory.current"), None
    return None, "no memory cgroup controller mounted"


class Cgroup:
    def __init__(self):
        found, reason = memory_cgroup_root()
        if found is None:
            pytest.skip(f"cannot make a memory cgroup: {reason}")
        parent, self.limit_file, self.usage_file = found
        self.path = parent / f"layerwise-offload-test-{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir()
            self.set_limit(None)
        except OSError as error:
            pytest.skip(f"cannot make a memory cgroup under {parent}: {error}")
        for no_swap in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
            if (self.path / no_swap).exists() and no_swap == "memory.swap.max":
                (self.path / no_swap).write_text("0")

    def set_limit(self, nbytes):
        text = ("max" if self.limit_file == "memory.max" else "-1") if nbytes is None else str(int(nbytes))
        (self.path / self.limit_file).write_text(text)

    def usage(self) -> int:
        return int((self.path / self.usage_file).read_text())

    def peak(self) -> int:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            if (self.path / name).exists():
                return int((self.path / name).read_text())
        return self.usage()

    def reset_peak(self):
        if (self.path / "memory.max_usage_in_bytes").exists():
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def reclaim(self) -> None:
        """Reclaim what the kernel can of the cgroup's memory (page cache: files the server read or wrote), so that
        runs compared with each other start from the same state (v1 ``memory.force_empty``, v2 ``memory.reclaim``;
        neither touches the processes' own memory). Where neither can be written, nothing."""
        for name, value in (("memory.force_empty", "0"), ("memory.reclaim", str(self.usage()))):
            if (self.path / name).exists():
                try:
                    (self.path / name).write_text(value)
                except OSError:  # v2 answers EAGAIN when it reclaimed less than asked: what it could is done
                    pass
                return

    def remove(self):
        try:
            self.path.rmdir()
        except OSError:
            pass


class ServerInCgroup(ComfyServer):
    """The server's process joins the cgroup before it execs python (its children inherit it)."""

    def __init__(self, cgroup: Cgroup, *args, **kwargs):
        self.cgroup = cgroup
        super().__init__(*args, **kwargs)

    def command(self):
        procs = self.cgroup.path / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"] + super().command()


@contextlib.contextmanager
def server_in(cgroup: Cgroup, base):
    """A started --cpu server (CPU loopback) inside ``cgroup``; stopped, and the cgroup removed, afterwards."""
    server = ServerInCgroup(cgroup, base, cpu=True, env={CPU_LOOPBACK_ENV: "1"}, extra_args=["--disable-api-nodes"])
    try:
        server.start(timeout=300)
        yield server
    finally:
        server.stop()
        cgroup.remove()


def drop_page_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_big_wan(path) -> dict:
    """The big Wan (2.1 GiB at 32 blocks), written block by block (the whole state dict never sits in RAM twice)."""
    patcher = tiny_dits._build("WAN21_T2V", BIG_WAN_CONFIG, 11, torch.float32)
    state = {k: v.detach().contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}
    safetensors.torch.save_file(state, str(path))
    figures = {"weights": sum(t.nbytes for t in state.values()),
               "block": sum(t.nbytes for k, t in state.items() if k.startswith("blocks.0.")),
               "blocks": sum(t.nbytes for k, t in state.items() if k.startswith("blocks."))}
    del patcher, state
    return figures
