"""The tiny DiTs of devtools/tiny_dits.py are real ComfyUI models, deterministic, and have the block lists that
docs/internals.md names ("Supported models"). Everything else in tests/comfy builds on these guarantees."""

from __future__ import annotations

import pytest
import torch

from layerwise_offload.devtools import tiny_dits

# docs/internals.md, "Supported models", written out independently of the registry under test.
DOCUMENTED_BLOCK_LISTS = {
    "wan21": ("blocks",),
    "flux": ("double_blocks", "single_blocks"),
    "qwen_image": ("transformer_blocks",),
    "hunyuan_video": ("double_blocks", "single_blocks"),
    "sd3": ("joint_blocks",),
    "lumina2": ("context_refiner", "noise_refiner", "layers"),
    "ltxv": ("transformer_blocks",),
}

FAMILIES = sorted(tiny_dits.TINY_FAMILIES)


@pytest.fixture(autouse=True)
def _unload_after(comfy):
    yield
    comfy.model_management.unload_all_models()


def test_registry_covers_design_families():
    assert set(FAMILIES) == set(DOCUMENTED_BLOCK_LISTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_lists_exist(comfy, family):
    fam = tiny_dits.TINY_FAMILIES[family]
    patcher = fam.build(seed=0)
    assert isinstance(patcher, comfy.model_patcher.ModelPatcher)
    assert type(patcher.model.model_config).__name__ == fam.comfy_config
    dm = patcher.get_model_object("diffusion_model")
    assert fam.block_lists == DOCUMENTED_BLOCK_LISTS[family]
    for attr, count in zip(fam.block_lists, fam.block_counts):
        blocks = getattr(dm, attr)
        assert isinstance(blocks, torch.nn.ModuleList), attr
        assert len(blocks) == count, attr
        assert count >= 2, "each list needs several blocks to test residency/streaming"
    assert [len(v) for v in tiny_dits.block_lists(patcher).values()] == list(fam.block_counts)
    # Weights live on ComfyUI's offload device (CPU here) in float32, as a loaded diffusion model would.
    p = next(dm.parameters())
    assert p.device.type == "cpu" and p.dtype == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_are_bitwise_equal_per_seed(family):
    build = tiny_dits.TINY_FAMILIES[family].build
    a = build(seed=0).model.diffusion_model.state_dict()
    b = build(seed=0).model.diffusion_model.state_dict()
    c = build(seed=1).model.diffusion_model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.isfinite(a[k]).all() for k in a if a[k].is_floating_point())
    assert not all(torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point() and a[k].numel() > 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_is_deterministic_and_finite(family):
    fam = tiny_dits.TINY_FAMILIES[family]
    out1 = tiny_dits.sample(fam.build(seed=0), seed=7, steps=4)
    out2 = tiny_dits.sample(fam.build(seed=0), seed=7, steps=4)
    assert tuple(out1.shape) == fam.latent_shape
    assert torch.isfinite(out1).all()
    assert torch.equal(out1, out2)
    # The model does something: another noise seed gives another output, and output is not the zero latent.
    out3 = tiny_dits.sample(fam.build(seed=0), seed=8, steps=4)
    assert not torch.equal(out1, out3)
    assert out1.abs().max() > 0


def test_tiny_wan21_file_is_detected_and_matches_in_process_build(comfy, tmp_path):
    path = tiny_dits.save_tiny_wan21(tmp_path / "tiny_wan21.safetensors", seed=0)
    loaded = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    assert loaded is not None
    assert type(loaded.model.model_config).__name__ == "WAN21_T2V"
    cfg = loaded.model.model_config.unet_config
    assert (cfg["dim"], cfg["num_heads"], cfg["num_layers"], cfg["ffn_dim"]) == (256, 2, 4, 512)
    assert len(loaded.get_model_object("diffusion_model").blocks) == 4

    built = tiny_dits.build_wan21(seed=0)
    sd_loaded = loaded.model.diffusion_model.state_dict()
    sd_built = built.model.diffusion_model.state_dict()
    assert sd_loaded.keys() == sd_built.keys()
    assert all(torch.equal(sd_loaded[k], sd_built[k]) for k in sd_built)

    a = tiny_dits.sample(loaded, seed=3, family="wan21")
    b = tiny_dits.sample(built, seed=3)
    assert torch.equal(a, b)


def test_sample_accepts_explicit_latent_and_conditioning():
    fam = tiny_dits.TINY_FAMILIES["flux"]
    pos, neg = tiny_dits.make_conditioning("flux", seed=1)
    assert pos[0][0].shape == (1, tiny_dits.TEXT_TOKENS, 64)
    assert pos[0][1]["pooled_output"].shape == (1, 32) and pos[0][1]["guidance"] == 3.5
    latent = torch.zeros(1, 16, 8, 8)
    out = tiny_dits.sample(fam.build(seed=0), latent, seed=2, steps=2, positive=pos, negative=neg, cfg=1.0)
    assert out.shape == latent.shape and torch.isfinite(out).all()
