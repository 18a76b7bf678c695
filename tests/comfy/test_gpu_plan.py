"""The one-call GPU run (bench/gpu_run.sh) checked on the CPU: the time plan, every step end to end at the tiny
presets (its dry run), the tables that keep each row as it is measured, and comfy-aimdo started in ComfyUI's order.
"""

import csv
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.bench import gpu_steps
from layerwise_offload.bench.gpu_steps import TABLES, Ballast, DevicePeak, Table, bound_ms, ratio

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_run.sh"


def plan_steps():
    text = SCRIPT.read_text()
    block = text.split("PLAN=(", 1)[1].split("\n)", 1)[0]
    return [line.split()[0] for line in re.findall(r'"([^"]+)"', block)]


def default_comfyui() -> bool:
    return Path(mm.__file__).resolve().parents[1] == (REPO / ".comfyui" / "ComfyUI").resolve()


def test_the_plan_is_refused_when_its_caps_exceed_the_limit(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, WORK=str(tmp_path), LIMIT_S="300"))
    assert run.returncode == 4, run.stdout + run.stderr
    assert "> LIMIT_S 300 s: shorten them" in run.stdout
    assert not (tmp_path / "dry_out" / "steps.csv").exists()  # refused before any step started


def test_dry_run_runs_every_step_and_writes_every_table(tmp_path):
    if not (REPO / ".venv-0.14.1" / "bin" / "python").exists():
        pytest.skip("needs .venv-0.14.1 (ComfyUI 0.14.1's environment) for the 0.14.1 steps")
    if not default_comfyui():
        pytest.skip("the dry run covers both ComfyUI versions itself: it runs once, in the default ComfyUI's pass")
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, WORK=str(tmp_path)))
    out = run.stdout
    assert run.returncode == 0, out[-5000:] + run.stderr[-2000:]
    planned = int(re.search(r"plan: \d+ steps, (\d+) s", out).group(1))
    assert planned <= 570
    assert "[gpu_run] dry run: the plan holds" in out
    assert "[gpu_steps] comfy-aimdo: init() ok" in out
    folder = tmp_path / "dry_out"
    for name, columns in TABLES.items():
        with open(folder / f"{name}.csv", newline="") as f:
            assert tuple(next(csv.reader(f))) == columns
    with open(folder / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = plan_steps()
    assert {r["step"] for r in rows} == set(steps) - {"preflight"}
    for row in rows:  # every mode ran, and matched its reference bit for bit
        assert row["bitwise_equal_full"] == "True", row
        assert row["error"] in ("", "dry run: ModelPatcher on the CPU"), row
        assert float(row["step_ms"]) > 0 and float(row["ratio_to_bound"]) > 0
    modes = {(r["step"], r["mode"]) for r in rows}
    for step in ("s075_flux", "s075_wan"):
        assert {(step, m) for m in ("full", "comfy_lowvram", "layerwise_auto", "layerwise")} <= modes
    assert {("lora_075", m) for m in ("full", "full_lora", "layerwise_lora", "layerwise")} <= modes
    assert {r["weights"] for r in rows if r["step"] == "fp8_014"} == {"float32", "fp8_mixed"}
    fp8_streamed = {r["weights"]: int(r["streamed_bytes_per_step"]) for r in rows
                    if r["step"] == "fp8_014" and r["mode"] == "layerwise"}
    assert fp8_streamed["fp8_mixed"] < fp8_streamed["float32"] / 2  # the fp8 blocks stream as fp8
    assert [r["budget"] for r in rows if r["step"] == "dyn014_flux"] == ["all", "0.3"]
    with open(folder / "blocks.csv", newline="") as f:
        blocks = list(csv.DictReader(f))
    assert {b["preset"] for b in blocks} == {"tiny", "tiny_wan"}
    assert all(float(b["compute_ms"]) > 0 and float(b["copy_ms"]) > 0 for b in blocks)
    with open(folder / "preflight.csv", newline="") as f:
        names = {r["name"] for r in csv.DictReader(f)}
    assert {"h2d_gbps_registered", "stale_cuda_error_after_refusal", "hooks_manager_overhead_us_per_block"} <= names


def test_a_table_keeps_each_row_as_it_is_added(tmp_path):
    table = Table(tmp_path, "steps")
    assert (tmp_path / "steps.csv").read_text().strip() == ",".join(TABLES["steps"])
    table.add(step="a", step_ms=1.5, streamed_bytes_per_step=float(3 * 2**40 + 7))
    assert [r["step"] for r in Table(tmp_path, "steps").rows()] == ["a"]  # on disk now; reopening keeps the header
    table.add(step="b")
    rows = table.rows()
    assert [r["step"] for r in rows] == ["a", "b"]
    assert rows[0]["streamed_bytes_per_step"] == str(3 * 2**40 + 7)  # byte counts are exact, not rounded
    with pytest.raises(ValueError, match="no columns"):
        table.add(stepms=1)
    with pytest.raises(ValueError, match="unknown table"):
        Table(tmp_path, "nope")


def test_bound_and_ratio():
    assert bound_ms(10.0, 2e9, 50.0) == pytest.approx(40.0)  # 2 GB at 50 GB/s: the wire bounds the step
    assert bound_ms(100.0, 2e9, 50.0) == 100.0
    assert bound_ms("", 1, 1) == "" and ratio(1.0, "") == "" and ratio(3.0, 2.0) == 1.5


def test_ballast_and_peak_take_nothing_on_the_cpu():
    with Ballast(torch.device("cpu"), 1 << 20) as ballast, DevicePeak(torch.device("cpu")) as peak:
        pass
    assert ballast.nbytes == 0 and peak.peak_bytes == ""


class FakeAimdoControl:
    """comfy_aimdo.control's contract: init_device() does nothing and returns False until init() loaded the library."""

    def __init__(self):
        self.lib = None
        self.calls = []

    def init(self):
        self.calls.append("init")
        self.lib = object()
        return True

    def init_device(self, index):
        self.calls.append(f"init_device({index})")
        return self.lib is not None


def test_aimdo_is_started_in_comfyuis_order():
    control = FakeAimdoControl()
    assert gpu_steps.start_dynamic_vram(control, 0) == "init() and init_device(0) ok"
    assert control.calls == ["init", "init_device(0)"]
    with pytest.raises(RuntimeError, match=r"init_device\(0\) failed after init\(\)"):
        gpu_steps.aimdo_init_device(FakeAimdoControl(), 0)  # what the old bench did: every dynamic row failed


def test_real_aimdo_refuses_a_device_before_init():
    control = pytest.importorskip("comfy_aimdo.control")
    if control.lib is not None:
        pytest.skip("aimdo's library is already loaded in this process")
    assert control.init_device(0) is False
