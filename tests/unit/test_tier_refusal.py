"""Host RAM beside a device that lives in it (the CPU loopback), and the refusal's figures (issue 42).

On the CPU loopback the "VRAM" (streaming slots, residents, scratch) is host RAM, taken when the first forward arms
the plan, after packing. The tier plan used to take it off the RAM before weighing packing's peak, so packing's
peak and the slots counted at once although they never coexist: on ComfyUI 0.33.0 a 2.05 GiB Wan at ComfyUI alone's
own limit (+ the slots) was refused with every block on disk, whose packing needs one chunk and, once packed, frees
the whole model. Now packing's peak (with its slack) and the armed plan (what packing leaves, beside the device's
share) are weighed apart.

A refusal states what is needed, what is available and by how much it is short in one sum, in whole MiB, that adds
up as printed.
"""

import re

import pytest
import torch
from torch import nn

from layerwise_offload.offload import HostEnvironment, OffloadConfig
from layerwise_offload.offload.blocks.params import BlockParameters
from layerwise_offload.offload.disk.budget import PACKING_SLACK_BYTES
from layerwise_offload.offload.host.side import HostSide
from layerwise_offload.offload.host.packing import block_parameters

MiB = 2**20
BLOCK = 4 * MiB  # one Linear(1024, 1024) without bias, float32
BLOCKS = 8
SLOTS = 128 * MiB  # two slots of a real model's 64 MiB blocks: more than packing's slack


def blocks(count=BLOCKS):
    torch.manual_seed(0)
    return [nn.Linear(1024, 1024, bias=False) for _ in range(count)]


def host_side(tmp_path, modules, available, device_share=0, host_store="auto"):
    config = OffloadConfig(host_store=host_store, prefetch_size=1)
    return HostSide(modules, torch.device("cpu"), lambda: config, HostEnvironment(
        disk_folder=str(tmp_path), available_host_bytes=lambda: available,
        device_bytes_from_host=(lambda: device_share) if device_share else None))


def test_the_loopbacks_slots_are_weighed_after_packing_not_beside_its_peak(tmp_path):
    """Room for packing's peak (a chunk and the slack) and, once packed, for the slots beside what packing leaves,
    but not for the peak and the slots at once: the plan packs, bitwise, and says what the slots take. Every block
    in RAM would fit but leave less than the slack beside the slots for the forward (a 2.05 GiB Wan at 2.75 GiB
    that way was OOM-killed in its first step): blocks go to disk, each one's packing freeing ComfyUI's copy."""
    modules = blocks(24)
    expected = [module.weight.detach().clone() for module in modules]
    slots = 96 * MiB  # more than the slack
    available = 99 * MiB  # below one block's peak + the slots
    host = host_side(tmp_path, modules, available, device_share=slots)
    assert host.shortfall() is None, host.shortfall()
    params = BlockParameters(modules)

    def point_at_host_copy(index):
        params.point_released(index, host.store, at_host=True, inference=host.inference_tensors)
    host.pack(host.outdated(params), params, point_at_host_copy)
    plan = host.tier_plan
    assert plan.disk_blocks > 0 and plan.device_share_bytes == slots and plan.available_bytes == available
    assert plan.free_after() >= PACKING_SLACK_BYTES
    assert plan.peak_bytes + PACKING_SLACK_BYTES <= available  # packing: one block's chunk at a time
    assert plan.growth_bytes + slots + PACKING_SLACK_BYTES <= available < BLOCK + slots
    assert "beside the 96 MiB the CPU loopback's slots and residents take" in plan.reason, plan.reason
    for index, weight in enumerate(expected):
        source = host.source(index)
        if not isinstance(source, torch.Tensor):
            source = source.read()
        layout = host.store.layouts[index]
        assert torch.equal(layout.weights_from(layout.views(source))[0], weight)
    host.close()


def test_beside_a_gpu_nothing_is_taken_for_the_device(tmp_path):
    host = host_side(tmp_path, blocks(), PACKING_SLACK_BYTES + 2 * BLOCK)
    assert host.shortfall() is None
    plan = host.planner.plan(range(BLOCKS))
    assert plan.device_share_bytes == 0 and plan.disk_blocks == 0  # packing frees ComfyUI's copies: all in RAM


FIGURES = re.compile(r"host memory is short: (?:with every block on disk \(a staging ring of (\d+) MiB\), )?"
                     r"(.*?) = (-?\d+) MiB, but (\d+) MiB is available: (\d+) MiB short \(")


def figures(message):
    """(the terms of the sum, with their signs, its total, available, short) as the message prints them."""
    found = FIGURES.search(message)
    assert found, message
    parts = re.split(r" ([+-]) ", found.group(2))
    terms = [int(re.search(r"(\d+) MiB", parts[0]).group(1))]
    for operator, piece in zip(parts[1::2], parts[2::2]):
        value = int(re.search(r"(\d+) MiB", piece).group(1))
        terms.append(value if operator == "+" else -value)
    return terms, int(found.group(3)), int(found.group(4)), int(found.group(5))


@pytest.mark.parametrize("case", ["packing, in RAM", "armed, in RAM", "every block on disk", "armed, on disk"])
def test_a_refusals_figures_add_up(tmp_path, case):
    """Each refusal, whichever part binds: its terms sum to what it says is needed, that less what it says is
    available is what it says is missing, and those are the plan's own figures, rounded against the user (what is
    needed up, what is available down), so a refusal never reads as if it fitted."""
    modules = blocks()
    shared = None
    if case == "packing, in RAM":  # packing frees nothing (another holder): the whole model on top
        shared = [module.weight.data for module in modules]
        host, mode = host_side(tmp_path, modules, 20 * MiB + 12345, host_store="ram"), "ram"
    elif case == "armed, in RAM":  # packing fits, the slots beside the packed blocks do not
        host, mode = host_side(tmp_path, modules, PACKING_SLACK_BYTES + 60 * MiB + 777, SLOTS, "ram"), "ram"
    elif case == "every block on disk":
        host, mode = host_side(tmp_path, modules, 50 * MiB + 4321, host_store="disk"), "disk"
    else:  # on disk packing frees the model, and the slots still do not fit beside what is left
        host, mode = host_side(tmp_path, modules, PACKING_SLACK_BYTES + 9 * MiB, 3 * SLOTS, "disk"), "disk"
    message = host.shortfall()
    assert message is not None
    plan = host.planner.plan(range(BLOCKS), mode)
    terms, need, available, short = figures(message)
    assert sum(terms) == need and need - available == short >= 1, message
    assert available == plan.available_bytes // MiB
    assert need * MiB >= plan.needed_bytes() > (need - len(terms)) * MiB, message
    assert short * MiB >= plan.shortfall() > (short - len(terms) - 1) * MiB, message
    assert ("with every block on disk (a staging ring of" in message) == (mode == "disk"), message
    assert ("VRAM on a GPU" in message) == case.startswith("armed"), message
    if case == "packing, in RAM":
        assert message.startswith("[layerwise-offload] host memory is short: packing the blocks needs "), message
        assert f"+ {PACKING_SLACK_BYTES // MiB} MiB kept for packing's own temporaries" in message, message
    del shared
