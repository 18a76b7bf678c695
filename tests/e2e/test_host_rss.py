"""Host RAM of a real ComfyUI server (a fresh process of its own, CPU loopback) running the offload node.

Nobody trims the server's heap from outside: what RSS shows is what a user's memory cgroup counts. The model
is a Wan 2.1 with 4 blocks of ~38 MiB (~190 MiB of weights), so the ratios are not drowned in interpreter noise.
On the CPU loopback the manager's "device" slots are host memory too; they are counted apart (on a GPU they are
VRAM). Targets: growth <= 1.05 x the weights + one block while the model is loaded (<= 1.10 x with a LoRA over
every Linear of the blocks, applied on the device: the host keeps the unpatched weights only); back within one
block of the start once it is unloaded.
"""

from __future__ import annotations

import time

import pytest
import safetensors.torch
import torch

from layerwise_offload.devtools import e2e_assets, tiny_dits
from layerwise_offload.devtools.server import ComfyServer, prepare_base_dir

from .conftest import CPU_LOOPBACK_ENV
from .server_support import anon_rss, block_lora, one_step_prompt, settled_rss, unload_everything

MODEL_NAME = "layerwise_offload_rss_wan21.safetensors"
LORA_NAME = "layerwise_offload_rss_wan21_lora.safetensors"
CONFIG = dict(tiny_dits.WAN21_TINY_CONFIG, dim=768, num_heads=6, ffn_dim=3072, num_layers=4)
PREFETCH = 1


@pytest.fixture(scope="module")
def rss_server(tmp_path_factory, tiny_assets):
    base = prepare_base_dir(tmp_path_factory.mktemp("rss_base"))
    for kind, sub in (("wan21", "diffusion_models"), ("vae", "vae")):
        (base / "models" / sub / tiny_assets[kind].split("/")[-1]).symlink_to(tiny_assets[kind])
    e2e_assets.copy_cond(tiny_assets, base)
    patcher = tiny_dits._build("WAN21_T2V", CONFIG, 5, torch.float32)
    state = {k: v.detach().contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}
    safetensors.torch.save_file(state, str(base / "models" / "diffusion_models" / MODEL_NAME))
    weights = sum(t.numel() * t.element_size() for t in state.values())
    (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(block_lora(state), str(base / "models" / "loras" / LORA_NAME))
    block = sum(t.numel() * t.element_size() for k, t in state.items() if k.startswith("blocks.0."))
    del patcher, state
    server = ComfyServer(base, cpu=True, env={CPU_LOOPBACK_ENV: "1"}, extra_args=["--disable-api-nodes"])
    server.start(timeout=240)
    try:
        yield server, weights, block
    finally:
        server.stop()


def rss_at_most(pid: int, limit: int, polls: int = 80) -> int:
    """Anonymous RSS as soon as it is <= ``limit`` (the unload has happened), else the last reading."""
    now = anon_rss(pid)
    for _ in range(polls):
        if now <= limit:
            break
        time.sleep(0.25)
        now = anon_rss(pid)
    return now


def test_rss_of_an_offloaded_model_is_its_weights_once_and_returns_after_unload(rss_server):
    server, weights, block = rss_server
    offload = {"resident_layers": 0, "prefetch_size": PREFETCH}
    # Warm up every code path (the node, the sampler, the conditioning loader) on the small tiny model.
    server.run_prompt(one_step_prompt(offload=offload, prefix="rss/warm"))
    unload_everything(server)
    before = settled_rss(server.proc.pid)
    server.run_prompt(one_step_prompt(offload=offload, unet=MODEL_NAME, prefix="rss/big"))
    loaded = settled_rss(server.proc.pid)
    slots = (PREFETCH + 1) * block  # the loopback's "VRAM": streaming slots, in host memory here
    grown = loaded - before - slots
    print(f"\n[layerwise-offload] RSS grew {grown / 2**20:.1f} MiB beyond the slots for {weights / 2**20:.1f} MiB "
          f"of weights (block {block / 2**20:.1f} MiB): (growth - one block) / weights = {(grown - block) / weights:.3f}")
    assert grown <= 1.05 * weights + block, (
        f"RSS grew {grown / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights\n{server.log_tail(20)}")
    unload_everything(server)
    after = rss_at_most(server.proc.pid, before + block)
    print(f"[layerwise-offload] after unload: RSS {(after - before) / 2**20:+.1f} MiB from before the model")
    assert after - before <= block, f"RSS stayed {(after - before) / 2**20:.0f} MiB above the start after unload"


def test_rss_with_a_lora_is_the_unpatched_weights_once(rss_server):
    """The LoRA is applied on the device as each block is copied in: no patched second copy in host RAM."""
    server, weights, block = rss_server
    offload = {"resident_layers": 0, "prefetch_size": PREFETCH}
    unload_everything(server)
    before = settled_rss(server.proc.pid)
    server.run_prompt(one_step_prompt(offload=offload, unet=MODEL_NAME, lora=LORA_NAME, prefix="rss/lora"))
    loaded = settled_rss(server.proc.pid)
    grown = loaded - before - (PREFETCH + 1) * block
    print(f"\n[layerwise-offload] with a LoRA over every block Linear: RSS grew {grown / 2**20:.1f} MiB beyond the "
          f"slots for {weights / 2**20:.1f} MiB of weights (block {block / 2**20:.1f} MiB): "
          f"(growth - one block) / weights = {(grown - block) / weights:.3f}")
    assert "applied on the device" in server.log_text(), server.log_tail(20)
    assert grown <= 1.10 * weights + block, (
        f"RSS grew {grown / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights with a LoRA\n{server.log_tail(20)}")
    unload_everything(server)
