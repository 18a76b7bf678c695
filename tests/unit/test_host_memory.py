"""Host memory figures and the pinning budget, from faked readers (psutil and /proc are never patched)."""

import pytest

from layerwise_offload.offload.memory.ram import (
    GiB, available_host_bytes, cgroup_headroom_bytes, meminfo_available_bytes, pinnable_bytes,
    system_available_bytes)

MiB = 2**20
V1_UNLIMITED = "9223372036854771712\n"


def fake_fs(files):
    return lambda path: files.get(path)


# ----------------------------------------------------------------- available_host_bytes
def test_minimum_of_system_and_cgroup():
    assert available_host_bytes(system=20 * GiB, cgroup=6 * GiB) == 6 * GiB
    assert available_host_bytes(system=lambda: 3 * GiB, cgroup=lambda: 6 * GiB) == 3 * GiB


def test_unreadable_cgroup_does_not_count():
    assert available_host_bytes(system=lambda: 5 * GiB, cgroup=lambda: None) == 5 * GiB


def test_nothing_readable_is_unknown_and_pins_nothing():
    assert available_host_bytes(system=lambda: None, cgroup=lambda: None) is None
    assert pinnable_bytes(GiB, available=lambda: None) == 0


def test_negative_figures_clamp_to_zero():
    assert available_host_bytes(system=4 * GiB, cgroup=-5) == 0


def test_real_readers_answer_something_sane():
    # Not faked: just that the real readers run here and agree on a plausible figure.
    system = system_available_bytes()
    assert system is None or system > 0
    available = available_host_bytes()
    # Read a moment apart: on a busy machine other processes free memory in between (100 KB in a suite run beside
    # another), so the second figure may exceed the first by a little
    slack = 64 * 2**20
    assert available is None or 0 <= available <= (system + slack if system is not None else float("inf"))


# ----------------------------------------------------------------- /proc/meminfo
MEMINFO = """MemTotal:       24684096 kB
MemFree:        21080988 kB
MemAvailable:   23610852 kB
Buffers:          123456 kB
Cached:          2000000 kB
"""


def test_meminfo_available():
    assert meminfo_available_bytes(MEMINFO) == 23610852 * 1024


def test_meminfo_without_memavailable_falls_back_to_free_plus_cache():
    old = "\n".join(line for line in MEMINFO.splitlines() if not line.startswith("MemAvailable"))
    assert meminfo_available_bytes(old) == (21080988 + 123456 + 2000000) * 1024


def test_meminfo_garbage():
    assert meminfo_available_bytes("nothing useful here\n") is None


# ----------------------------------------------------------------- cgroups
def test_cgroup_v2_limit_minus_usage_less_inactive_file():
    fs = fake_fs({
        "/proc/self/cgroup": "0::/user.slice/app.scope\n",
        "/sys/fs/cgroup/user.slice/app.scope/memory.max": f"{8 * GiB}\n",
        "/sys/fs/cgroup/user.slice/app.scope/memory.current": f"{3 * GiB}\n",
        "/sys/fs/cgroup/user.slice/app.scope/memory.stat": f"anon {2 * GiB}\ninactive_file {512 * MiB}\nactive_file 0\n",
        "/sys/fs/cgroup/user.slice/memory.max": "max\n",
    })
    assert cgroup_headroom_bytes(fs) == 8 * GiB - (3 * GiB - 512 * MiB)


def test_cgroup_v2_counts_every_clean_file_page_as_reclaimable():
    """Page cache the kernel reclaims before an OOM kill, active or not (a model file just read is mostly active):
    all of it but shared memory, dirty pages and pages under writeback. ComfyUI alone grows into it."""
    fs = fake_fs({
        "/proc/self/cgroup": "0::/app\n",
        "/sys/fs/cgroup/app/memory.max": f"{3 * GiB}\n",
        "/sys/fs/cgroup/app/memory.current": f"{3 * GiB - 10 * MiB}\n",
        "/sys/fs/cgroup/app/memory.stat": (f"anon {GiB}\nfile {2 * GiB}\nshmem {64 * MiB}\nfile_dirty {32 * MiB}\n"
                                           f"file_writeback 0\ninactive_file {100 * MiB}\nactive_file {1900 * MiB}\n"),
    })
    reclaimable = 2 * GiB - 64 * MiB - 32 * MiB
    assert cgroup_headroom_bytes(fs) == 3 * GiB - (3 * GiB - 10 * MiB - reclaimable)


def test_cgroup_v2_parent_limit_binds():
    fs = fake_fs({
        "/proc/self/cgroup": "0::/a/b\n",
        "/sys/fs/cgroup/a/b/memory.max": f"{16 * GiB}\n",
        "/sys/fs/cgroup/a/b/memory.current": f"{1 * GiB}\n",
        "/sys/fs/cgroup/a/memory.max": f"{4 * GiB}\n",
        "/sys/fs/cgroup/a/memory.current": f"{3 * GiB}\n",
    })
    assert cgroup_headroom_bytes(fs) == 1 * GiB


def test_cgroup_v2_unlimited():
    fs = fake_fs({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": "max\n",
                  "/sys/fs/cgroup/memory.current": "12345\n"})
    assert cgroup_headroom_bytes(fs) is None


def test_cgroup_v2_namespaced_container_reads_the_mount_root():
    # With a cgroup namespace /proc/self/cgroup shows "/" and the container's limit sits at the root.
    fs = fake_fs({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": f"{2 * GiB}\n",
                  "/sys/fs/cgroup/memory.current": f"{GiB // 2}\n"})
    assert cgroup_headroom_bytes(fs) == GiB + GiB // 2


def test_cgroup_v1_limit_minus_usage():
    fs = fake_fs({
        "/proc/self/cgroup": "4:memory:/docker/abc\n3:cpuset:/\n0::/\n",
        "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{10 * GiB}\n",
        "/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{4 * GiB}\n",
        "/sys/fs/cgroup/memory/docker/abc/memory.stat": f"cache 1\ninactive_file 7\ntotal_inactive_file {GiB}\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
    })
    assert cgroup_headroom_bytes(fs) == 10 * GiB - 3 * GiB


def test_cgroup_v1_path_outside_the_mount_falls_back_to_its_root():
    # The process's path (from the host's view) is not under the container's mount; the root is its cgroup.
    fs = fake_fs({
        "/proc/self/cgroup": "4:memory:/process_api/3e0c\n0::/\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{6 * GiB}\n",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{5 * GiB}\n",
    })
    assert cgroup_headroom_bytes(fs) == 1 * GiB


def test_cgroup_v1_unlimited_and_usage_over_limit():
    unlimited = fake_fs({"/proc/self/cgroup": "4:memory:/\n",
                         "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes": "3399127040\n"})
    assert cgroup_headroom_bytes(unlimited) is None
    over = fake_fs({"/proc/self/cgroup": "4:memory:/\n",
                    "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GiB}\n",
                    "/sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2 * GiB}\n"})
    assert cgroup_headroom_bytes(over) == 0


def test_cgroup_nothing_readable():
    assert cgroup_headroom_bytes(fake_fs({})) is None
    assert cgroup_headroom_bytes(fake_fs({"/proc/self/cgroup": "garbage"})) is None
    # A limit without a usage figure cannot be turned into headroom.
    assert cgroup_headroom_bytes(fake_fs({"/proc/self/cgroup": "0::/",
                                          "/sys/fs/cgroup/memory.max": "100\n"})) is None


def test_cgroup_faked_into_available_host_bytes():
    fs = fake_fs({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": f"{2 * GiB}\n",
                  "/sys/fs/cgroup/memory.current": f"{GiB}\n"})
    assert available_host_bytes(system=30 * GiB, cgroup=lambda: cgroup_headroom_bytes(fs)) == GiB


# ----------------------------------------------------------------- pinnable_bytes
def test_pinnable_keeps_the_minimum_margin():
    # 10 GiB available: 10% is 1 GiB, below the 2 GiB minimum, so 8 GiB may be pinned.
    assert pinnable_bytes(20 * GiB, available=10 * GiB) == 8 * GiB
    assert pinnable_bytes(5 * GiB, available=10 * GiB) == 5 * GiB


def test_pinnable_keeps_the_fractional_margin_on_big_hosts():
    # 100 GiB available: 10% (10 GiB) is above the 2 GiB minimum.
    assert pinnable_bytes(200 * GiB, available=100 * GiB) == 90 * GiB
    assert pinnable_bytes(200 * GiB, margin_fraction=0.25, available=100 * GiB) == 75 * GiB


def test_pinnable_cap_and_reader():
    assert pinnable_bytes(20 * GiB, cap=3 * GiB, available=lambda: 64 * GiB) == 3 * GiB
    assert pinnable_bytes(20 * GiB, cap=0, available=64 * GiB) == 0


def test_pinnable_short_host_pins_nothing():
    assert pinnable_bytes(4 * GiB, available=2 * GiB) == 0
    assert pinnable_bytes(4 * GiB, available=GiB) == 0
    assert pinnable_bytes(0, available=64 * GiB) == 0


def test_pinnable_margin_zero():
    assert pinnable_bytes(8 * GiB, margin_fraction=0.0, margin_min=0, available=8 * GiB) == 8 * GiB


@pytest.mark.parametrize("kwargs", [
    dict(requested=-1), dict(requested=1.5), dict(requested=1, margin_fraction=1.0),
    dict(requested=1, margin_fraction=-0.1), dict(requested=1, margin_min=-1), dict(requested=1, cap=-1),
])
def test_pinnable_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        pinnable_bytes(available=GiB, **kwargs)
