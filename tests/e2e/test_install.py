"""Installing the pack the way ComfyUI Manager does, and the packaging metadata the Comfy Registry reads.

Manager (and comfy-cli) install a pack by ``git clone <repo> ComfyUI/custom_nodes/<name>`` and then
``pip install -r requirements.txt`` in ComfyUI's environment. So: clone THIS repository's HEAD (committed state,
as a user would get it) into a fresh custom_nodes folder, dry-run the requirements against the venv (nothing may
touch torch), and let ComfyUI 0.3.75 import the folder in a child process exactly as it does at start-up
(``nodes.init_external_custom_nodes`` with ``--base-directory``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
import tomllib
from pathlib import Path

import pytest

from layerwise_offload.devtools.server import ComfyServer, PACK_FOLDER, default_comfyui_path, default_python
from layerwise_offload.devtools.workflow_api import workflow_to_prompt

REPO = Path(__file__).resolve().parents[2]
NODE = "LayerwiseOffload"


def _pyproject():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirements():
    out = []
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def _req_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, 1)[0].strip().lower().replace("_", "-")


# ------------------------------------------------------------------------------------------------ metadata

def test_pyproject_has_what_the_comfy_registry_needs():
    data = _pyproject()
    project, comfy = data["project"], data["tool"]["comfy"]
    assert project["name"] == "layerwise-offload"
    # Registry rules for the node id: < 100 chars, alphanumerics and single - _ . separators, starts with a letter.
    assert len(project["name"]) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", project["name"])
    assert "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), "semantic version X.Y.Z"
    assert project["version"] == "0.1.0"
    assert len(project["description"]) > 20
    assert project["license"] == {"file": "LICENSE"} and (REPO / "LICENSE").is_file()
    assert project["requires-python"].startswith(">=")
    assert isinstance(project["dependencies"], list)
    assert project["urls"]["Repository"].startswith("https://")
    assert comfy["PublisherId"] and comfy["DisplayName"] == "Layerwise Offload"
    assert isinstance(comfy.get("includes", []), list)
    assert comfy["requires-comfyui"] == ">=0.3.75"


def test_dependencies_match_requirements_and_never_name_torch():
    deps = _pyproject()["project"]["dependencies"]
    reqs = _requirements()
    assert sorted(deps) == sorted(reqs)
    names = {_req_name(r) for r in deps + reqs}
    assert {"psutil", "safetensors"} <= names
    assert not names & {"torch", "torchvision", "torchaudio", "xformers", "triton"}, names


def test_license_is_the_full_gpl3_text():
    text = (REPO / "LICENSE").read_text()
    assert "GNU GENERAL PUBLIC LICENSE" in text and "Version 3, 29 June 2007" in text
    assert "END OF TERMS AND CONDITIONS" in text and "How to Apply These Terms to Your New Programs" in text
    assert len(text) > 30000


def test_comfyui_parses_the_pyproject(comfy):
    # ComfyUI itself reads a pack's pyproject.toml at import (web folder, version compatibility): use its parser.
    from comfy_config import config_parser

    cfg = config_parser.extract_node_configuration(str(REPO))
    assert cfg.project.name == "layerwise-offload" and cfg.project.version == "0.1.0"
    assert cfg.tool_comfy.publisher_id and cfg.tool_comfy.display_name == "Layerwise Offload"
    assert cfg.project.supported_comfyui_version == ">=0.3.75"
    assert cfg.project.urls.repository.startswith("https://")


# ------------------------------------------------------------------------------------------------ what the Registry gets
# `comfy node pack` / `publish` (comfy-cli) zip the git-tracked files minus the gitwildmatch patterns of
# .comfyignore; git's own matcher applies the same patterns to `git ls-files`.

def _git(*args: str) -> list:
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def shipped():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to pack")
    ignored = set(_git("ls-files", "-c", "-i", "--exclude-from=.comfyignore"))
    return sorted(set(_git("ls-files")) - ignored)


def test_pack_ships_the_node_templates_and_demo_not_the_development_tree(shipped):
    tops = {p.split("/")[0] for p in shipped}
    assert not tops & {"tests", "bench", "devtools", "scripts", ".ci"}, sorted(tops)
    for need in ("__init__.py", "pyproject.toml", "requirements.txt", "LICENSE", "README.md",
                 "demo/install_tiny_demo.py", "demo/tiny_demo_tensors.json"):
        assert need in shipped, need
    for folder in ("nodes", "offload", "web", "workflows"):
        tracked = [p for p in _git("ls-files", folder)]
        assert tracked and set(tracked) <= set(shipped), folder
    assert any(p.endswith(".jpg") for p in shipped if p.startswith("workflows/"))


def test_shipped_code_needs_nothing_left_out(shipped):
    left_out = re.compile(r"^\s*(?:from|import)\s+[\w.]*?\b(devtools|bench|tests|scripts)\b", re.M)
    for rel in shipped:
        if rel.endswith(".py"):
            hit = left_out.search((REPO / rel).read_text(encoding="utf-8"))
            assert hit is None, f"{rel} imports {hit.group(1)}/, which the pack leaves out"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _local_links(page: Path, root: Path):
    """``(target file relative to ``root``, anchor or "")`` of every relative link on ``page``."""
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page.resolve()
        yield file.relative_to(root.resolve()).as_posix(), anchor


def _assert_links_resolve(page: Path, files, root: Path = REPO) -> int:
    links = list(_local_links(page, root))
    missing = sorted({f for f, _ in links if f not in files})
    assert not missing, f"{page.name} links to files the pack does not have: {missing}"
    broken = []
    for file, anchor in links:
        if anchor and file.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (root / file).read_text(encoding="utf-8"), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                broken.append(f"{file}#{anchor}")
    assert not broken, f"{page.name} links to headings that do not exist: {broken}"
    return len(links)


def test_readme_links_point_at_shipped_files(shipped):
    """Every link in the README (and in the docs pages it leads to) opens a file the pack ships, at a heading that
    is there: a user who installed from the Registry has only those."""
    assert _assert_links_resolve(REPO / "README.md", set(shipped)) >= 5, "no local links found"
    for page in sorted((REPO / "docs").glob("*.md")):
        _assert_links_resolve(page, set(shipped))


def test_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "install.md").write_text("# Install\n\n## The tiny demo's files\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("[a](docs/install.md#the-tiny-demos-files) [b](docs/nowhere.md)\n", encoding="utf-8")
    files = {"docs/install.md", "README.md"}
    with pytest.raises(AssertionError, match="nowhere.md"):
        _assert_links_resolve(page, files, tmp_path)
    page.write_text("[a](docs/install.md#the-tiny-demos-files) [c](docs/install.md#no-such-heading)\n")
    with pytest.raises(AssertionError, match="no-such-heading"):
        _assert_links_resolve(page, files, tmp_path)
    page.write_text("[a](docs/install.md#the-tiny-demos-files)\n")
    assert _assert_links_resolve(page, files, tmp_path) == 1


def test_readme_is_short_and_its_tables_have_one_line_cells():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 125, f"README.md has {len(lines)} lines: move details into docs/"
    cells = [c.strip() for line in lines if line.startswith("|") for c in line.strip().strip("|").split("|")]
    long_cells = [c for c in cells if len(c) > 200]
    assert cells and not long_cells, long_cells
    for word in ("session", "the issue", "lent", "no GPU was"):
        assert word not in text.lower(), f"README.md says {word!r}: words of how it was written, not of the pack"
    # The two commands of this repository: CI's entry point runs the second.
    assert "bash scripts/run.sh" in text and "bash scripts/test.sh" in text
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


# ------------------------------------------------------------------------------------------------ Manager install

_LOAD_SCRIPT = textwrap.dedent("""
    import asyncio, json, logging, sys
    base = sys.argv[1]
    sys.argv = ["main.py", "--cpu", "--base-directory", base, "--disable-api-nodes"]
    import comfy.options
    comfy.options.enable_args_parsing()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    import nodes
    asyncio.run(nodes.init_external_custom_nodes())
    mine = {k: v.__module__ for k, v in nodes.NODE_CLASS_MAPPINGS.items() if "custom_nodes" in (v.__module__ or "")}
    print("RESULT " + json.dumps({
        "nodes": mine,
        "display": {k: nodes.NODE_DISPLAY_NAME_MAPPINGS.get(k) for k in mine},
        "loaded_dirs": dict(nodes.LOADED_MODULE_DIRS),
        "sys_path": sys.path,
    }))
""")


@pytest.fixture(scope="module")
def manager_install(tmp_path_factory):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    base = tmp_path_factory.mktemp("manager_base")
    dest = base / "custom_nodes" / PACK_FOLDER
    dest.parent.mkdir(parents=True)
    r = subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return base, dest


def test_clone_has_the_pack(manager_install):
    _, dest = manager_install
    for rel in ("__init__.py", "nodes", "offload", "workflows", "requirements.txt", "pyproject.toml", "LICENSE"):
        assert (dest / rel).exists(), f"{rel} is not committed: a Manager install would lack it"
    assert not (dest / ".venv").exists() and not (dest / ".comfyui").exists()


def test_requirements_install_without_touching_torch(manager_install):
    _, dest = manager_install
    r = subprocess.run([default_python(), "-m", "pip", "install", "--dry-run", "--disable-pip-version-check",
                        "-r", str(dest / "requirements.txt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    would = [line for line in r.stdout.splitlines() if line.startswith("Would install")]
    assert not any(re.search(r"\btorch", line) for line in would), would


def test_comfyui_imports_the_cloned_pack(manager_install):
    base, dest = manager_install
    comfy_dir = default_comfyui_path()
    r = subprocess.run([default_python(), "-c", _LOAD_SCRIPT, str(base)], cwd=str(comfy_dir),
                       capture_output=True, text=True, timeout=300)
    log = r.stderr
    assert r.returncode == 0, log[-4000:]
    result = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert "Cannot import" not in log, log[-4000:]
    import_lines = [line for line in log.splitlines() if line.rstrip().endswith(str(dest))]
    assert import_lines and "IMPORT FAILED" not in import_lines[0], log[-4000:]
    assert NODE in result["nodes"], result["nodes"]
    assert result["display"][NODE] == "Layerwise Offload (DiT)"
    assert Path(result["loaded_dirs"][PACK_FOLDER]) == dest
    # ComfyUI imported it as a package named after its path; the pack root never went on sys.path.
    assert str(dest) not in result["sys_path"]


def test_the_test_suite_runs_in_a_clone_named_like_the_repository(manager_install):
    # `git clone` names the folder `layerwise-offload`, not a Python identifier: pytest must not import the root
    # __init__.py as a package there (it did, and every ComfyUI test errored). A test that imports ComfyUI is
    # enough to show it; the clone has no .comfyui, so it uses this session's ComfyUI.
    _, dest = manager_install
    assert dest.name == "layerwise-offload"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["COMFYUI_PATH"] = str(default_comfyui_path())
    r = subprocess.run([default_python(), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/e2e/test_install.py", "-k", "comfyui_parses_the_pyproject or license"],
                       cwd=str(dest), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "2 passed" in r.stdout, r.stdout[-2000:]


# ------------------------------------------------------------------------------------------------ the tiny demo
# A user's own ComfyUI: the pack cloned into its custom_nodes as the README says, the one documented step
# (demo/install_tiny_demo.py, run from the pack folder with ComfyUI's Python), and the template then runs through
# the real server, which was started before the step (no restart).

def _fresh_comfyui(dest: Path) -> Path:
    """A copy of the session's ComfyUI as a fresh install has it: code and empty model folders, nothing run."""
    src = default_comfyui_path()
    shutil.copytree(src, dest, ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
        Path(d) == src and n in ("user", "output", "temp", "custom_nodes", "models"))])
    for sub in ("user", "custom_nodes", "models/diffusion_models", "models/vae", "models/text_encoders"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    return dest


def test_tiny_demo_runs_in_a_users_comfyui_after_the_one_step(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    comfy = _fresh_comfyui(tmp_path / "ComfyUI")
    pack = comfy / "custom_nodes" / PACK_FOLDER
    r = subprocess.run(["git", "clone", "--quiet", str(REPO), str(pack)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    demo = next(p for p in (pack / "workflows").glob("*.json") if "tiny demo" in p.stem.lower())
    note = next(n for n in json.loads(demo.read_text(encoding="utf-8"))["nodes"] if n["type"] == "MarkdownNote")
    assert "python demo/install_tiny_demo.py" in note["widgets_values"][0], "the template names the step"
    assert "python demo/install_tiny_demo.py" in (REPO / "README.md").read_text(encoding="utf-8")
    with ComfyServer(None, comfyui_path=comfy, cpu=True, env={"LAYERWISE_OFFLOAD_CPU_LOOPBACK": "1"},
                     extra_args=["--disable-api-nodes"]) as srv:
        info = srv.object_info()
        assert "LayerwiseOffload" in info
        r = subprocess.run([default_python(), "demo/install_tiny_demo.py"], cwd=str(pack), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert str(comfy / "models" / "diffusion_models") in r.stdout, r.stdout
        entry = srv.run_prompt(workflow_to_prompt(json.loads(demo.read_text(encoding="utf-8")), info),
                               timeout=300)
        images = srv.output_files(entry, "images")
        assert images and all(Path(p).is_relative_to(comfy / "output") for p in images), images
        assert "[layerwise-offload] run:" in srv.log_text(), srv.log_tail()


# ------------------------------------------------------------------------------------------------ scripts/run.sh
# With COMFYUI_PATH, run.sh runs a user's ComfyUI in this pack's .venv and base folder: it must not write into
# that ComfyUI, nor install its requirements into the .venv unless asked.

def _run_sh(args, comfyui: Path, base: Path, timeout: int = 600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update({"COMFYUI_PATH": str(comfyui), "LAYERWISE_OFFLOAD_RUN_BASE": str(base), "FORCE_CPU": "1"})
    return subprocess.run(["bash", str(REPO / "scripts" / "run.sh"), *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)


def _tree(root: Path):
    # Bytecode caches are left out: an already-run ComfyUI has them for every module it imports at start.
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _pip_freeze():
    return subprocess.run([default_python(), "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                          timeout=120).stdout


def test_run_sh_asks_before_installing_a_users_comfyui_requirements(tmp_path):
    theirs = tmp_path / "ComfyUI"
    (theirs / "comfy").mkdir(parents=True)
    (theirs / "main.py").write_text("raise SystemExit('never started: requirements are missing')\n")
    (theirs / "requirements.txt").write_text("psutil\nlayerwise-offload-absent-package==1.0\n")
    before = _pip_freeze()
    r = _run_sh(["--smoke"], theirs, tmp_path / "base")
    assert r.returncode != 0
    assert "layerwise-offload-absent-package==1.0  (not installed)" in r.stderr, r.stderr[-3000:]
    assert "--install-comfyui-requirements" in r.stderr
    assert _pip_freeze() == before
    assert sorted(p.name for p in theirs.iterdir()) == ["comfy", "main.py", "requirements.txt"]


def test_run_sh_smoke_with_a_users_comfyui_writes_nothing_into_it(tmp_path):
    # run.sh runs ComfyUI in .venv, which matches the vendored ComfyUI; a session testing another ComfyUI would
    # only repeat this (a minute: run.sh sets .venv up for the other folder, then back).
    theirs = REPO / ".comfyui" / "ComfyUI"
    if default_comfyui_path() != theirs.resolve():
        pytest.skip("run.sh is tested in the session of the vendored ComfyUI (.venv's)")
    before = _tree(theirs)
    base = tmp_path / "base"
    r = _run_sh(["--smoke"], theirs, base)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    result = json.loads(r.stdout[r.stdout.index("\n{\n") + 1:])  # smoke prints its result last
    assert result["outputs"] and all(Path(p).is_relative_to(base / "output") for p in result["outputs"])
    assert (base / "custom_nodes" / PACK_FOLDER).resolve() == REPO
    assert _tree(theirs) == before
