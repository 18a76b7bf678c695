"""The one-call GPU run (bench/gpu_run.sh) checked on the CPU: the time plan, every step end to end at the tiny
presets (its dry run, ComfyUI 0.3.75 and 0.33.0 from this machine's venvs), the tables that keep each row as it is
measured, the resident-count sweep beside the timing model, comfy-aimdo started in ComfyUI 0.33.0's order, and dynamic
VRAM's bytes counted as they move.
"""

import csv
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.bench import gpu_dynamic, gpu_harness
from layerwise_offload.bench.gpu_dynamic import VbarCastCounter
from layerwise_offload.bench.gpu_harness import predict_setting
from layerwise_offload.bench.gpu_steps import sweep_counts
from layerwise_offload.bench.gpu_tables import TABLES, Ballast, DevicePeak, State, Table, bound_ms, ratio

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
    if not (REPO / ".venv-0.33.0" / "bin" / "python").exists():
        pytest.skip("needs .venv-0.33.0 (ComfyUI 0.33.0's environment; scripts/test.sh sets it up) for its steps")
    if not default_comfyui():
        pytest.skip("the dry run covers both ComfyUI versions itself: it runs once, in the default ComfyUI's pass")
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, WORK=str(tmp_path)))
    out = run.stdout
    assert run.returncode == 0, out[-5000:] + run.stderr[-2000:]
    planned = int(re.search(r"plan: \d+ steps, (\d+) s", out).group(1))
    assert planned <= 420  # of the device's 15 minutes, start-up included: room to run it twice
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
        assert {(step, m) for m in ("full", "comfy_lowvram", "layerwise_auto", "sweep")} <= modes
        sweep = [r for r in rows if r["step"] == step and r["mode"] == "sweep"]
        num_blocks = int(sweep[0]["num_blocks"])
        assert sorted(int(r["resident"]) for r in sweep) == sorted(sweep_counts(num_blocks))  # 0..N, all of it
        for row in sweep:  # each run beside the model's replay of the setting that ran
            assert row["policy"] in ("leading", "strided") and float(row["predicted_step_ms"]) > 0
            assert float(row["predicted_ratio_to_bound"]) > 0
    for step in ("s075_flux",):  # residency_policy weights beside auto at every budget, fewer bytes
        auto = {r["budget"]: int(r["streamed_bytes_per_step"]) for r in rows
                if r["step"] == step and r["mode"] == "layerwise_auto"}
        weights = {r["budget"]: int(r["streamed_bytes_per_step"]) for r in rows
                   if r["step"] == step and r["mode"] == "layerwise_weights"}
        assert auto and weights.keys() == auto.keys(), (step, auto, weights)
        assert all(weights[b] <= auto[b] for b in auto), (step, auto, weights)
    with open(folder / "timeline.csv", newline="") as f:
        timeline = list(csv.DictReader(f))
    for step in ("s075_flux", "s075_wan"):
        sweep = [r for r in rows if r["step"] == step and r["mode"] == "sweep"]
        mine = [t for t in timeline if t["step"] == step]
        assert len(mine) == sum(int(r["num_blocks"]) for r in sweep)  # every block of every sweep run
        for t in mine:
            assert 0 <= float(t["predicted_start_ms"]) <= float(t["predicted_end_ms"])
            assert float(t["measured_start_ms"]) <= float(t["measured_end_ms"])
            assert t["streamed"] == "1" or t["predicted_copy_end_ms"] == ""
    assert {("lora_075", m) for m in ("full", "full_lora", "layerwise_lora", "layerwise")} <= modes
    assert [(r["mode"], r["budget"]) for r in rows if r["step"] == "dyn033_flux"] == [
        ("comfy_dynamic", "all"), ("comfy_dynamic", "0.3"), ("layerwise_aimdo", "0.3")]  # the node takes it over
    takeover = next(r for r in rows if r["mode"] == "layerwise_aimdo")
    assert float(takeover["step_ms"]) > 0 and takeover["forwards_per_step"]  # ran through the node's hooks
    assert {r["comfyui"] for r in rows if r["step"].startswith(("s033", "dyn033"))} == {"0.33.0"}
    assert {r["mode"] for r in rows if r["step"] == "smoke"} == {"full", "smoke"}
    assert len([r for r in rows if r["mode"] == "smoke"]) == 3
    with open(folder / "blocks.csv", newline="") as f:
        blocks = list(csv.DictReader(f))
    assert {b["preset"] for b in blocks} == {"tiny", "tiny_wan"}
    assert all(float(b["compute_ms"]) > 0 and float(b["copy_ms"]) > 0 for b in blocks)
    with open(folder / "preflight.csv", newline="") as f:
        names = {r["name"] for r in csv.DictReader(f)}
    assert {"h2d_gbps_registered", "stale_cuda_error_after_refusal", "hooks_manager_overhead_us_per_block",
            "smoke_cuda_sanitizer"} <= names


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
    """comfy_aimdo.control's contract (0.4.13, what ComfyUI 0.33.0 calls): init_devices() does nothing and returns
    False until init() loaded the library."""

    def __init__(self):
        self.lib = None
        self.calls = []

    def init(self, simple_vram_headroom=None, nvml_pressure=False):
        self.calls.append(f"init({simple_vram_headroom}, {nvml_pressure})")
        self.lib = object()
        return True

    def init_devices(self, device_ids):
        self.calls.append(f"init_devices({list(device_ids)})")
        return self.lib is not None


def test_aimdo_is_started_in_comfyuis_order():
    control = FakeAimdoControl()
    gpu_dynamic.aimdo_init(control)  # what the dynamic step calls before ComfyUI's import initialises CUDA
    gpu_dynamic.aimdo_init_device(control, 0)  # and after it, on the device ComfyUI picked
    assert control.calls == ["init(None, True)", "init_devices([(0, 0)])"]  # as 0.33.0's main.py: NVML pressure on
    with pytest.raises(RuntimeError, match=r"init_devices\(\[0\]\) failed after init\(\)"):
        gpu_dynamic.aimdo_init_device(FakeAimdoControl(), 0)  # a device before the library: every dynamic row fails


def test_real_aimdo_refuses_a_device_before_init():
    control = pytest.importorskip("comfy_aimdo.control")
    if control.lib is not None:
        pytest.skip("aimdo's library is already loaded in this process")
    assert control.init_devices([0]) is False


def test_the_sweep_spans_every_resident_count_ends_first():
    for blocks in (0, 1, 8, 12, 57):
        counts = sweep_counts(blocks)
        assert counts[0] == 0 and counts[:2] == ([0, blocks] if blocks else [0])
        assert len(counts) == len(set(counts)) <= 7 and max(counts) == blocks
        gaps = [b - a for a, b in zip(sorted(counts), sorted(counts)[1:])]
        assert not gaps or max(gaps) <= -(-blocks // 6)  # even steps over the whole range
    assert sorted(sweep_counts(12)) == [0, 2, 4, 6, 8, 10, 12] and sorted(sweep_counts(8)) == [0, 2, 4, 6, 8]


def test_the_prediction_beside_a_run_is_the_models_replay_with_the_measured_figures():
    nbytes, block_ms, gbps = [2 * 10**9] * 4, [10.0] * 4, 100.0  # a block copies in 20 ms, computes in 10 ms
    resident = predict_setting(nbytes, block_ms, 45.0, gbps, 4, "leading", 1)
    assert resident.step_s * 1e3 == pytest.approx(45.0, rel=0.01)  # nothing streams: the full load's step
    streamed = predict_setting(nbytes, block_ms, 45.0, gbps, 0, "leading", 1)
    assert streamed.bound_s * 1e3 == pytest.approx(80.0) and streamed.step_s * 1e3 >= 80.0  # the copies bound it
    assert len(streamed.block_spans) == 4 and {block for block, _, _ in streamed.copy_spans} == {0, 1, 2, 3}
    assert predict_setting(nbytes, ["", 1.0, 1.0, 1.0], 45.0, gbps, 0, "leading", 1) is None  # a block not timed


def test_dynamic_vram_bytes_count_only_modules_that_moved(monkeypatch):
    """cast_modules_with_vbar needs aimdo's VBAR on a GPU: stood in by what it leaves on each module
    (``_prefetch["resident"]``: the signature aimdo's fault returned matches the module's last cast)."""
    import comfy.ops

    def vbar_cast(comfy_modules, *args, **kwargs):
        for module in comfy_modules:
            module._prefetch = {"resident": module.pages_resident}
        return None

    monkeypatch.setattr(comfy.ops, "cast_modules_with_vbar", vbar_cast, raising=False)
    linear = comfy.ops.disable_weight_init.Linear
    moved, kept = linear(64, 32, dtype=torch.float32), linear(16, 8, bias=False, dtype=torch.float32)
    moved.pages_resident, kept.pages_resident = False, True
    for module in (moved, kept):
        module._v = object()  # a VBAR allocation: the classic cast counter leaves it to the VBAR count
    counter = VbarCastCounter()
    with counter.installed():
        comfy.ops.cast_modules_with_vbar([moved, kept], None, torch.device("cpu"), None, True)
        comfy.ops.cast_modules_with_vbar([kept], None, torch.device("cpu"), None, True)  # the next forward
    assert comfy.ops.cast_modules_with_vbar is vbar_cast  # put back
    assert counter.bytes >= (64 * 32 + 32) * 4 and counter.bytes < (64 * 32 + 32) * 4 + 4096  # aligned, once
    assert counter.resident_bytes >= 2 * 16 * 8 * 4  # kept twice, moved nothing


def test_a_mismatch_with_the_full_load_is_traced_to_its_first_module(tmp_path, monkeypatch):
    """When a run of the pack is not bitwise with the full load, the GPU run reruns one step of each and names the
    first leaf module that got the same input and gave another output (on the CPU here: a module made to differ)."""
    from types import SimpleNamespace
    monkeypatch.setenv("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    args = SimpleNamespace(preset="tiny_wan", dry_run=True, steps=3, step_name="trace")
    tables = {name: Table(tmp_path, name) for name in TABLES}
    h = gpu_harness.make_harness(args, State(tmp_path / "work"), tables)
    try:
        h.full()
        offload = h._offload

        def offload_with_a_different_module(*a):
            patcher = offload(*a)
            ffn = patcher.get_model_object("diffusion_model").blocks[1].ffn[0]
            ffn.register_forward_hook(lambda module, args, output: output + 1)
            return patcher
        monkeypatch.setattr(h, "_offload", offload_with_a_different_module)
        row = h.layerwise(0, 1, "leading", "device", None, mode="layerwise", ballast=False)
        assert row["bitwise_equal_full"] is False
    finally:
        h.teardown()
    notes = [r for r in tables["preflight"].rows() if r["name"] == "first_difference_trace"]
    assert len(notes) == 1 and notes[0]["note"].startswith("blocks.1.ffn.0 (Linear): same input, output differs")
