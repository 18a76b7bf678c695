"""What the end-to-end tests share about a server's prompts and memory: the tiny Wan 2.1 prompt of the tiny demo
(and a one-step form of it, with a LoRA loader where asked), its saved latent, a LoRA over the blocks, the server's
anonymous RSS, and unloading everything a server holds."""

from __future__ import annotations

import time

import safetensors.torch
import torch

from layerwise_offload.devtools import e2e_assets

__all__ = ["NODE", "SEED", "anon_rss", "block_lora", "one_step_prompt", "saved_latent", "settled_rss", "tiny_prompt",
           "unload_everything"]

NODE = "LayerwiseOffload"
SEED = 42


def tiny_prompt(offload=None, seed=SEED, unet=e2e_assets.TINY_WAN21_NAME, prefix="e2e/tiny", decode=False):
    """API prompt mirroring the tiny demo workflow; ``offload`` is None (no node) or
    ``dict(resident_layers=..., prefetch_size=..., residency_policy=..., pin_memory=...)``."""
    p = e2e_assets.tiny_wan_prompt(
        {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        {"class_type": "ModelSamplingSD3", "inputs": {"shift": 8.0}}, seed=seed, steps=4, prefix=prefix)
    if offload is not None:
        full = {"resident_layers": 0, "prefetch_size": 1, "residency_policy": "leading", "pin_memory": True}
        full.update(offload)
        p["10"] = {"class_type": NODE, "inputs": {"model": ["1", 0], **full}}
        p["5"]["inputs"]["model"] = ["10", 0]
    if decode:
        p["8"] = {"class_type": "VAELoader", "inputs": {"vae_name": e2e_assets.TINY_WAN21_VAE_NAME}}
        p["9"] = {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["8", 0]}}
        p["11"] = {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}}
    return p


def saved_latent(server, entry) -> torch.Tensor:
    files = server.output_files(entry, "latents")
    assert len(files) == 1, entry.get("outputs")
    return safetensors.torch.load_file(str(files[0]))["latent_tensor"]


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
