"""A server killed while the disk tier streams leaves nothing behind once ComfyUI starts again.

A real ComfyUI server (fresh, CPU loopback) samples the tiny Wan 2.1 through the node with ``host_store = disk``
and its cache file in a folder chosen with $LAYERWISE_OFFLOAD_DISK_DIR. It is killed with SIGKILL in the middle
of sampling, so no exit handler runs and the file stays. The next server started on that folder removes it when
it loads the pack, then runs the same prompt bitwise equal to ComfyUI alone. The checkpoint is never written.
(ComfyUI's own temp folder, the default, is emptied by ComfyUI itself at every start.)
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from layerwise_offload.devtools import e2e_assets
from layerwise_offload.devtools.server import ComfyServer, prepare_base_dir

from .conftest import CPU_LOOPBACK_ENV, server_args
from .server_support import saved_latent, tiny_prompt

LONG_STEPS = 2000  # minutes of sampling: the kill always lands mid-run


def cache_files(folder: Path) -> list:
    return sorted(name for name in os.listdir(folder) if name.startswith("layerwise-offload-"))


def digest(path: str) -> tuple:
    stat = os.stat(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest(), stat.st_size, stat.st_mtime_ns


@pytest.fixture
def base(tmp_path, tiny_assets) -> Path:
    base = prepare_base_dir(tmp_path / "base")
    for kind, sub in (("wan21", "diffusion_models"), ("vae", "vae")):
        src = Path(tiny_assets[kind])
        (base / "models" / sub / src.name).symlink_to(src)
    e2e_assets.copy_cond(tiny_assets, base)
    return base


def test_a_killed_servers_cache_file_is_gone_after_the_next_start(base, tmp_path, tiny_assets):
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {CPU_LOOPBACK_ENV: "1", "LAYERWISE_OFFLOAD_DISK_DIR": str(disk)}
    checkpoint = os.path.realpath(tiny_assets["wan21"])
    before = digest(checkpoint)
    offload = {"resident_layers": 0, "host_store": "disk"}

    first = ComfyServer(base, cpu=True, env=env, extra_args=server_args()).start(timeout=240)
    try:
        long_run = tiny_prompt(offload, prefix="kill/long")
        long_run["6"]["inputs"]["steps"] = LONG_STEPS
        first.queue_prompt(long_run)
        deadline = time.monotonic() + 120
        while not cache_files(disk) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cache_files(disk), first.log_tail()
        time.sleep(1.0)  # a few steps in: reads of the cache file come and go now
        assert first.get_json("/queue")["queue_running"], "the prompt ended before the kill"
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.stop()
    left = cache_files(disk)
    assert left and all(name.endswith(".bin") for name in left), left  # SIGKILL ran no clean-up

    second = ComfyServer(base, cpu=True, env=env, extra_args=server_args()).start(timeout=240)
    try:
        assert cache_files(disk) == [], second.log_tail()  # removed when the pack loaded, before any prompt
        assert "disk-tier cache file(s) a stopped process left in" in second.log_text()
        alone = saved_latent(second, second.run_prompt(tiny_prompt(None, prefix="kill/alone"), timeout=300))
        offloaded = saved_latent(second, second.run_prompt(tiny_prompt(offload, prefix="kill/disk"), timeout=300))
        assert offloaded.equal(alone)
    finally:
        # Ctrl+C (the exit handlers remove the file; a SIGTERM or SIGKILL would run none), with time to spare
        ended_by = second.stop(timeout=120)
    assert digest(checkpoint) == before  # the checkpoint was only ever read
    assert ended_by == signal.SIGINT, f"the second server did not exit on SIGINT within 120 s ({ended_by!r})"
    assert cache_files(disk) == []  # and the second server's own file went with its model at exit
