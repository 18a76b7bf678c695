"""The shipped demo/install_tiny_demo.py, the one step a user runs before the tiny demo template: the files it
writes without any ComfyUI code are, tensor for tensor, the tiny models built from this ComfyUI's own classes;
ComfyUI's loaders detect them; and it finds the ComfyUI to write into from where the pack is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerwise_offload.devtools import e2e_assets, tiny_dits

demo = e2e_assets.demo
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "demo" / "install_tiny_demo.py"


@pytest.fixture(scope="module")
def written(tmp_path_factory, comfy):
    d = tmp_path_factory.mktemp("demo_files")
    return d, demo.install(d / "models", d / "output")


def test_tensor_list_is_this_comfyuis(comfy):
    listed = json.loads(demo.TENSORS_FILE.read_text(encoding="utf-8"))["tensors"]
    assert listed == e2e_assets.comfyui_tensor_specs(), "python -P devtools/e2e_assets.py --write-tensors"


def test_files_hold_the_models_built_from_comfyuis_classes(written):
    import safetensors.torch

    _, paths = written
    for kind, ref in (("wan21", tiny_dits.build_wan21(seed=0).model.diffusion_model.state_dict()),
                      ("vae", e2e_assets.build_tiny_wan21_vae(seed=0).state_dict())):
        got = safetensors.torch.load_file(paths[kind])
        assert sorted(got) == sorted(ref), kind
        unequal = [k for k in ref if not torch.equal(got[k], ref[k])]
        assert not unequal, (kind, unequal[:5])


def test_comfyuis_loaders_detect_the_files(written, comfy):
    _, paths = written
    patcher = comfy.sd.load_diffusion_model(paths["wan21"])
    assert type(patcher.model).__name__ == "WAN21" and len(patcher.model.diffusion_model.blocks) == 4
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(paths["vae"]))
    assert type(vae.first_stage_model).__name__ == "WanVAE" and vae.latent_channels == 16


def test_conditioning_shard_is_what_load_training_dataset_reads(written):
    _, paths = written
    shard = torch.load(Path(paths["cond"]) / "shard_00000.pkl", weights_only=True)
    (ctx, extra), = shard["conditioning"][0]
    assert ctx.shape == (1, demo.COND_TOKENS, 4096) and extra == {}
    assert torch.equal(ctx, demo.conditioning()["conditioning"][0][0][0])


def test_current_files_are_kept_and_stale_ones_rewritten(written):
    d, paths = written
    wan = Path(paths["wan21"])
    before = wan.stat().st_mtime_ns
    demo.install(d / "models", d / "output")
    assert wan.stat().st_mtime_ns == before
    vae = Path(paths["vae"])
    vae.write_bytes(b"not a safetensors file")
    demo.install(d / "models", d / "output")
    assert vae.stat().st_size > 1_000_000


def _run(cwd: Path, *args: str, env=None):
    return subprocess.run([sys.executable, str(cwd / "demo" / "install_tiny_demo.py"), *args], cwd=str(cwd),
                          capture_output=True, text=True, timeout=300, env=env)


def _fake_pack(root: Path) -> Path:
    pack = root / "custom_nodes" / "layerwise-offload"
    (pack / "demo").mkdir(parents=True)
    for f in (SCRIPT, demo.TENSORS_FILE):
        (pack / "demo" / f.name).write_bytes(f.read_bytes())
    return pack


@pytest.mark.parametrize("layout", ["checkout", "base_directory"])
def test_script_finds_the_comfyui_it_is_installed_in(tmp_path, layout):
    root = tmp_path / "ComfyUI"
    pack = _fake_pack(root)
    if layout == "checkout":
        (root / "main.py").write_text("")  # a ComfyUI folder: no models/ yet
    else:
        (root / "models").mkdir()  # a --base-directory (ComfyUI Desktop): models/, no code
    r = _run(pack)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (root / "models" / "diffusion_models" / demo.WAN21_FILE).is_file()
    assert (root / "models" / "vae" / demo.VAE_FILE).is_file()
    assert (root / "output" / demo.COND_FOLDER / "shard_00000.pkl").is_file()
    assert "Templates > Extensions > layerwise-offload" in r.stdout


def test_script_follows_a_linked_pack_from_the_shell_folder(tmp_path):
    real = tmp_path / "src" / "layerwise-offload"
    (real / "demo").mkdir(parents=True)
    for f in (SCRIPT, demo.TENSORS_FILE):
        (real / "demo" / f.name).write_bytes(f.read_bytes())
    root = tmp_path / "ComfyUI"
    (root / "custom_nodes").mkdir(parents=True)
    (root / "main.py").write_text("")
    link = root / "custom_nodes" / "layerwise-offload"
    link.symlink_to(real, target_is_directory=True)
    r = _run(link, env={**os.environ, "PWD": str(link)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (root / "models" / "diffusion_models" / demo.WAN21_FILE).is_file()


def test_script_outside_custom_nodes_says_what_to_pass(tmp_path):
    pack = tmp_path / "somewhere" / "layerwise-offload"
    (pack / "demo").mkdir(parents=True)
    for f in (SCRIPT, demo.TENSORS_FILE):
        (pack / "demo" / f.name).write_bytes(f.read_bytes())
    r = _run(pack, env={**os.environ, "PWD": str(pack)})
    assert r.returncode == 1
    assert "[layerwise-offload] ERROR" in r.stderr and str(pack) in r.stderr and "--comfyui" in r.stderr
    r = _run(pack, "--comfyui", str(tmp_path / "mine"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "mine" / "models" / "vae" / demo.VAE_FILE).is_file()
