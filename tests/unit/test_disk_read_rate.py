"""Auto's disk tier weighs the disk's read rate: blocks go to disk where RAM leaves no choice, and beyond that only
as far as their reads fit the stall budget; the rate is measured once per file system or set by
$LAYERWISE_OFFLOAD_DISK_READ_RATE. (tests/e2e/test_slow_disk.py measures a really throttled device.)"""

import logging
import os
import subprocess
import sys

import pytest
import torch

from layerwise_offload.devtools.toy_transformer import ToyTransformer
from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager
from layerwise_offload.offload.disk import read_rate
from layerwise_offload.offload.disk.budget import (DISK_STALL_BUDGET_S, RAM_FLOOR_BYTES, RAM_MARGIN_BYTES,
                                                   plan_host_tiers)
from layerwise_offload.offload.disk.read_rate import (DISK_READ_RATE_ENV, disk_read_rate, forget_measured_rates,
                                                      parse_read_rate)

MiB = 2**20
BLOCK = 64 * MiB
NUM_BLOCKS = 12


@pytest.mark.parametrize("text, rate", [("150MB/s", 150e6), ("2.5 GB/s", 2.5e9), ("800MiB/s", 800 * MiB),
                                        ("1.5e9", 1.5e9), ("4096", 4096.0), ("3 gib/sec", 3 * 2**30),
                                        (" 10 kB ", 1e4)])
def test_a_read_rate_is_bytes_per_second_with_an_optional_unit(text, rate):
    assert parse_read_rate(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["fast", "0", "-5MB/s", "1e999", "MB/s", "12 parsecs", "nan"])
def test_a_malformed_read_rate_is_refused_naming_the_value_and_the_fix(text):
    with pytest.raises(ValueError) as refused:
        parse_read_rate(text)
    message = str(refused.value)
    assert message.startswith("[layerwise-offload]") and repr(text) in message and DISK_READ_RATE_ENV in message
    assert "150MB/s" in message and "unset it" in message


def test_the_setting_is_used_without_touching_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(DISK_READ_RATE_ENV, "120MB/s")
    folder = tmp_path / "never-made"
    rate = disk_read_rate(str(folder))
    assert rate.bytes_per_s == 120e6 and DISK_READ_RATE_ENV in rate.how
    assert not folder.exists()
    monkeypatch.setenv(DISK_READ_RATE_ENV, "quick")
    with pytest.raises(ValueError, match="'quick' is not a read rate"):
        disk_read_rate(str(folder))


def test_the_rate_is_measured_once_per_file_system_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.delenv(DISK_READ_RATE_ENV, raising=False)
    forget_measured_rates()
    probes = []
    measure = read_rate._probe_folder
    monkeypatch.setattr(read_rate, "_probe_folder", lambda folder: probes.append(folder) or measure(folder))
    first = disk_read_rate(str(tmp_path / "a"))
    again = disk_read_rate(str(tmp_path / "b"))  # another folder on the same file system
    assert probes == [str(tmp_path / "a")] and again is first
    assert first.bytes_per_s > 0 and "measured on" in first.how
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []
    forget_measured_rates()


def test_a_killed_processs_probe_file_is_removed_as_its_cache_file_would_be(tmp_path):
    """The probe's file is hidden (nothing waiting for a cache file takes it for one) and a dead process's is
    removed by the next disk tier in that folder; a live process's stays."""
    from layerwise_offload.offload.disk.cache_file import PROBE_PREFIX, remove_stale_files
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"{PROBE_PREFIX}{int(dead.stdout)}-0123456789ab"
    mine = tmp_path / f"{PROBE_PREFIX}{os.getpid()}-0123456789ab"
    left.write_bytes(b"x")
    mine.write_bytes(b"x")
    assert PROBE_PREFIX.startswith(".") and remove_stale_files(str(tmp_path)) == 1
    assert not left.exists() and mine.exists()


def tiers(rate, available, mode="auto", sizes=(BLOCK,) * NUM_BLOCKS, how="given"):
    """Auto's plan for blocks whose packing frees nothing (a mapped checkpoint's), on a disk of ``rate``; the rate is
    asked for at most once, and only where some block may go to disk."""
    asked = []

    def read_rate():
        asked.append(True)
        return rate, how
    plan = plan_host_tiers(list(sizes), [0] * len(sizes), mode, available, read_rate=read_rate)
    assert len(asked) <= 1
    return plan, bool(asked)


# Every block in RAM leaves 3 blocks less than the margin free: 3 blocks keep the margin, none is forced.
IN_MARGIN_BAND = NUM_BLOCKS * BLOCK + RAM_MARGIN_BYTES - 3 * BLOCK + MiB


def test_a_fast_disk_takes_the_blocks_that_keep_the_margin():
    plan, _ = tiers(2e9, IN_MARGIN_BAND)
    assert plan.disk == (False,) * 9 + (True,) * 3 and plan.read_rate == 2e9
    assert "disk fast enough: 3 blocks on disk keep auto's 512 MiB RAM margin" in plan.reason
    assert "2.00 GB/s" in plan.reason and "192 MiB, 0.10 s per step" in plan.reason  # at 2 GB/s


def test_a_slow_disk_keeps_those_blocks_in_ram():
    hdd = 100e6  # one 64 MiB block takes 0.67 s: over the budget
    assert BLOCK / hdd > DISK_STALL_BUDGET_S
    plan, _ = tiers(hdd, IN_MARGIN_BAND)
    assert plan.disk == (False,) * NUM_BLOCKS
    assert "disk too slow for auto's 512 MiB RAM margin: 3 blocks" in plan.reason and "stay in RAM" in plan.reason
    assert "100 MB/s" in plan.reason
    free_after = IN_MARGIN_BAND - plan.growth_bytes
    assert RAM_FLOOR_BYTES <= free_after < RAM_MARGIN_BYTES


def test_a_middling_disk_takes_as_many_as_it_reads_within_the_budget():
    sata = 300e6  # 0.5 s reads 143 MiB: two 64 MiB blocks
    plan, _ = tiers(sata, IN_MARGIN_BAND)
    assert plan.disk == (False,) * 10 + (True,) * 2
    assert "1 blocks that keep it would take 0.22 s more per step" in plan.reason  # the third block


def test_ram_short_puts_blocks_on_disk_whatever_the_disk_and_says_what_it_costs():
    # Every block in RAM would leave 5 blocks less than the floor: those 5 are forced, 4 more would keep the margin.
    available = NUM_BLOCKS * BLOCK + RAM_FLOOR_BYTES - 5 * BLOCK + MiB
    plan, _ = tiers(50e6, available)
    assert plan.disk == (False,) * 7 + (True,) * 5
    assert "RAM short: 5 blocks must go to disk to leave 256 MiB free" in plan.reason
    assert "4 blocks that keep it" in plan.reason
    assert "reading their 320 MiB takes 6.71 s per step" in plan.reason  # the forced cost, said
    fast, _ = tiers(5e9, available)
    assert fast.disk == (False,) * 3 + (True,) * 9


def test_host_store_disk_is_honoured_on_a_slow_disk_and_ram_never_asks_the_disk():
    plan, asked = tiers(1e6, 2**40, mode="disk")
    assert plan.disk == (True,) * NUM_BLOCKS and asked and "host_store = disk" in plan.reason
    assert "1.0 MB/s" in plan.reason
    plan, asked = tiers(1e6, IN_MARGIN_BAND, mode="ram")
    assert plan.disk == (False,) * NUM_BLOCKS and not asked and plan.reason == ""
    plan, asked = tiers(1e6, 2**40)  # auto with room: no disk to weigh
    assert plan.disk == (False,) * NUM_BLOCKS and not asked and plan.reason == ""


def test_an_unknown_rate_keeps_the_margin_as_before():
    plan, _ = tiers(None, IN_MARGIN_BAND, how="not measurable on /nowhere: [Errno 30] Read-only file system")
    assert plan.disk == (False,) * 9 + (True,) * 3 and "the disk's read rate is unknown (not measurable" in plan.reason


@pytest.mark.parametrize("setting, fast", [("1kB/s", False), ("3GB/s", True)])
def test_the_manager_follows_the_setting_and_computes_the_same(tmp_path, monkeypatch, caplog, setting, fast):
    """A manager whose blocks' packing frees nothing (another holder keeps the weights) with a byte less than its
    margin free: the set rate decides whether the last blocks go to disk, and the output is bitwise the same."""
    monkeypatch.setenv(DISK_READ_RATE_ENV, setting)
    model = ToyTransformer()
    held = [param.detach() for param in model.parameters()]  # noqa: F841 - packing frees nothing
    sizes = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu").block_nbytes()
    assert sizes[-1] / parse_read_rate("1kB/s") > DISK_STALL_BUDGET_S > sizes[-1] / parse_read_rate("3GB/s")
    available = RAM_MARGIN_BYTES + sum(sizes) - 1
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=0, prefetch_size=1,
                                      host_store="auto", environment=HostEnvironment(
                                          disk_folder=str(tmp_path), available_host_bytes=lambda: available))
    manager.attach(model)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="layerwise_offload"), torch.no_grad():
        assert torch.equal(model(x), ToyTransformer()(x))
    found = manager.engine.host.tiers()
    on_disk = found.count("disk")
    assert found == ["ram"] * (len(sizes) - on_disk) + ["disk"] * on_disk and (on_disk > 0) == fast
    line = next(r.getMessage() for r in caplog.records if "host store:" in r.getMessage())
    assert line.startswith(f"[layerwise-offload] host store: {on_disk} of {len(sizes)} blocks on disk")
    assert ("disk fast enough" if fast else "disk too slow") in line and DISK_READ_RATE_ENV in line
    manager.detach()


def test_blocks_read_from_a_checkpoint_measure_the_checkpoints_file_system(tmp_path, monkeypatch):
    """Mapped weights are read back from the checkpoint, not a cache file: its file is what the probe reads (a file
    too small to time is not kept, and the plan says the rate is unknown)."""
    from safetensors.torch import save_file

    from layerwise_offload.offload import CheckpointFile
    monkeypatch.delenv(DISK_READ_RATE_ENV, raising=False)
    path = tmp_path / "models" / "toy.safetensors"
    path.parent.mkdir()
    save_file({k: v.contiguous() for k, v in ToyTransformer().state_dict().items()}, str(path))
    model = ToyTransformer()
    model.load_state_dict(CheckpointFile(str(path)).state_dict(), assign=True)
    asked = []
    monkeypatch.setattr("layerwise_offload.offload.host.tier_planning.disk_read_rate",
                        lambda where: asked.append(where) or disk_read_rate(where))
    manager = LayerwiseOffloadManager(model.blocks_in_call_order(), "cpu", resident_layers=0, host_store="disk",
                                      environment=HostEnvironment(disk_folder=str(tmp_path / "cache"),
                                                                  available_host_bytes=lambda: 2**40))
    manager.prepare()
    assert asked and set(asked) == {str(path)}
    assert "the disk's read rate is unknown (not measurable on" in manager.engine.host.tier_plan.reason
    assert "too small to measure" in manager.engine.host.tier_plan.reason
    manager.detach()
