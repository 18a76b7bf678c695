"""The LayerwiseOffload node inside the real ComfyUI (in-process, CPU loopback).

Every output is compared bitwise with the same sampling without the node.
"""

import pytest
import torch

import comfy.model_management as mm
import comfy.sd

from layerwise_offload.devtools import tiny_dits
from layerwise_offload.devtools.tiny_unet import build_tiny_sd15
from layerwise_offload.nodes.discovery import UnsupportedModelError
from layerwise_offload.nodes.controller import offload_model
from layerwise_offload.nodes.offload_node import CPU_LOOPBACK_ENV
from layerwise_offload.nodes.patcher import LayerwiseOffloadPatcherMixin


pytestmark = pytest.mark.usefixtures("comfy_loopback")


def manager_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT].manager


def controller_of(patcher):
    return patcher.attachments[LayerwiseOffloadPatcherMixin.ATTACHMENT]


_BASELINES = {}


def baseline(family, seed=3):
    """Output without offload (a fresh model, so no state leaks between cases)."""
    if (family, seed) not in _BASELINES:
        _BASELINES[family, seed] = tiny_dits.sample(tiny_dits.build_tiny(family), seed=seed)
        mm.unload_all_models()
    return _BASELINES[family, seed]


PLANS = [(0, 1, "leading"), (1, 2, "strided"), (2, 1, "leading"), (99, 1, "leading")]


@pytest.mark.parametrize("family", sorted(tiny_dits.TINY_FAMILIES))
def test_bitwise_identical_for_every_family(family):
    want = baseline(family)
    model = tiny_dits.build_tiny(family)
    num_blocks = tiny_dits.TINY_FAMILIES[family].num_blocks
    for resident, prefetch, policy in PLANS:
        offloaded = offload_model(model, resident, prefetch, policy, True)
        assert torch.equal(tiny_dits.sample(offloaded, seed=3), want), (resident, prefetch, policy)
        stats = manager_of(offloaded).stats()
        streamed = num_blocks - min(resident, num_blocks)
        assert stats.streamed_blocks == streamed
        # The manager really streamed, every forward (streamed blocks that fit in the slots stay there).
        assert stats.copies_last_forward == (streamed if streamed > prefetch else 0)
        assert stats.peak_materialized_blocks <= min(resident, num_blocks) + prefetch + 1
        mm.unload_all_models()


@pytest.mark.parametrize("policy", ["leading", "strided"])
@pytest.mark.parametrize("resident", range(5))
def test_every_resident_count_on_wan(resident, policy):
    want = baseline("wan21")
    offloaded = offload_model(tiny_dits.build_tiny("wan21"), resident, 1, policy, True)
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)


def test_input_model_and_other_branches_are_untouched():
    model = tiny_dits.build_tiny("wan21")
    offloaded = offload_model(model, 2, 1, "leading", True)
    assert offloaded is not model and type(model).__name__ == "ModelPatcher"
    assert LayerwiseOffloadPatcherMixin.ATTACHMENT not in model.attachments
    assert tiny_dits.sample(offloaded, seed=3).shape == baseline("wan21").shape
    # The un-offloaded branch of the same loaded model runs right after, and right.
    assert torch.equal(tiny_dits.sample(model, seed=3), baseline("wan21"))
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), baseline("wan21"))


def test_residents_survive_prompts_and_go_with_unload_all_models():
    model = offload_model(tiny_dits.build_tiny("wan21"), 2, 1, "leading", True)
    manager = manager_of(model)
    tiny_dits.sample(model, seed=3)
    assert manager.materialized_blocks()[:2] == [0, 1]
    copies_after_first = list(manager.engine.counters.copies_per_block)
    assert torch.equal(tiny_dits.sample(model, seed=3), baseline("wan21"))
    assert manager.engine.counters.copies_per_block[:2] == copies_after_first[:2]  # residents never copied again
    assert manager.engine.counters.copies_per_block[2] > copies_after_first[2]
    assert manager.prepare() == []  # ComfyUI moved no block weight behind the manager's back
    assert manager.device_bytes() > 0
    mm.unload_all_models()
    assert manager.device_bytes() == 0
    assert manager.materialized_blocks() == []
    assert not manager.engine.hooks.installed
    assert torch.equal(tiny_dits.sample(model, seed=3), baseline("wan21"))


def test_comfyui_sees_true_sizes():
    model = offload_model(tiny_dits.build_tiny("flux"), 2, 1, "leading", True)
    controller = controller_of(model)
    manager = controller.manager
    total = comfy.model_management.module_size(model.model)
    sizes = manager.block_nbytes()
    planned = controller.non_block_bytes() + sum(sizes[:2]) + 2 * max(sizes[2:])
    assert model.model_size() == planned < total
    tiny_dits.sample(model, seed=3)
    loaded = [m for m in mm.current_loaded_models if m.model is model]
    assert loaded, "ComfyUI keeps the offloaded model listed as loaded"
    assert model.loaded_size() == controller.non_block_bytes() + manager.device_bytes()
    assert manager.device_bytes() == manager.device_bytes(manager.config)
    assert model.model.model_lowvram


def test_partially_unload_demotes_residents_and_returns_the_device_memory():
    model = offload_model(tiny_dits.build_tiny("wan21"), 3, 1, "leading", True)
    tiny_dits.sample(model, seed=3)
    manager = manager_of(model)
    block = manager.block_nbytes()[0]
    held = manager.device_bytes()
    assert held == 4 * block  # 3 residents + 1 slot (one streamed block needs no second slot)
    copies_of_block_0 = manager.engine.counters.copies_per_block[0]
    # 2 residents would need 2 slots (4 blocks, nothing saved); 1 resident + 2 slots saves one block. The resident
    # that stays keeps its buffer; the leaving two and the one-slot ring (the plan needs two slots) are freed now.
    assert model.partially_unload(model.offload_device, block) == 3 * block
    assert manager.device_bytes() == block and manager.materialized_blocks() == [0]
    assert controller_of(model).resident_cap == 1
    assert model.model_size() == controller_of(model).non_block_bytes() + 3 * block
    assert model.loaded_size() == controller_of(model).non_block_bytes() + block
    assert torch.equal(tiny_dits.sample(model, seed=3), baseline("wan21"))
    # ComfyUI's next load allowed the whole plan again: blocks 1 and 2 came back, block 0 was never copied again.
    assert manager.engine.counters.copies_per_block[0] == copies_of_block_0
    assert manager.device_bytes() == held


def test_comfyui_load_budget_caps_the_residents():
    model = offload_model(tiny_dits.build_tiny("wan21"), 4, 1, "leading", True)
    controller = controller_of(model)
    block = controller.manager.block_nbytes()[0]
    non_block = controller.non_block_bytes()
    model.partially_load(model.load_device, extra_memory=non_block + 3 * block)  # 1 resident + 2 slots
    assert controller.resident_cap == 1
    assert model.model_size() == controller.non_block_bytes() + 3 * block
    model.partially_load(model.load_device, extra_memory=1e32)  # "no limit": the asked-for plan again
    assert controller.resident_cap is None
    assert model.model_size() == controller.non_block_bytes() + 4 * block


def test_two_offloaded_models_alternate_like_wan22():
    high = offload_model(tiny_dits.build_tiny("wan21", seed=1), 2, 1, "leading", True)
    low = offload_model(tiny_dits.build_tiny("wan21", seed=2), 1, 2, "strided", True)
    want_high = tiny_dits.sample(tiny_dits.build_tiny("wan21", seed=1), seed=3)
    want_low = tiny_dits.sample(tiny_dits.build_tiny("wan21", seed=2), seed=3)
    mm.unload_all_models()
    held = []
    for _ in range(3):
        assert torch.equal(tiny_dits.sample(high, seed=3), want_high)
        assert torch.equal(tiny_dits.sample(low, seed=3), want_low)
        held.append(manager_of(high).device_bytes() + manager_of(low).device_bytes())
    assert held[0] == held[1] == held[2]
    assert held[0] == manager_of(high).device_bytes(manager_of(high).config) + manager_of(low).device_bytes(manager_of(low).config)


def random_lora(patcher, seed, rank=2, include_non_block=True):
    """A LoRA in the generic ``<key>.lora_up.weight`` format over every Linear weight of the blocks."""
    generator = torch.Generator().manual_seed(seed)
    lora = {}
    for key, tensor in patcher.model.state_dict().items():
        if not key.endswith(".weight") or tensor.ndim != 2:
            continue
        if ".blocks." not in key and not (include_non_block and "text_embedding" in key):
            continue
        stem = key[:-len(".weight")]
        lora[f"{stem}.lora_up.weight"] = 0.05 * torch.randn(tensor.shape[0], rank, generator=generator)
        lora[f"{stem}.lora_down.weight"] = 0.05 * torch.randn(rank, tensor.shape[1], generator=generator)
    return lora


def with_lora(patcher, lora, strength):
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
    return patched


@pytest.mark.parametrize("order", ["lora_then_offload", "offload_then_lora"])
def test_lora_before_or_after_the_node(order):
    lora = random_lora(tiny_dits.build_tiny("wan21"), seed=7)
    want = tiny_dits.sample(with_lora(tiny_dits.build_tiny("wan21"), lora, 0.8), seed=3)
    mm.unload_all_models()
    assert not torch.equal(want, baseline("wan21"))
    model = tiny_dits.build_tiny("wan21")
    if order == "lora_then_offload":
        patched = offload_model(with_lora(model, lora, 0.8), 1, 1, "leading", True)
    else:
        patched = with_lora(offload_model(model, 1, 1, "leading", True), lora, 0.8)
    assert isinstance(patched, LayerwiseOffloadPatcherMixin)
    for _ in range(2):
        assert torch.equal(tiny_dits.sample(patched, seed=3), want)


def test_a_changed_lora_is_picked_up_on_the_next_prompt():
    lora = random_lora(tiny_dits.build_tiny("wan21"), seed=7)
    wants = {}
    for strength in (0.5, 1.0):
        wants[strength] = tiny_dits.sample(with_lora(tiny_dits.build_tiny("wan21"), lora, strength), seed=3)
        mm.unload_all_models()
    offloaded = offload_model(tiny_dits.build_tiny("wan21"), 2, 1, "leading", True)
    for strength in (0.5, 1.0, 0.5):
        assert torch.equal(tiny_dits.sample(with_lora(offloaded, lora, strength), seed=3), wants[strength])
    # And without any LoRA again: ComfyUI's backups restore the original weights.
    assert torch.equal(tiny_dits.sample(offloaded, seed=3), baseline("wan21"))


def test_a_unet_is_refused_with_its_class_name():
    with pytest.raises(UnsupportedModelError, match="UNetModel is not a supported diffusion transformer.*Flux"):
        offload_model(build_tiny_sd15(), 2, 1, "leading", True)


def test_cpu_without_loopback_passes_through(monkeypatch, caplog):
    monkeypatch.delenv(CPU_LOOPBACK_ENV)
    model = tiny_dits.build_tiny("wan21")
    with caplog.at_level("INFO", logger="layerwise_offload"):
        passed = offload_model(model, 2, 1, "leading", True)
    assert not isinstance(passed, LayerwiseOffloadPatcherMixin) and passed is not model
    assert any("passed through: ComfyUI runs on the CPU, nothing to offload" in r.getMessage() for r in caplog.records)


def test_bad_settings_raise_value_errors_naming_the_value():
    model = tiny_dits.build_tiny("wan21")
    with pytest.raises(ValueError, match="resident_layers must be >= 0, got -3"):
        offload_model(model, -3, 1, "leading", True)
    with pytest.raises(ValueError, match="prefetch_size must be an integer >= 1, got 0"):
        offload_model(model, 1, 0, "leading", True)
    with pytest.raises(ValueError, match="'sideways'"):
        offload_model(model, 1, 1, "sideways", True)


def test_everything_under_inference_mode_as_the_server_runs_it():
    """ComfyUI's executor loads models and samples inside torch.inference_mode."""
    with torch.inference_mode():
        lora = random_lora(tiny_dits.build_tiny("wan21"), seed=7)
        want = tiny_dits.sample(with_lora(tiny_dits.build_tiny("wan21"), lora, 0.8), seed=3)
        mm.unload_all_models()
        model = tiny_dits.build_tiny("wan21")
        offloaded = with_lora(offload_model(model, 2, 1, "strided", True), lora, 0.8)
        for _ in range(2):
            assert torch.equal(tiny_dits.sample(offloaded, seed=3), want)
        assert torch.equal(tiny_dits.sample(offload_model(model, 1, 2, "leading", True), seed=3),
                           tiny_dits.sample(tiny_dits.build_tiny("wan21"), seed=3))
    mm.unload_all_models()  # outside inference_mode, as the /free endpoint does
    assert manager_of(offloaded).device_bytes() == 0


def test_a_dropped_output_gives_its_device_memory_back():
    """ComfyUI re-points a loaded model at the parent patcher when the loaded clone is garbage collected
    (a changed node input drops the old output); the manager must not keep device memory past that."""
    import gc
    model = tiny_dits.build_tiny("wan21")
    offloaded = offload_model(model, 3, 1, "leading", True)
    manager = manager_of(offloaded)
    tiny_dits.sample(offloaded, seed=3)
    assert manager.device_bytes() > 0
    del offloaded
    gc.collect()
    assert manager.device_bytes() == 0
    assert [loaded.model for loaded in mm.current_loaded_models] == [model]
    assert model.loaded_size() == controller_non_block_bytes(model)
    assert torch.equal(tiny_dits.sample(model, seed=3), baseline("wan21"))


def controller_non_block_bytes(model):
    blocks = {id(m) for b in model.model.diffusion_model.blocks for m in b.modules()}
    return sum(t.nelement() * t.element_size() for m in model.model.modules() if id(m) not in blocks
               for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None)
