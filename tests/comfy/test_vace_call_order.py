"""Wan VACE runs ``vace_blocks[k]`` between ``blocks[i]``: the offload learns that order from the model.

A tiny VaceWanModel built from ComfyUI's own classes (4 ``blocks``, 2 ``vace_blocks`` run after blocks 0
and 2). After the first forward, prefetch follows the learned order: no block is copied on demand and
each forward moves exactly the streamed blocks' bytes, and the output stays bitwise that of ComfyUI
without the node.
"""

import pytest
import torch

import comfy.model_management as mm

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin

pytestmark = pytest.mark.usefixtures("comfy_loopback")

LATENT = (1, 16, 2, 8, 8)
VACE_CONFIG = {**tiny_dits.WAN21_TINY_CONFIG, "model_type": "vace", "vace_layers": 2, "vace_in_dim": 96}


def build_vace():
    return tiny_dits._build("WAN21_Vace", VACE_CONFIG, seed=0, dtype=torch.float32)


def sample(patcher):
    positive, negative = tiny_dits.make_conditioning("wan21", seed=3)
    return tiny_dits.sample(patcher, latent=LATENT, positive=positive, negative=negative, seed=3)


def test_vace_interleaved_blocks_are_prefetched_in_the_order_they_run():
    want = sample(build_vace())
    mm.unload_all_models()
    offloaded = offload_model(build_vace(), 0, 1, "leading", True)
    manager = offloaded.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager
    assert manager.num_blocks == 6
    assert torch.equal(sample(offloaded), want)  # the first forward learns the order
    assert manager.engine.calls.learned_calls == (0, 4, 1, 2, 5, 3)
    before = manager.stats()
    assert torch.equal(sample(offloaded), want)
    after = manager.stats()
    forwards = after.forwards - before.forwards
    assert forwards > 0
    assert after.demand_copies - before.demand_copies == 0
    assert after.bytes_copied_last_forward == sum(manager.block_nbytes())
    assert after.copies_last_forward == 6
    assert after.bytes_copied - before.bytes_copied == forwards * sum(manager.block_nbytes())
