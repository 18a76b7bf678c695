"""Streamed tails through ComfyUI (issue 28 item 4): auto, with a card known to the timing model and a VRAM budget
smaller than the model, plans every block's head resident and streams the tails, fewer bytes a step than whole
blocks in the same budget; bitwise against ComfyUI alone, with and without a LoRA on the device; ComfyUI is told the
footprint it holds; the next run keeps the tails held instead of moving heads."""

import dataclasses

import pytest
import torch

import comfy.model_management as mm
import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes import run_planning
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.nodes.stats_view import stats_view
from layerwise_offload.offload import TIMING_GPU_ENV, plan_residency
from layerwise_offload.offload.timing import costs as gpu_costs
from layerwise_offload.tests.comfy_support import overhead
from layerwise_offload.tests.device_lora_setup import random_lora

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


SLOW_LINK = "RTX 4090 behind a 0.2 GB/s link"


@pytest.fixture
def budget(monkeypatch):
    """ComfyUI's free-memory figure, set per run (room for all at first: ComfyUI alone loads the model whole, as the
    reference). The loopback plans as an RTX 4090 would behind a link slow enough that the tiny model's copies
    outweigh its host time per block, as a real model's do on the real link (bench/results/timing_model.md)."""
    card = gpu_costs.GPUS["RTX 4090 24GB"]
    monkeypatch.setitem(gpu_costs.GPUS, SLOW_LINK, dataclasses.replace(card, name=SLOW_LINK, h2d_bytes_per_s=0.2e9))
    monkeypatch.setenv(TIMING_GPU_ENV, SLOW_LINK)
    free = [2 ** 40]
    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (free[0], free[0]) if torch_free_too else free[0])
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)  # plan from ComfyUI's figure
    yield free
    mm.unload_all_models()


@pytest.mark.parametrize("lora", [False, True])
def test_auto_streams_tails_bitwise_and_fewer_bytes_than_whole_blocks(budget, lora):
    def build():
        model = tiny_dits.build_tiny("wan21")
        if lora:
            patches = random_lora(tiny_dits.build_tiny("wan21"), rank=2)
            model = comfy.sd.load_lora_for_models(model, None, patches, 0.8, 0)[0]
        return model
    want = tiny_dits.sample(build(), seed=3)
    mm.unload_all_models()
    model = offload_model(build(), -1, 1, "auto", True)
    controller = controller_of(model)
    manager = controller.manager
    sizes = manager.block_nbytes()
    budget[0] = overhead() + int(0.8 * sum(sizes))
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    config = manager.config
    assert isinstance(config.streamed_tail_bytes, tuple), f"auto chose {controller.planner.last_choice[:3]}, not tails"
    assert controller.planner.last_plan.tails == config.streamed_tail_bytes
    tails = manager.block_tails()
    stats = manager.stats()
    assert stats.head_bytes == sum(sizes) - sum(tails) > 0
    assert stats.bytes_copied_last_forward == sum(tails)  # the step moves the tails, nothing else
    assert manager.device_bytes() == manager.device_bytes(manager.config) <= budget[0] - overhead()
    assert controller.planned_footprint() == controller.non_block_bytes() + manager.device_bytes() + \
        controller.device_lora_scratch  # what ComfyUI is told
    room = budget[0] - overhead() - controller.device_lora_scratch
    whole = min((plan_residency(sizes, room, policy=p) for p in ("leading", "strided")),
                key=lambda plan: plan.streamed_bytes)
    assert sum(tails) < whole.streamed_bytes
    text, _ = stats_view(model)
    assert "each streams its tail" in text, text  # what the Stats node shows
    assert "streamed as tails (their heads" in controller.last_report.headline()
    if lora:
        assert manager.after_copy is not None  # the LoRA is applied on the device: heads once, tails at each copy

    # The next run, with a little more room: a plan streaming a little less would fit, but the tails held still fit
    # and are kept, no head moves.
    heads, held = dict(manager.engine.device_memory.heads), manager.config.streamed_tail_bytes
    copies = manager.stats().resident_copies
    budget[0] += int(0.05 * sum(sizes)) - manager.device_bytes()  # what we hold counts as free to our plan
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert heads and manager.engine.device_memory.heads, "ComfyUI unloaded the model between runs: nothing was held"
    assert manager.stats().resident_copies == copies
    assert all(manager.engine.device_memory.heads[i] is heads[i] for i in heads)
    assert manager.config.streamed_tail_bytes == held

    # Room for the whole model: no tails, every block resident.
    budget[0] = overhead() + 2 * sum(sizes)
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert manager.config.streamed_tail_bytes == 0 and not manager.engine.device_memory.heads
    assert len(manager.schedule.resident_blocks) == len(sizes)


def test_without_a_card_auto_streams_whole_blocks(monkeypatch):
    """On the loopback as it is (no card for the timing model), auto keeps today's whole-block plans."""
    monkeypatch.delenv(TIMING_GPU_ENV, raising=False)
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    model = offload_model(tiny_dits.build_tiny("wan21"), -1, 1, "auto", True)
    manager = controller_of(model).manager
    sizes = manager.block_nbytes()
    free = overhead() + int(0.6 * sum(sizes))
    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (free, free) if torch_free_too else free)
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)
    assert torch.equal(tiny_dits.sample(model, seed=3), want)
    assert manager.config.streamed_tail_bytes == 0 and not manager.engine.device_memory.heads
    mm.unload_all_models()
