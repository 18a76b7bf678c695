"""Auto resident count from ComfyUI's free-memory figure, per-run telemetry and the stats node."""

import json
import re

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.device_support import CPU_LOOPBACK_ENV, device_support, startup_line
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.offload_node import offload_stats, residency_policy_problem
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.nodes.v1 import LayerwiseOffloadStatsV1, LayerwiseOffloadV1
from layerwise_offload.nodes.offload_node import DEFAULTS
from layerwise_offload.offload import format_bytes
from layerwise_offload.offload.planner import forward_activation_bytes, plan_residency


def offload_stats_text(model, after_connected=True):
    return offload_stats(model, after_connected)[0]  # the text the Stats node shows


pytestmark = pytest.mark.usefixtures("comfy_loopback")


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


def fake_free_memory(monkeypatch, free_bytes):
    """ComfyUI's one free-memory function, and nothing else, reports ``free_bytes``."""
    def get_free_memory(dev=None, torch_free_too=False):
        return (free_bytes, free_bytes) if torch_free_too else free_bytes
    monkeypatch.setattr(mm, "get_free_memory", get_free_memory)


def wan_activation_bytes():
    """The measured Wan line (nearest width 1536, scaled to the tiny model's 256), float32, cond + uncond."""
    latent = tiny_dits.TINY_FAMILIES["wan21"].latent_shape  # (1, 16, 2, 8, 8)
    estimate = forward_activation_bytes("WanModel", 256, 2 * 8 * 8, batch=2 * latent[0], dtype_bytes=4)
    assert estimate.source == "wan_1_3b scaled to width 256"
    return estimate.nbytes


def test_auto_keeps_as_many_blocks_as_the_faked_free_memory_allows(monkeypatch):
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    model = offload_model(tiny_dits.build_tiny("wan21"), -1, 1, "leading", True)
    manager = controller_of(model).manager
    sizes = manager.block_nbytes()
    reserve = int(mm.minimum_inference_memory())
    activations = wan_activation_bytes()
    # Room for one resident block and two streaming slots (three blocks); keeping all four resident, or
    # two resident plus two slots, would need four.
    free = reserve + activations + sizes[0] + 2 * max(sizes[1:])
    expected = plan_residency(sizes, free, reserve_bytes=reserve, activation_bytes=activations, prefetch_size=1)
    assert expected.resident_count == 1
    fake_free_memory(monkeypatch, free)
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert manager.schedule.resident_blocks == (0,)
    assert controller_of(model).planner.last_plan == expected

    # More free memory at the next prompt: the plan grows, output unchanged.
    fake_free_memory(monkeypatch, free + 10 * sum(sizes))
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert len(manager.schedule.resident_blocks) == 4

    # Too little for even the streaming slots: stream everything, never fail. (ComfyUI itself also reads
    # the figure: with nothing free it runs cond and uncond as separate forwards, so the reference is
    # taken under the same figure.)
    fake_free_memory(monkeypatch, 0)
    want_unbatched = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    assert torch.equal(tiny_dits.sample(model, seed=3), want_unbatched)
    assert manager.schedule.resident_blocks == ()


def test_on_the_cpu_loopback_auto_plans_from_the_ram_this_process_may_still_use(monkeypatch):
    """The loopback's "VRAM" is RAM: ComfyUI's host-wide free figure is blind to a memory cgroup, so auto plans
    from the smaller of it and what this process may still use (cgroup included), as a GPU of that size would."""
    from layerwise_offload.nodes import run_planning
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    model = offload_model(tiny_dits.build_tiny("wan21"), -1, 1, "leading", True)
    manager = controller_of(model).manager
    sizes = manager.block_nbytes()
    reserve = int(mm.minimum_inference_memory())
    room_for_one = reserve + wan_activation_bytes() + sizes[0] + 2 * max(sizes[1:])
    fake_free_memory(monkeypatch, 10 * (room_for_one + sum(sizes)))  # the host-wide figure: plenty
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: room_for_one)  # the cgroup's
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert manager.schedule.resident_blocks == (0,)
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)  # unknown: ComfyUI's figure
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert len(manager.schedule.resident_blocks) == 4


def test_auto_is_the_default_and_the_stats_node_shows_its_plan():
    assert DEFAULTS["resident_layers"] == -1
    assert LayerwiseOffloadV1.INPUT_TYPES()["required"]["resident_layers"][1]["default"] == -1
    model = offload_model(tiny_dits.build_tiny("wan21"))  # every setting at its default
    controller = controller_of(model)
    assert controller.auto
    tiny_dits.sample(model, seed=3)
    text = offload_stats_text(model)
    [plan_line] = [line for line in text.splitlines() if line.startswith("auto: ")]
    assert controller.planner.last_plan.resident_count == 4  # a roomy machine keeps the 4 tiny blocks
    assert plan_line.startswith("auto: every block fits in the ") and "of estimated activations" in plan_line
    assert "wan_1_3b" not in text and "scaled to width" not in text  # the table's row names are not words
    # A user's number wins over auto: no plan line, the count asked for.
    fixed = offload_model(tiny_dits.build_tiny("wan21"), 2)
    tiny_dits.sample(fixed, seed=3)
    assert not controller_of(fixed).auto and controller_of(fixed).plan().resident_count(controller_of(fixed).num_blocks) == 2
    assert "auto:" not in offload_stats_text(fixed)


def test_run_telemetry_counts_streamed_bytes_times_forwards():
    model = offload_model(tiny_dits.build_tiny("flux"), 2, 1, "strided", True)
    manager = controller_of(model).manager
    forwards = []
    tiny_dits.sample(model, seed=3, steps=3, callback=lambda *a: forwards.append(1))
    report = controller_of(model).last_report
    sizes = manager.block_nbytes()
    streamed = [sizes[i] for i in manager.schedule.streamed_blocks]
    assert report.forwards == len(forwards) == 3
    assert report.bytes_per_forward == sum(streamed)
    # The run copies the residents once, the streamed blocks once per forward, and after the last block
    # the prefetch that wraps around to the first streamed block(s) of the next step.
    wrapped = manager.schedule.upcoming_streamed(manager.num_blocks - 1, manager.config.prefetch_size)
    resident = sum(sizes[i] for i in manager.schedule.resident_blocks)
    assert report.run_bytes == manager.stats().bytes_copied == resident + 3 * sum(streamed) + sum(sizes[i] for i in wrapped)
    assert report.resident_blocks == 2 and report.num_blocks == 5
    assert report.copy_seconds > 0 and report.stall_seconds > 0  # loopback copies are all stall


def test_stats_node_shows_the_last_run_as_text_and_picture_data():
    model = offload_model(tiny_dits.build_tiny("wan21"), 1, 1, "leading", True)
    # No run yet: with `after` unconnected it says to connect it (the node would otherwise run before the sampler).
    waiting = LayerwiseOffloadStatsV1().show(model)
    assert waiting["result"][0] == ("No run yet: connect the sampler's LATENT output to `after`, then queue the "
                                    "prompt.")
    assert waiting["ui"]["layerwise_offload"] == [{"state": "no_run", "title": "no run yet", "after_connected": False,
                                                   "lines": [waiting["result"][0]]}]
    assert "feed the sampler from this Layerwise Offload node" in offload_stats_text(model, after_connected=True)
    tiny_dits.sample(model, seed=3, steps=3)
    result = LayerwiseOffloadStatsV1().show(model, after={"samples": None})
    text = result["result"][0]
    [data] = result["ui"]["layerwise_offload"]
    assert result["ui"]["text"] == [text] and data["lines"] == text.splitlines()
    assert json.loads(json.dumps(data)) == data  # the UI output travels as JSON
    report = controller_of(model).last_report
    assert data["state"] == "run" and data["blocks"] == "RSSS" and report.steps == 3
    assert text.startswith("1 of 4 blocks in VRAM, 3 streamed\n")
    sizes = controller_of(model).manager.block_nbytes()
    assert f"{format_bytes(sum(sizes[1:]))} copied per step in " in text and re.search(r"\([0-9.]+ [kMG]B/s\)", text)
    # The CPU loopback's limits are said once, instead of pin figures that contradict the widget.
    assert "no pinning and no copy/compute overlap on the CPU" in text and "pinned" not in text
    assert "took" in text.splitlines()[-1] and text.splitlines()[-1].startswith("advice: ")
    assert data["vram"]["blocks"] == report.peak_device_bytes and data["ram"]["held"] == report.host_ram_bytes > 0
    assert data["time"]["overlap"] is False and data["time"]["copy"] > 0 and data["time"]["unit"] == "step"
    # The previous run, read with `after` unconnected, says it is the previous one.
    assert "(the previous run: connect the sampler's LATENT output to `after`" in offload_stats_text(model, False)
    plain = tiny_dits.build_tiny("wan21")
    assert offload_stats(plain)[1]["state"] == "not_offloaded"
    assert "connect that node's MODEL output to `model`" in offload_stats_text(plain)


def test_a_cpu_without_the_loopback_passes_through_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv(CPU_LOOPBACK_ENV)
    with caplog.at_level("INFO", logger="layerwise_offload"):
        passed = offload_model(tiny_dits.build_tiny("wan21"))
        lora_after = passed.clone()  # what a LoRA loader after the node hands the sampler
        want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
        assert torch.equal(tiny_dits.sample(lora_after, seed=3), want)
    text, data = offload_stats(lora_after)
    assert text.startswith("passed through: ComfyUI runs on the CPU, nothing to offload\n")
    assert data["state"] == "passed_through" and data["device"] == "cpu" and "not offloaded" not in text
    assert f"{CPU_LOOPBACK_ENV}=1" in text.splitlines()[1]
    runs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[layerwise-offload] run: ")]
    assert runs == ["[layerwise-offload] run: passed through: ComfyUI runs on the CPU, nothing to offload"]


def test_the_start_up_line_names_the_device_and_what_the_node_does(monkeypatch):
    monkeypatch.delenv(CPU_LOOPBACK_ENV)
    assert startup_line(torch.device("cpu")) == (
        "[layerwise-offload] loaded; the Layerwise Offload node will pass models through: ComfyUI runs on the CPU, "
        f"nothing to offload (start ComfyUI with {CPU_LOOPBACK_ENV}=1 to run the offload on the CPU as a test)")
    for kind in ("mps", "xpu"):
        support = device_support(torch.device(kind))
        assert not support.offloads and support.reason.startswith(f"passed through: ComfyUI runs on {kind}")
        assert f"pass models through: ComfyUI runs on {kind}" in startup_line(torch.device(kind))
    assert device_support(torch.device("cuda", 0)).offloads
    monkeypatch.setenv(CPU_LOOPBACK_ENV, "1")
    assert startup_line(torch.device("cpu")).startswith("[layerwise-offload] loaded; offloading on the CPU (")


def test_two_offloaded_models_hold_their_weights_once_in_ram():
    """Wan 2.2's two experts, each offloaded: packing replaces ComfyUI's CPU weights, nothing is held twice."""
    import ctypes
    import gc

    import psutil
    libc = ctypes.CDLL("libc.so.6")  # glibc keeps freed heap pages; trim them so RSS shows what is held
    config = dict(tiny_dits.WAN21_TINY_CONFIG, dim=512, num_heads=4, ffn_dim=2048)
    experts = [tiny_dits._build("WAN21_T2V", config, seed, torch.float32) for seed in (1, 2)]
    gc.collect()
    libc.malloc_trim(0)
    before = psutil.Process().memory_info().rss
    offloaded = [offload_model(expert, 1, 1, "leading", True) for expert in experts]
    stores = device = 0
    for model in offloaded:
        tiny_dits.sample(model, latent=(1, 16, 1, 8, 8), seed=3, family="wan21")
        stores += controller_of(model).manager.store.nbytes()
        device += controller_of(model).manager.device_bytes()  # on the CPU loopback "VRAM" is RAM too
    gc.collect()
    libc.malloc_trim(0)
    grown = psutil.Process().memory_info().rss - before - device
    assert stores > 100 * 2**20
    assert grown < 0.25 * stores, f"RSS grew {grown / 2**20:.0f} MiB for {stores / 2**20:.0f} MiB of host stores"


def test_residency_policy_auto_runs_the_setting_the_timing_model_chooses_bitwise(monkeypatch):
    """The default residency_policy (auto): with a card known (here the loopback plans as an RTX 4090 would), the
    policy and prefetch depth are the timing model's choice among those that fit, prefetch never below the node's;
    with no card known (the loopback as it is), leading with the node's prefetch. Output bitwise either way."""
    from layerwise_offload.offload import TIMING_GPU_ENV
    from layerwise_offload.offload.timing.choice import SETTINGS
    assert DEFAULTS["residency_policy"] == "auto"
    assert LayerwiseOffloadV1.INPUT_TYPES()["required"]["residency_policy"][0][0] == "auto"
    want = tiny_dits.sample(tiny_dits.build_tiny("flux"), seed=5)
    mm.unload_all_models()
    monkeypatch.delenv(TIMING_GPU_ENV, raising=False)
    plain = offload_model(tiny_dits.build_tiny("flux"), 1, 2)
    assert torch.equal(tiny_dits.sample(plain, seed=5), want)
    assert (controller_of(plain).manager.config.policy, controller_of(plain).manager.config.prefetch_size) == (
        "leading", 2)
    monkeypatch.setenv(TIMING_GPU_ENV, "RTX 4090 24GB")
    for resident in (1, -1):
        model = offload_model(tiny_dits.build_tiny("flux"), resident, 2)
        assert torch.equal(tiny_dits.sample(model, seed=5), want)
        controller = controller_of(model)
        policy, prefetch, count, *tails = controller.planner.last_choice
        assert (policy, prefetch) in SETTINGS and prefetch >= 2
        config = controller.manager.config
        assert (config.policy, config.prefetch_size) == (policy, prefetch)
        if resident == 1:
            assert config.resident_layers == 1
        del model, controller
        mm.unload_all_models()
    assert "must be one of 'auto', 'leading', 'strided'" in residency_policy_problem("trailing")
