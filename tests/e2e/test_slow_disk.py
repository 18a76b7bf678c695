"""A really slow disk: auto measures it and keeps in RAM the blocks it would have put there, while it uses a fast one.

A 128 MiB ext4 file system on a loop device is throttled to :data:`THROTTLE` bytes per second of reads for one
process (a block-I/O cgroup: v1's ``blkio.throttle.read_bps_device`` or v2's ``io.max rbps=``); the test's own
temporary folder is the fast disk. That process (a fresh Python, so no rate is measured yet) measures both file
systems as the disk tier does (:mod:`offload.disk.read_rate`), then runs a toy model through the real manager with
``host_store = auto`` twice, its cache folder on each disk. Its blocks (5 MiB each) cannot be freed by packing
(another holder keeps the weights, as a mapped checkpoint does) and the host's free RAM is set one byte short of
auto's margin with every block in RAM (the ``available_host_bytes`` hook; RAM itself is not limited here): the
blocks that would keep the margin are optional, and read at the throttled rate they cost over a second a step, so
they stay in RAM; on the fast disk they go there. Both outputs are bitwise the model's own.

Skipped, with the command and the kernel's answer, where the loop device, the file system or the throttle cannot
be made (not root, no loop devices, no block-I/O controller). The test itself takes 10-25 s, most of it the fresh
process importing torch; the probe of the throttled disk reads for one second.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from .conftest import REPO

THROTTLE = 4 * 2**20  # bytes per second: an old HDD's random reads, or a USB stick's
IMAGE_BYTES = 128 * 2**20


def _run(command):
    """Run ``command``; (stdout, None) or (None, 'command: error')."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"`{' '.join(command)}`: {error}"
    if done.returncode != 0:
        return None, f"`{' '.join(command)}` exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    return done.stdout.strip(), None


def _throttle_cgroup(major_minor: str):
    """(cgroup folder, None) of a new block-I/O cgroup throttling reads from ``major_minor``, or (None, why not)."""
    reasons = []
    membership = Path("/proc/self/cgroup").read_text().splitlines()
    for line in membership:
        hierarchy, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):  # cgroup v1
            parent = Path("/sys/fs/cgroup/blkio") / path.lstrip("/")
            child = parent / f"layerwise-offload-slowdisk-{uuid.uuid4().hex[:8]}"
            try:
                child.mkdir()
                (child / "blkio.throttle.read_bps_device").write_text(f"{major_minor} {THROTTLE}")
                return child, None
            except OSError as error:
                reasons.append(f"cgroup v1: writing {child}/blkio.throttle.read_bps_device: {error}")
                if child.exists():
                    child.rmdir()
    for line in membership:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # cgroup v2
            root = next((Path(p) for p in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
                         if (Path(p) / "cgroup.controllers").exists()), None)
            if root is None:
                reasons.append("cgroup v2: not mounted")
                continue
            parent = root / path.lstrip("/")
            if "io" not in (parent / "cgroup.controllers").read_text().split():
                reasons.append(f"cgroup v2: no io controller in {parent}/cgroup.controllers")
                continue
            child = parent / f"layerwise-offload-slowdisk-{uuid.uuid4().hex[:8]}"
            try:
                (parent / "cgroup.subtree_control").write_text("+io")
                child.mkdir()
                (child / "io.max").write_text(f"{major_minor} rbps={THROTTLE}")
                return child, None
            except OSError as error:
                reasons.append(f"cgroup v2: enabling io.max under {parent}: {error}")
                if child.exists():
                    child.rmdir()
    return None, "; ".join(reasons) or "no block-I/O cgroup controller in /proc/self/cgroup"


@pytest.fixture
def slow_disk(tmp_path):
    """(mount point of a throttled ext4 file system, its cgroup folder)."""
    if os.geteuid() != 0:
        pytest.skip("a loop device and a block-I/O cgroup need root")
    image = tmp_path / "slow.img"
    with open(image, "wb") as file:
        file.truncate(IMAGE_BYTES)
    loop, why = _run(["losetup", "-f", "--show", str(image)])
    if loop is None:
        pytest.skip(f"no loop device: {why}")
    mount = tmp_path / "slow"
    mount.mkdir()
    cgroup = None
    mounted = False
    try:
        for command in (["mkfs.ext4", "-q", "-F", loop], ["mount", loop, str(mount)]):
            _, why = _run(command)
            if why is not None:
                pytest.skip(f"no file system on the loop device: {why}")
        mounted = True
        major_minor = Path(f"/sys/block/{Path(loop).name}/dev").read_text().strip()
        cgroup, why = _throttle_cgroup(major_minor)
        if cgroup is None:
            pytest.skip(f"cannot throttle the loop device: {why}")
        yield mount, cgroup
    finally:
        if cgroup is not None:
            cgroup.rmdir()
        if mounted:
            _run(["umount", str(mount)])
        _run(["losetup", "-d", loop])


CHILD = textwrap.dedent("""
    import json, logging, runpy, sys
    runpy.run_path(sys.argv[1] + "/devtools/comfy_env.py")["enter_pack"]()
    import torch
    from layerwise_offload.devtools.toy_transformer import ToyTransformer
    from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
    from layerwise_offload.offload.disk.budget import RAM_MARGIN_BYTES
    from layerwise_offload.offload.disk.read_rate import disk_read_rate

    slow, fast = sys.argv[2], sys.argv[3]
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("layerwise_offload").addHandler(handler)
    logging.getLogger("layerwise_offload").setLevel(logging.INFO)
    result = {"rates": {name: disk_read_rate(folder).bytes_per_s for name, folder in (("slow", slow), ("fast", fast))}}
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ToyTransformer(dim=512, hidden=1024)(x)
    for name, folder in (("slow", slow), ("fast", fast)):
        model = ToyTransformer(dim=512, hidden=1024)
        held = [p.detach() for p in model.parameters()]  # packing frees nothing, as over a mapped checkpoint
        sizes = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu").block_nbytes()
        available = RAM_MARGIN_BYTES + sum(sizes) - 1  # every block in RAM leaves a byte less than the margin
        manager = LayerwiseOffloadManager(
            model.blocks_in_call_order(), "cpu", resident_layers=0, prefetch_size=1, host_store="auto",
            environment=HostEnvironment(disk_folder=folder, available_host_bytes=lambda: available))
        manager.attach(model)
        del lines[:]
        with torch.no_grad():
            same = bool(torch.equal(model(x), want))
        result[name] = {"tiers": manager.engine.host.tiers(), "same": same, "block_bytes": max(sizes),
                        "plan": [line for line in lines if "host store:" in line]}
        manager.detach()
    print(json.dumps(result))
""")


def test_auto_keeps_blocks_in_ram_on_a_throttled_disk_and_uses_a_fast_one(slow_disk, tmp_path):
    mount, cgroup = slow_disk
    fast = tmp_path / "fast"
    env = {k: v for k, v in os.environ.items() if k != "LAYERWISE_OFFLOAD_DISK_READ_RATE"}

    def enter_cgroup():
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    done = subprocess.run([sys.executable, "-P", "-c", CHILD, str(REPO), str(mount / "cache"), str(fast)],
                          capture_output=True, text=True, env=env, preexec_fn=enter_cgroup, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    slow_rate, fast_rate = result["rates"]["slow"], result["rates"]["fast"]
    print(f"[layerwise-offload] read rates measured: throttled loop device {slow_rate / 1e6:.2f} MB/s "
          f"(throttle {THROTTLE / 1e6:.2f} MB/s), {fast} {fast_rate / 1e6:.0f} MB/s")
    for name in ("slow", "fast"):
        print(f"[layerwise-offload] {name}: {result[name]['plan']}")
    # The probe reads past the page cache: it sees the throttle, not the RAM the loop file sits in.
    assert slow_rate <= 1.5 * THROTTLE, slow_rate
    assert fast_rate > 4 * THROTTLE, fast_rate  # else this host's disk is no faster than the throttle: no contrast
    slow, fast_run = result["slow"], result["fast"]
    assert slow["same"] and fast_run["same"]
    # One block read at the throttled rate costs more than a second a step: every block stays in RAM, and says so.
    assert result["slow"]["block_bytes"] / THROTTLE > 1.0
    assert slow["tiers"] == ["ram"] * len(slow["tiers"])
    assert len(slow["plan"]) == 1 and "0 of 7 blocks on disk" in slow["plan"][0], slow["plan"]
    assert "disk too slow" in slow["plan"][0] and "stay in RAM" in slow["plan"][0]
    # The fast disk takes the blocks that keep the margin, the latest in the step.
    on_disk = fast_run["tiers"].count("disk")
    assert on_disk > 0 and fast_run["tiers"] == ["ram"] * (7 - on_disk) + ["disk"] * on_disk
    assert len(fast_run["plan"]) == 1 and "disk fast enough" in fast_run["plan"][0], fast_run["plan"]
    assert os.listdir(mount / "cache") == [] and os.listdir(fast) == []  # cache files and probe files gone
