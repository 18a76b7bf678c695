"""The shipped demo/install_tiny_demo.py, the one step a user runs before the tiny demo template: the files it
writes without any ComfyUI code are, tensor for tensor, the tiny models built from this ComfyUI's own classes;
ComfyUI's loaders detect them; this ComfyUI's *Load Training Dataset* lists and loads the saved conditioning from
where the script puts it for this ComfyUI (output/ on 0.3.75 and 0.14.1, datasets/ on 0.33.0, both where the
folder holds no ComfyUI code); and it finds the ComfyUI to write into from where the pack is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerwise_offload.devtools import comfy_env, e2e_assets, tiny_dits

demo = e2e_assets.demo
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "demo" / "install_tiny_demo.py"


@pytest.fixture(scope="module")
def written(tmp_path_factory, comfy):
    d = tmp_path_factory.mktemp("demo_files")
    return d, demo.install(d / "models", d / "output", datasets_dir=d / "datasets")


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
    d, paths = written
    assert (paths["cond"], paths["cond_dataset"]) == (str(d / "output" / demo.COND_FOLDER),
                                                      str(d / "datasets" / demo.COND_FOLDER))
    for key in ("cond", "cond_dataset"):
        shard = torch.load(Path(paths[key]) / "shard_00000.pkl", weights_only=True)
        (ctx, extra), = shard["conditioning"][0]
        assert ctx.shape == (1, demo.COND_TOKENS, 4096) and extra == {}
        assert torch.equal(ctx, demo.conditioning()["conditioning"][0][0][0])
        # What Save Training Dataset writes beside its shards (0.33.0 lists a datasets/ folder only with it).
        assert json.loads((Path(paths[key]) / "metadata.json").read_text()) == {
            "num_samples": 1, "num_shards": 1, "shard_size": 1000}


def test_this_comfyuis_load_training_dataset_lists_and_loads_the_conditioning(written, comfy, monkeypatch):
    """The script's reading of this ComfyUI's code (where its Load Training Dataset looks) is right: with only
    that place written, the real node offers the folder (0.33.0: a combo of datasets/ folders; older: any
    string) and loads the conditioning from it."""
    import folder_paths
    from comfy_extras import nodes_dataset

    d, _ = written
    places = demo.cond_places(comfy_env.comfyui_path())
    assert len(places) == 1, places  # a real ComfyUI checkout: one place, read from its code
    tmp = d / f"only_{places[0]}"
    paths = demo.install(d / "models", tmp / "output" if places == ("output",) else None,
                         datasets_dir=tmp / "datasets" if places == ("datasets",) else None)
    assert set(paths) == {"wan21", "vae", "cond" if places == ("output",) else "cond_dataset"}
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp / "output"))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "datasets", ([str(tmp / "datasets")], set()))
    node = nodes_dataset.LoadTrainingDataset
    typ, opts = node.INPUT_TYPES()["required"]["folder_name"]
    if typ == "COMBO" or isinstance(typ, list):
        assert demo.COND_FOLDER in (typ if isinstance(typ, list) else opts["options"]), (typ, opts)
    else:
        assert typ == "STRING", typ
    out = node.execute(demo.COND_FOLDER)
    latents, conds = out.args
    (ctx, extra), = conds[0]
    assert len(latents) == 1 and torch.equal(ctx, demo.conditioning()["conditioning"][0][0][0])


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
    # No ComfyUI code here says where Load Training Dataset looks: both places get the conditioning.
    for parent in ("output", "datasets"):
        for name in ("shard_00000.pkl", "metadata.json"):
            assert (root / parent / demo.COND_FOLDER / name).is_file(), (parent, name)
    assert "Templates > Extensions > layerwise-offload" in r.stdout


@pytest.mark.parametrize("reads", ["output", "datasets"])
def test_script_writes_the_conditioning_where_that_comfyuis_node_reads_it(tmp_path, reads):
    """A ComfyUI checkout whose Load Training Dataset reads output/ (0.3.75, 0.14.1) or datasets/ (0.33.0): the
    conditioning goes only there; a folder named with --output-dir / --datasets-dir is written as well."""
    comfy_root = comfy_env.comfyui_path()
    source = (comfy_root / "comfy_extras" / "nodes_dataset.py").read_text(encoding="utf-8")
    if demo.cond_places(comfy_root) != (reads,):
        pytest.skip(f"this ComfyUI ({comfy_root.name}) reads {demo.cond_places(comfy_root)}")
    root = tmp_path / "ComfyUI"
    pack = _fake_pack(root)
    (root / "main.py").write_text("")
    (root / "comfy_extras").mkdir()
    (root / "comfy_extras" / "nodes_dataset.py").write_text(source, encoding="utf-8")
    r = _run(pack, env={**os.environ, "PWD": str(pack)})
    assert r.returncode == 0, r.stderr[-3000:]
    other = "datasets" if reads == "output" else "output"
    assert (root / reads / demo.COND_FOLDER / "shard_00000.pkl").is_file()
    assert not (root / other).exists(), sorted(p.name for p in root.iterdir())
    flag = f"--{other}-dir"
    r = _run(pack, flag, str(tmp_path / "mine"), env={**os.environ, "PWD": str(pack)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "mine" / demo.COND_FOLDER / "metadata.json").is_file()
    assert (root / reads / demo.COND_FOLDER / "shard_00000.pkl").is_file() and not (root / other).exists()


@pytest.mark.parametrize("reads", ["output", "datasets"])
def test_where_each_comfyuis_node_reads_is_told_from_its_code(tmp_path, reads):
    """The two forms of Load Training Dataset, as ComfyUI 0.3.75 and 0.33.0 write them (their execute's first
    lines), and a nodes_dataset.py without the node (both places)."""
    body = {"output": "dataset_dir = os.path.join(folder_paths.get_output_directory(), folder_name)",
            "datasets": "dataset_dir = get_dataset_dir(folder_name)"}[reads]
    (tmp_path / "comfy_extras").mkdir()
    src = tmp_path / "comfy_extras" / "nodes_dataset.py"
    src.write_text("class LoadTrainingDataset(io.ComfyNode):\n    @classmethod\n    def execute(cls, folder_name):\n"
                   f"        {body}\n\n\nclass DatasetExtension(ComfyExtension):\n    pass\n")
    assert demo.cond_places(tmp_path) == (reads,)
    src.write_text("class SaveTrainingDataset:\n    pass\n")
    assert demo.cond_places(tmp_path) == ("output", "datasets")


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
