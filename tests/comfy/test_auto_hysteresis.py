"""Auto's hysteresis (issue 28 item 2): a run whose plan would add one block keeps the count held; a bigger growth
moves, a shrink to fit always happens, and each change copies only the blocks that joined the resident set."""

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes import run_planning
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin
from layerwise_offload.offload import choose_resident_blocks, footprint
from layerwise_offload.offload.planner import forward_activation_bytes

pytestmark = pytest.mark.usefixtures("comfy_loopback")


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


def free_for(count, sizes):
    """ComfyUI's free-memory figure that fits exactly ``count`` blocks' plan (leading, prefetch 1)."""
    latent = tiny_dits.TINY_FAMILIES["wan21"].latent_shape
    activations = forward_activation_bytes("WanModel", 256, 2 * 8 * 8, batch=2 * latent[0], dtype_bytes=4).nbytes
    plan = footprint(sizes, choose_resident_blocks(len(sizes), count, "leading"), 1)
    return int(mm.minimum_inference_memory()) + activations + plan.total


def test_auto_keeps_its_count_for_one_block_more_and_moves_for_two_or_to_fit(monkeypatch, caplog):
    want = tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3)
    mm.unload_all_models()
    model = offload_model(tiny_dits.build_tiny("wan21"), -1, 1, "leading", True)
    controller = controller_of(model)
    manager = controller.manager
    sizes = manager.block_nbytes()
    free = [0]
    monkeypatch.setattr(mm, "get_free_memory",
                        lambda dev=None, torch_free_too=False: (free[0], free[0]) if torch_free_too else free[0])
    monkeypatch.setattr(run_planning, "available_host_bytes", lambda: None)  # plan from ComfyUI's figure

    def run(count):
        free[0] = free_for(count, sizes) - manager.device_bytes()  # what we hold counts as free to our plan
        copies = manager.stats().resident_copies
        assert torch.equal(tiny_dits.sample(model, seed=3), want)
        return len(manager.schedule.resident_blocks), manager.stats().resident_copies - copies

    # The tiny Wan's four blocks are the same size: with prefetch 1, 0 residents take two blocks' worth (the
    # slots), 1 three, and 2, 3 or 4 four (2 + 2 slots, 3 + 1 slot, 4 + none): auto keeps 0, 1 or 4.
    assert run(0) == (0, 0)
    held = manager.device_bytes() > 0
    with caplog.at_level("INFO", logger="layerwise_offload"):
        grown_by_one = run(1)
    if held:  # ComfyUI kept the model loaded between the runs: one block more is not worth a replan
        assert grown_by_one == (0, 0)
        assert controller.planner.last_plan.resident_count == 0
        assert any("keeping 0 resident blocks (1 would fit" in r.getMessage() for r in caplog.records)
    else:
        assert grown_by_one == (1, 1)
    assert run(4) == (4, 4 - grown_by_one[0])  # more than one block more: grows, copying only the new ones
    assert run(1) == (1, 0)  # the held count no longer fits: it shrinks, copying nothing
    assert held, "ComfyUI unloaded the model between runs: the hysteresis was not exercised"
