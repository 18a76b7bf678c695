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
import textwrap
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


# ------------------------------------------------------------------------------------------------ layouts
# Each way a ComfyUI can be laid out, built in a temporary folder with the pack inside its custom_nodes; the script
# runs from the pack's folder as the README says; then ComfyUI's own path code (folder_paths, utils/extra_config and
# main.py's apply_custom_paths, run in a child process as that ComfyUI would be started) must find the files.

_COMFYUI_FINDS = textwrap.dedent("""
    import ast, itertools, json, logging, os, sys
    code, argv, wan, vae, cond = sys.argv[1], json.loads(sys.argv[2]), *sys.argv[3:6]
    sys.argv = ["main.py", *argv]
    import comfy.options
    comfy.options.enable_args_parsing()
    from comfy.cli_args import args
    import folder_paths, utils.extra_config
    # main.py's own apply_custom_paths (importing main.py would start the whole server set-up).
    tree = ast.parse(open(os.path.join(code, "main.py"), encoding="utf-8").read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_custom_paths")
    names = {"os": os, "itertools": itertools, "logging": logging, "utils": utils, "folder_paths": folder_paths,
             "args": args, "__file__": os.path.join(code, "main.py")}
    exec(compile(ast.Module([fn], []), "main.py", "exec"), names)
    names["apply_custom_paths"]()
    try:
        datasets = folder_paths.get_folder_paths("datasets")
    except KeyError:  # a ComfyUI without datasets/ (0.3.75)
        datasets = []
    print("RESULT " + json.dumps({
        "diffusion_models": folder_paths.get_full_path("diffusion_models", wan),
        "vae": folder_paths.get_full_path("vae", vae),
        "output": os.path.join(folder_paths.get_output_directory(), cond),
        "datasets": [os.path.join(d, cond) for d in datasets if os.path.isdir(os.path.join(d, cond))]}))
""")


def comfyui_finds(args) -> dict:
    """Where this ComfyUI, started with ``args`` (its --base-directory and the like), finds the demo's files."""
    code = comfy_env.comfyui_path()
    r = subprocess.run([sys.executable, "-c", _COMFYUI_FINDS, str(code), json.dumps([str(a) for a in args]),
                        demo.WAN21_FILE, demo.VAE_FILE, demo.COND_FOLDER], cwd=str(code), capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(code)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _comfyui_code(root: Path) -> None:
    """What the script looks at in a ComfyUI folder: main.py, and where its Load Training Dataset reads."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "main.py").write_text("")
    (root / "comfy_extras").mkdir(exist_ok=True)
    (root / "comfy_extras" / "nodes_dataset.py").write_bytes(
        (comfy_env.comfyui_path() / "comfy_extras" / "nodes_dataset.py").read_bytes())


def _yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _main_in_process(pack: Path, capsys, *args: str) -> subprocess.CompletedProcess:
    """The script's main as run from ``pack`` (in this process: torch is imported already)."""
    code = demo.main(list(args), pack=pack)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def _layout(name: str, tmp: Path):
    """``(pack folder, extra environment, the ComfyUI arguments that read this layout, where the models go)``."""
    home = tmp / "home"
    if name == "clone":  # git clone: code and models/ in one folder
        root = tmp / "ComfyUI"
        _comfyui_code(root)
        (root / "models" / "diffusion_models").mkdir(parents=True)
        return _fake_pack(root), {}, ["--base-directory", root], root / "models"
    if name == "windows_portable":  # ComfyUI_windows_portable\ComfyUI, python_embeded beside it
        top = tmp / "ComfyUI_windows_portable"
        (top / "python_embeded").mkdir(parents=True)
        (top / "run_nvidia_gpu.bat").write_text(r".\python_embeded\python.exe -s ComfyUI\main.py "
                                                "--windows-standalone-build\n")
        root = top / "ComfyUI"
        _comfyui_code(root)
        (root / "models" / "vae").mkdir(parents=True)
        (root / "extra_model_paths.yaml.example").write_text("#comfyui:\n#     base_path: path/to/comfyui/\n")
        return _fake_pack(root), {}, ["--base-directory", root], root / "models"
    if name == "base_directory_before_first_start":  # --base-directory: no code, and ComfyUI has made no models/
        root = tmp / "base"
        return _fake_pack(root), {}, ["--base-directory", root], root / "models"
    if name in ("extra_model_paths_default", "extra_model_paths_not_default"):
        root, shared = tmp / "ComfyUI", tmp / "shared models"
        _comfyui_code(root)
        default = "is_default: true" if name == "extra_model_paths_default" else ""
        config = _yaml(root / "extra_model_paths.yaml", f"""
            shared:
                base_path: {shared}
                {default}
                diffusion_models: |
                    unet
                    diffusion_models
                vae: vae/
            """)
        return (_fake_pack(root), {}, ["--base-directory", root, "--extra-model-paths-config", config],
                shared if default else root / "models")
    if name == "desktop":  # ComfyUI Desktop: a base folder with .venv, its model paths in the app's own yaml
        root = tmp / "Documents" / "ComfyUI"
        for sub in (".venv", "models/checkpoints", "models/diffusion_models", "models/vae", "user", "input"):
            (root / sub).mkdir(parents=True)
        config = _yaml(home / ".config" / "ComfyUI" / demo.DESKTOP_CONFIG_NAME, f"""
            # ComfyUI extra_model_paths.yaml for linux
            comfyui_desktop:
              is_default: "true"
              custom_nodes: custom_nodes/
              download_model_base: models
              diffusion_models: models/diffusion_models/
              vae: models/vae/
              base_path: {root}
            desktop_extensions:
              custom_nodes: {tmp / "app" / "resources" / "ComfyUI" / "custom_nodes"}
            """)
        return (_fake_pack(root), {"HOME": str(home), "XDG_CONFIG_HOME": ""},
                ["--base-directory", root, "--extra-model-paths-config", config], root / "models")
    raise ValueError(name)


LAYOUTS = ["clone", "windows_portable", "base_directory_before_first_start", "extra_model_paths_default",
           "extra_model_paths_not_default", "desktop"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_script_writes_where_that_comfyui_reads(tmp_path, layout, monkeypatch, capsys):
    pack, env, comfyui_args, models = _layout(layout, tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if layout == "base_directory_before_first_start":  # as a user runs it (the others run its main in-process)
        r = _run(pack, env={**os.environ, "PWD": str(pack)})
    else:
        r = _main_in_process(pack, capsys)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Templates > Extensions > layerwise-offload" in r.stdout
    assert (models / "diffusion_models" / demo.WAN21_FILE).is_file(), r.stdout
    assert (models / "vae" / demo.VAE_FILE).is_file(), r.stdout
    found = comfyui_finds(comfyui_args)
    assert found["diffusion_models"] == str(models / "diffusion_models" / demo.WAN21_FILE), (found, r.stdout)
    assert found["vae"] == str(models / "vae" / demo.VAE_FILE), (found, r.stdout)
    # Where the code says which place its Load Training Dataset reads, only there; in a base folder both.
    places = demo.cond_places(pack.parent.parent)
    assert (Path(found["output"]).is_dir()) == ("output" in places), (found, places)
    if "datasets" in places and demo.cond_places(comfy_env.comfyui_path()) == ("datasets",):
        assert found["datasets"], found
    if layout == "base_directory_before_first_start":
        assert "--base-directory" in r.stdout, r.stdout
    if layout == "desktop":
        assert "ComfyUI Desktop" in r.stdout, r.stdout


def _dummy_comfyui(code: Path, *args) -> subprocess.Popen:
    """A process whose command line is a ComfyUI server's (python <code>/main.py [flags]) and that only waits."""
    code.mkdir(parents=True, exist_ok=True)
    (code / "main.py").write_text("import time\ntime.sleep(300)\n")
    (code / "folder_paths.py").write_text("")
    return subprocess.Popen([sys.executable, str(code / "main.py"), *map(str, args)], cwd=str(code))


def test_script_reads_the_running_comfyuis_own_folders(tmp_path, capsys):
    """A ComfyUI running with --base-directory, --output-directory and an --extra-model-paths-config whose folder
    is_default: the script reads those from its command line, and that ComfyUI's path code finds every file."""
    base, out, shared = tmp_path / "base", tmp_path / "out", tmp_path / "shared"
    pack = _fake_pack(base)
    config = _yaml(tmp_path / "paths.yaml", f"""
        shared:
            base_path: {shared}
            is_default: true
            diffusion_models: diffusion_models
        """)
    args = ["--base-directory", base, "--output-directory", out, "--extra-model-paths-config", config]
    server = _dummy_comfyui(tmp_path / "code", *args)
    try:
        r = _main_in_process(pack, capsys)
    finally:
        server.kill()
        server.wait()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"the running ComfyUI (pid {server.pid})" in r.stdout, r.stdout
    found = comfyui_finds(args)
    assert found["diffusion_models"] == str(shared / "diffusion_models" / demo.WAN21_FILE), found
    assert found["vae"] == str(base / "models" / "vae" / demo.VAE_FILE), found
    assert found["output"] == str(out / demo.COND_FOLDER) and Path(found["output"]).is_dir(), found


def test_a_pack_linked_from_elsewhere_is_found_in_the_running_comfyui_that_loads_it(tmp_path, capsys):
    """Run from the pack's own folder (not in custom_nodes) while one ComfyUI links it into its custom_nodes: that
    one. With two such ComfyUIs the script cannot tell, and its error names both folders to pass."""
    real = tmp_path / "src" / "layerwise-offload"
    real.mkdir(parents=True)
    bases = [tmp_path / "base1", tmp_path / "base2"]
    for base in bases:
        (base / "custom_nodes").mkdir(parents=True)
        (base / "custom_nodes" / "layerwise-offload").symlink_to(real, target_is_directory=True)
    servers = [_dummy_comfyui(tmp_path / "code", "--base-directory", bases[0])]
    try:
        r = _main_in_process(real, capsys)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert (bases[0] / "models" / "diffusion_models" / demo.WAN21_FILE).is_file(), r.stdout
        servers.append(_dummy_comfyui(tmp_path / "code", "--base-directory", bases[1]))
        r = _main_in_process(real, capsys)
    finally:
        for server in servers:
            server.kill()
            server.wait()
    assert r.returncode == 1, r.stdout
    assert "2 running ComfyUIs" in r.stderr and all(str(b) in r.stderr for b in bases), r.stderr
    assert "--comfyui" in r.stderr


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
