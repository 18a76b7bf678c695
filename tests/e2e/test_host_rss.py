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
from .test_server import tiny_prompt

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


def block_lora(state, rank=4):
    """A rank-4 LoRA over every Linear weight of the blocks (ComfyUI's generic ``lora_up``/``lora_down`` keys)."""
    generator = torch.Generator().manual_seed(7)
    lora = {}
    for key, tensor in state.items():
        if key.startswith("blocks.") and key.endswith(".weight") and tensor.ndim == 2:
            stem = "diffusion_model." + key[:-len(".weight")]
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
    return lora


def anon_rss(pid: int) -> int:
    """Anonymous resident memory: what the process holds itself. (Plain RSS also counts the file pages of
    libtorch and friends, which the kernel drops and reloads as other processes need memory.)"""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


def settled_rss(pid: int, stable_polls: int = 8, polls: int = 80) -> int:
    """Anonymous RSS once it has not moved for ``stable_polls`` readings (/free runs on the server's own thread)."""
    last, stable = anon_rss(pid), 0
    for _ in range(polls):
        time.sleep(0.25)
        now = anon_rss(pid)
        stable = stable + 1 if abs(now - last) < 2**20 else 0
        last = now
        if stable >= stable_polls:
            break
    return last


def rss_at_most(pid: int, limit: int, polls: int = 80) -> int:
    """Anonymous RSS as soon as it is <= ``limit`` (the unload has happened), else the last reading."""
    now = anon_rss(pid)
    for _ in range(polls):
        if now <= limit:
            break
        time.sleep(0.25)
        now = anon_rss(pid)
    return now


def one_step_prompt(lora=None, **kwargs):
    prompt = tiny_prompt(**kwargs)
    prompt["6"]["inputs"]["steps"] = 1  # RAM does not depend on the step count; time does
    if lora is not None:  # UNETLoader -> LoraLoaderModelOnly -> the rest
        prompt["12"] = {"class_type": "LoraLoaderModelOnly",
                        "inputs": {"model": ["1", 0], "lora_name": lora, "strength_model": 0.8}}
        consumer = "10" if "10" in prompt else "5"
        prompt[consumer]["inputs"]["model"] = ["12", 0]
    return prompt


def unload_everything(server) -> None:
    """POST /free, then a prompt without a model: the server applies /free after a prompt at the latest."""
    server.free_memory()
    server.run_prompt({
        "1": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 16, "height": 16, "length": 1, "batch_size": 1}},
        "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "rss/none"}}})


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
