"""GGUF through the real server: ComfyUI-GGUF (unmodified, from shared/peers) installed next to this pack.

``UnetLoaderGGUF -> LayerwiseOffload -> KSampler`` saves the same latent, bitwise, as ``UnetLoaderGGUF ->
KSampler`` for F16 and Q4_0 blocks, with and without ``LoraLoaderModelOnly`` in front. The server is
this module's own (another custom node pack in custom_nodes); skipped where shared/peers or gguf is missing.
"""

from __future__ import annotations

import re

import pytest
import safetensors.torch
import torch

from layerwise_offload.devtools import e2e_assets, peers
from layerwise_offload.devtools.quantized_models import save_tiny_wan21_gguf
from layerwise_offload.devtools.server import ComfyServer, prepare_base_dir

pytest.importorskip("gguf", reason="the gguf package (a dev package of scripts/setup_env.sh) is not installed")
if peers.peer_tarball() is None:
    pytest.skip(f"no shared/peers/{peers.GGUF_TARBALL} beside the repository (set LAYERWISE_OFFLOAD_SHARED)",
                allow_module_level=True)

LORA = "tiny_wan21_gguf_lora.safetensors"
SEED = 42


def write_lora(path, seed=5, blocks=4):
    """Rank-2 LoRA on two linears of every tiny Wan block (dim 256, ffn 512), ComfyUI's generic key format."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for index in range(blocks):
        for name, (out_features, in_features) in (("self_attn.o", (256, 256)), ("ffn.0", (512, 256))):
            stem = f"diffusion_model.blocks.{index}.{name}"
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(out_features, 2, generator=gen)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(2, in_features, generator=gen)
    safetensors.torch.save_file(lora, str(path))


# Every type is compared in-process (tests/comfy/test_quantized_gguf.py); through the server a quantized type and
# the float one.
SERVER_TYPES = ("Q4_0", "F16")


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory, tiny_assets):
    base = prepare_base_dir(tmp_path_factory.mktemp("comfy_gguf_base"))
    peers.unpack_peer(base / "custom_nodes")
    for qtype in SERVER_TYPES:
        save_tiny_wan21_gguf(base / "models" / "diffusion_models" / f"tiny_wan21_{qtype}.gguf", qtype, seed=0)
    (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
    write_lora(base / "models" / "loras" / LORA)
    e2e_assets.copy_cond(tiny_assets, base)
    server = ComfyServer(base, cpu=True, env={"LAYERWISE_OFFLOAD_CPU_LOOPBACK": "1"},
                         extra_args=["--disable-api-nodes"])
    server.start(timeout=240)
    try:
        yield server
    finally:
        server.stop()


def gguf_prompt(qtype, offload, lora, prefix):
    p = e2e_assets.tiny_wan_prompt(
        {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": f"tiny_wan21_{qtype}.gguf"}},
        {"class_type": "ModelSamplingSD3", "inputs": {"shift": 8.0}}, seed=SEED, steps=3, prefix=prefix)
    model = ["1", 0]
    if lora:
        p["8"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": model, "lora_name": LORA,
                                                                   "strength_model": 1.0}}
        model = ["8", 0]
    if offload:
        p["10"] = {"class_type": "LayerwiseOffload", "inputs": {
            "model": model, "resident_layers": 1, "prefetch_size": 1, "residency_policy": "strided",
            "pin_memory": True}}
        model = ["10", 0]
    p["5"]["inputs"]["model"] = model
    return p


def latent(server, entry):
    files = server.output_files(entry, "latents")
    assert len(files) == 1, entry.get("outputs")
    return safetensors.torch.load_file(str(files[0]))["latent_tensor"]


@pytest.mark.parametrize("qtype", SERVER_TYPES)
def test_gguf_with_offload_equals_gguf_without(gguf_server, qtype):
    results = {}
    log_before = len(gguf_server.log_text())
    for lora in (False, True):
        for offload in (False, True):
            prefix = f"gguf/{qtype}_{'lora' if lora else 'plain'}_{'offload' if offload else 'ref'}"
            results[lora, offload] = latent(gguf_server, gguf_server.run_prompt(gguf_prompt(qtype, offload, lora,
                                                                                            prefix)))
    assert torch.equal(results[False, True], results[False, False])
    assert torch.equal(results[True, True], results[True, False])
    assert not torch.equal(results[True, False], results[False, False])  # the LoRA matters
    log = gguf_server.log_text()[log_before:]
    assert len(re.findall(r"\[layerwise-offload\] run: ", log)) == 2, log[-3000:]  # the manager really ran
    imported = [line for line in gguf_server.log_text().splitlines() if line.rstrip().endswith("custom_nodes/"
                                                                                            + peers.GGUF_FOLDER)]
    assert imported and all("IMPORT FAILED" not in line for line in imported), imported
