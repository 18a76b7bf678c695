"""What a run tells the timing model (residency_policy auto with a card known): the model's own weight format and
its LoRA on the device, not a bf16 model's figures whatever it loaded. Output bitwise against ComfyUI alone."""

import pytest
import torch

import comfy.model_management as mm
import comfy.sd

from layerwise_offload.devtools import quantized_models, tiny_dits
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.offload import TIMING_GPU_ENV, block_parameters, weight_nbytes
from layerwise_offload.offload.timing import choice, costs as gpu_costs
from layerwise_offload.tests.device_lora_setup import random_lora


@pytest.fixture
def costs_seen(monkeypatch):
    """Every ModelCosts the run planner hands the plan choice, on the loopback planning as an RTX 4090 would."""
    monkeypatch.setenv("LAYERWISE_OFFLOAD_CPU_LOOPBACK", "1")
    monkeypatch.setenv(TIMING_GPU_ENV, "RTX 4090 24GB")
    seen = []
    choose = choice.choose_plan

    def recording(costs, gpu, candidates):
        seen.append(costs)
        return choose(costs, gpu, candidates)
    monkeypatch.setattr(choice, "choose_plan", recording)
    yield seen
    mm.unload_all_models()


def test_a_lora_on_the_device_is_costed_per_block(costs_seen):
    lora = random_lora(tiny_dits.build_wan21(), rank=2)
    want = tiny_dits.sample(comfy.sd.load_lora_for_models(tiny_dits.build_wan21(), None, lora, 0.8, 0)[0])
    mm.unload_all_models()
    patcher = offload_model(comfy.sd.load_lora_for_models(tiny_dits.build_wan21(), None, lora, 0.8, 0)[0], 1, 1)
    assert torch.equal(tiny_dits.sample(patcher), want)
    costs = costs_seen[-1]
    blocks = patcher.attachments["layerwise_offload"].discovered.blocks
    patched = [sum(p.numel() for _, p in block_parameters(b) if p.ndim == 2) for b in blocks]
    assert costs.lora_bytes == tuple(gpu_costs.LORA_BYTES_PER_WEIGHT * n for n in patched)
    assert costs.host_s_per_streamed_block == gpu_costs.HOST_S_PER_STREAMED_BLOCK
    assert costs.cast_bytes is None  # float32 weights compute as they are


@pytest.mark.parametrize("stored", ["fp8", "quantized"])
def test_narrow_weights_are_costed_as_stored_with_their_casts(costs_seen, tmp_path, stored):
    """fp8 e4m3fn through UNETLoader's weight_dtype (plain fp8 tensors), and ComfyUI's fp8 mixed-precision file
    (QuantizedTensor weights)."""
    if stored == "fp8":
        path, options = tiny_dits.save_tiny_wan21(tmp_path / "wan.safetensors"), {"dtype": torch.float8_e4m3fn}
    else:
        path, options = quantized_models.save_tiny_wan21_fp8_mixed(tmp_path / "wan_fp8.safetensors"), {}
    want = tiny_dits.sample(comfy.sd.load_diffusion_model(str(path), model_options=dict(options)))
    mm.unload_all_models()
    patcher = offload_model(comfy.sd.load_diffusion_model(str(path), model_options=dict(options)), 1, 1)
    assert torch.equal(tiny_dits.sample(patcher), want)
    costs = costs_seen[-1]
    assert costs.host_s_per_streamed_block == gpu_costs.HOST_S_PER_STREAMED_BLOCK_BY_FORMAT[stored]
    assert costs.lora_bytes is None
    blocks = patcher.attachments["layerwise_offload"].discovered.blocks
    compute = max(2, patcher.model.manual_cast_dtype.itemsize)
    narrow = [[p for _, p in block_parameters(b) if p.dtype == torch.float8_e4m3fn or type(p) is not torch.nn.Parameter
               and type(p.data) is not torch.Tensor] for b in blocks]
    assert all(narrow)
    assert costs.cast_bytes == tuple(sum(weight_nbytes(p) + p.numel() * compute for p in ps) for ps in narrow)
