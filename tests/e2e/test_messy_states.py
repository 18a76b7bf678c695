"""Issue 13 through the real ComfyUI server (CPU loopback): the states daily use leaves a model in.

Each graph's latent is compared bitwise with ComfyUI's own output for the same graph without the node, computed
right after the server dropped its cache and unloaded every model (a fresh reference).
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from layerwise_offload.devtools import e2e_assets, tiny_dits
from layerwise_offload.devtools.server import PromptRejected, execution_error

LORA_NAME = "layerwise_offload_tiny_wan21_lora.safetensors"
NODE = "LayerwiseOffload"
SEED = 42


def tiny_lora(seed=7, rank=2):
    """A generic-format LoRA (``<key>.lora_up.weight``) over the tiny Wan 2.1's block weights and text embedding."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for key, tensor in tiny_dits.build_tiny("wan21").model.state_dict().items():
        if key.endswith(".weight") and tensor.ndim == 2 and (".blocks." in key or "text_embedding" in key):
            stem = key[:-len(".weight")]
            lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
            lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
    return lora


@pytest.fixture(scope="module")
def lora_file(comfy_base):
    path = comfy_base / "models" / "loras" / LORA_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tiny_lora(), str(path))
    return LORA_NAME


def lora_prompt(strength, offload=None, prefix="e2e/messy", lora=LORA_NAME):
    """``UNETLoader -> LoraLoaderModelOnly(strength) [-> LayerwiseOffload(**offload)] -> KSampler -> SaveLatent``."""
    prompt = e2e_assets.tiny_wan_prompt(
        {"class_type": "UNETLoader", "inputs": {"unet_name": e2e_assets.TINY_WAN21_NAME, "weight_dtype": "default"}},
        {"class_type": "LoraLoaderModelOnly", "inputs": {"lora_name": lora, "strength_model": strength}},
        seed=SEED, steps=4, prefix=prefix)
    if offload is not None:
        inputs = {"resident_layers": 2, "prefetch_size": 1, "residency_policy": "leading", "pin_memory": True}
        inputs.update(offload)
        prompt["10"] = {"class_type": NODE, "inputs": {"model": ["5", 0], **inputs}}
        prompt["6"]["inputs"]["model"] = ["10", 0]
    return prompt


def latent_of(server, prompt):
    files = server.output_files(server.run_prompt(prompt), "latents")
    assert len(files) == 1
    return safetensors.torch.load_file(str(files[0]))["latent_tensor"]


def start_fresh(server):
    """Unload every model and drop ComfyUI's cache, as the UI's "Unload models" button does.

    The server acts on that request after its current prompt; two small prompts queued behind it make sure it did.
    """
    server.free_memory()
    for n in range(2):
        server.run_prompt({"1": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
                           "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0],
                                                                         "filename_prefix": f"e2e/fresh{n}"}}})


@pytest.fixture(scope="module")
def references(comfy_server, lora_file):
    refs = {}
    for strength in (0.5, 0.8):
        start_fresh(comfy_server)
        refs[strength] = latent_of(comfy_server, lora_prompt(strength, prefix=f"e2e/messy_ref{strength}"))
    assert not torch.equal(refs[0.5], refs[0.8])
    return refs


def test_plain_prompt_after_an_offloaded_prompt_with_a_lora(comfy_server, references):
    """Issue 13 item 2, as reported: the same graph without the node, right after the graph with it."""
    start_fresh(comfy_server)
    assert torch.equal(latent_of(comfy_server, lora_prompt(0.8, offload={})), references[0.8])
    assert torch.equal(latent_of(comfy_server, lora_prompt(0.8)), references[0.8])


def test_lora_strength_changed_between_offloaded_and_plain_prompts(comfy_server, references):
    start_fresh(comfy_server)
    for strength, offload in [(0.8, {}), (0.5, None), (0.5, {"resident_layers": 0}), (0.8, None)]:
        got = latent_of(comfy_server, lora_prompt(strength, offload=offload))
        assert torch.equal(got, references[strength]), (strength, offload)


def test_offloaded_and_plain_branches_of_one_lora_model_in_one_prompt(comfy_server, references):
    """'Every other branch': one LoRA'd MODEL feeds a sampler through the node and one without it."""
    start_fresh(comfy_server)
    prompt = lora_prompt(0.8, offload={}, prefix="e2e/messy_offloaded_branch")
    plain = lora_prompt(0.8, prefix="e2e/messy_plain_branch")
    prompt["16"] = dict(plain["6"], inputs=dict(plain["6"]["inputs"], model=["5", 0]))
    prompt["17"] = {"class_type": "SaveLatent", "inputs": {"samples": ["16", 0], "filename_prefix": "e2e/messy_plain_branch"}}
    entry = comfy_server.run_prompt(prompt)
    for node in ("7", "17"):
        files = comfy_server.output_files({"outputs": {node: entry["outputs"][node]}}, "latents")
        latent = safetensors.torch.load_file(str(files[0]))["latent_tensor"]
        assert torch.equal(latent, references[0.8]), node


def test_a_wrong_residency_policy_is_rejected_when_queued(comfy_server, lora_file):
    """Issue 13 item 6: a validation error naming the input, not an execution error after loading the model."""
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue_prompt(lora_prompt(0.8, offload={"residency_policy": "sideways"}))
    errors = rejected.value.body["node_errors"]["10"]["errors"]
    assert any(e["extra_info"].get("input_name") == "residency_policy" and "sideways" in json.dumps(e)
               for e in errors), errors


def hooked_lora_prompt(offload, prefix):
    """The plain graph (no LoRA loader) with Create Hook LoRA (MO) set on the positive conditioning."""
    prompt = lora_prompt(0.8, offload=offload, prefix=prefix)
    del prompt["5"]
    prompt["10" if offload is not None else "6"]["inputs"]["model"] = ["1", 0]
    prompt["20"] = {"class_type": "CreateHookLoraModelOnly", "inputs": {"lora_name": LORA_NAME, "strength_model": 0.8}}
    prompt["21"] = {"class_type": "ConditioningSetProperties", "inputs": {
        "cond_NEW": ["2", 1], "strength": 1.0, "set_cond_area": "default", "hooks": ["20", 0]}}
    prompt["6"]["inputs"]["positive"] = ["21", 0]
    return prompt


def test_a_hooked_lora_is_refused_with_an_error_and_the_server_runs_on(comfy_server, references):
    """Issue 13 item 4 through the server: never a silently wrong latent."""
    latent_of(comfy_server, hooked_lora_prompt(None, "e2e/messy_hooked_plain"))  # ComfyUI alone runs the hooks
    entry = comfy_server.run_prompt(hooked_lora_prompt({}, "e2e/messy_hooked_offloaded"), check=False)
    assert entry["status"]["status_str"] == "error"
    error = execution_error(entry)
    assert "weight hooks" in error["exception_message"] and "LoraLoaderModelOnly" in error["exception_message"], error
    assert torch.equal(latent_of(comfy_server, lora_prompt(0.8, offload={}, prefix="e2e/messy_after_hooks")),
                       references[0.8])
