"""Write the files the "A tiny demo" template loads where the ComfyUI this pack is installed in reads them.

Run it once from the pack's folder with the Python that runs your ComfyUI, then open the template and press Run;
no restart is needed:

    cd ComfyUI/custom_nodes/layerwise-offload
    python demo/install_tiny_demo.py

It works out where that ComfyUI reads models, the way ComfyUI itself does:

- a ComfyUI folder (a git clone, the Windows portable build's ComfyUI\): custom_nodes/<this pack>/.. holds main.py;
- a --base-directory (ComfyUI Desktop, many servers): custom_nodes/<this pack>/.. holds no ComfyUI code, and
  ComfyUI reads models/, output/ and datasets/ under it; they are created if ComfyUI has not made them yet;
- extra_model_paths.yaml (beside main.py, ComfyUI Desktop's extra_models_config.yaml, or any named with
  --extra-model-paths-config): a folder marked is_default there is where ComfyUI puts new models, so the files go
  there;
- a running ComfyUI whose custom_nodes holds this pack: its own --base-directory, --models-directory,
  --output-directory and --extra-model-paths-config are read from its command line (with psutil, which the pack
  requires).

It writes the tiny Wan 2.1 T2V (4 blocks, random weights, 19 MB) into diffusion_models, its VAE into vae, and one
T5-shaped conditioning (there is no tiny UMT5-XXL text encoder) where that ComfyUI's *Load Training Dataset* reads
it: a folder of output/ (0.3.75, 0.14.1) or of datasets/ (0.33.0); both where the ComfyUI code is not found.
`--comfyui DIR` names the ComfyUI folder or base directory yourself; `--models-dir` / `--output-dir` /
`--datasets-dir` override one folder each. Files already written by this version are kept (`--force` rewrites).

Only torch and safetensors are needed to write: the tensors' names and shapes (those of ComfyUI's own Wan 2.1
classes) are listed in tiny_demo_tensors.json beside this file, and the weights come from fixed seeds, so every run
writes the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
TENSORS_FILE = HERE / "tiny_demo_tensors.json"

#: File names the tiny demo template loads (the template and the tests use the same ones).
WAN21_FILE = "layerwise_offload_tiny_wan21.safetensors"
VAE_FILE = "layerwise_offload_tiny_wan21_vae.safetensors"
COND_FOLDER = "layerwise_offload_tiny_wan21_cond"
#: Where each ComfyUI's *Load Training Dataset* reads a saved dataset from (its folder_name is the folder's name).
COND_IN_OUTPUT, COND_IN_DATASETS = "output", "datasets"
COND_TOKENS = 8
TEXT_DIM = 4096
SEED = 0

_RECIPE_KEY = "layerwise_offload_recipe"
_LOG = "[layerwise-offload]"
#: ComfyUI Desktop's own model-paths file (it starts ComfyUI with --extra-model-paths-config pointing at it).
DESKTOP_CONFIG_NAME = "extra_models_config.yaml"


class DemoError(RuntimeError):
    """Where to write could not be worked out, or a folder cannot be written; the message says the fix."""


# --------------------------------------------------------------------------------------------------- locating

def pack_dir() -> Path:
    """The pack folder as ComfyUI sees it. A pack linked into custom_nodes resolves to its real folder, so the
    shell's own idea of the working folder ($PWD, unresolved) is tried when the script is run from inside it."""
    real = HERE.parent
    logical = os.environ.get("PWD")
    if logical and real.parent.name != "custom_nodes":
        for p in (Path(logical), *Path(logical).parents):
            if p.parent.name == "custom_nodes" and p.resolve() == real:
                return p
    return real


def is_comfyui_code(folder: Optional[Path]) -> bool:
    """A ComfyUI code folder (a clone, the portable build's ComfyUI\\), not a --base-directory: it has main.py."""
    return folder is not None and (folder / "main.py").is_file()


@dataclass
class RunningComfyUI:
    """What a running ComfyUI's command line says about where it reads and writes (ComfyUI's own flags)."""
    pid: int
    code: Path
    base: Path
    models: Optional[Path] = None
    output: Optional[Path] = None
    configs: List[Path] = field(default_factory=list)

    def custom_nodes_folders(self) -> List[Path]:
        return [self.base / "custom_nodes"] + [path for kind, path, _ in extra_paths(self.all_configs())
                                               if kind == "custom_nodes"]

    def all_configs(self) -> List[Path]:
        beside = self.code / "extra_model_paths.yaml"
        return ([beside] if beside.is_file() else []) + self.configs

    def holds(self, pack: Path) -> bool:
        """Whether this ComfyUI loads ``pack`` (a folder in one of its custom_nodes folders, linked or not)."""
        real = pack.resolve()
        for folder in self.custom_nodes_folders():
            try:
                if any(entry.resolve() == real for entry in folder.iterdir()):
                    return True
            except OSError:
                continue
        return False


def _parse_comfyui_command(cmdline: Sequence[str], cwd: Optional[str], pid: int) -> Optional[RunningComfyUI]:
    """A ComfyUI server's command line (``python [-s] .../main.py [flags]``), or None for any other process."""
    at = next((i for i, arg in enumerate(cmdline) if Path(arg).name == "main.py"), None)
    if at is None or at == 0:
        return None
    here = Path(cwd) if cwd else None

    def absolute(value: str) -> Optional[Path]:
        p = Path(value).expanduser()
        if not p.is_absolute():
            if here is None:
                return None
            p = here / p
        return Path(os.path.abspath(p))

    main = absolute(cmdline[at])
    if main is None or not (main.is_file() and (main.parent / "folder_paths.py").is_file()):
        return None
    ap = argparse.ArgumentParser(add_help=False)
    for flag in ("--base-directory", "--models-directory", "--output-directory"):
        ap.add_argument(flag)
    ap.add_argument("--extra-model-paths-config", nargs="+", action="append", default=[])
    flags, _ = ap.parse_known_args(list(cmdline[at + 1:]))
    base = absolute(flags.base_directory) if flags.base_directory else main.parent.resolve()
    if base is None:
        return None
    configs = [absolute(c) for group in flags.extra_model_paths_config for c in group]
    return RunningComfyUI(pid, main.parent.resolve(), base,
                          absolute(flags.models_directory) if flags.models_directory else None,
                          absolute(flags.output_directory) if flags.output_directory else None,
                          [c for c in configs if c is not None])


def running_comfyuis() -> List[RunningComfyUI]:
    """The ComfyUI servers running on this machine that this user may inspect (none without psutil)."""
    try:
        import psutil
    except ImportError:
        return []
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        info = proc.info
        if not info.get("cmdline"):
            continue
        try:
            parsed = _parse_comfyui_command(info["cmdline"], info.get("cwd"), info["pid"])
        except (OSError, ValueError):
            continue
        if parsed is not None:
            found.append(parsed)
    return found


def extra_paths(configs: Iterable[Path]) -> List[Tuple[str, Path, bool]]:
    """``(folder kind, folder, is_default)`` for every folder the extra_model_paths.yaml files ``configs`` add, in
    the order ComfyUI adds them (utils/extra_config.py: base_path with ~ and $VARS expanded, relative to the file;
    several folders one per line). A file that cannot be read adds nothing."""
    try:
        import yaml  # ComfyUI's own requirement: its Python has it
    except ImportError:
        return []
    out = []
    for config_path in configs:
        try:
            with open(config_path, "r", encoding="utf-8") as f:
                config = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            continue
        here = Path(config_path).resolve().parent
        for conf in (config.values() if isinstance(config, dict) else ()):
            if not isinstance(conf, dict):
                continue
            conf = dict(conf)
            base = conf.pop("base_path", None)
            if base is not None:
                base = Path(os.path.expandvars(os.path.expanduser(str(base))))
                base = base if base.is_absolute() else here / base
            is_default = bool(conf.pop("is_default", False))  # as ComfyUI reads it: any value but empty/false
            for kind, value in conf.items():
                for line in str(value).split("\n"):
                    line = line.strip()
                    if not line:
                        continue
                    p = Path(line)
                    p = base / p if base is not None else (p if p.is_absolute() else here / p)
                    kind = "diffusion_models" if kind == "unet" else "text_encoders" if kind == "clip" else kind
                    out.append((kind, Path(os.path.normpath(p)), is_default))
    return out


def desktop_config() -> Optional[Path]:
    """ComfyUI Desktop's model-paths file in this user's app data (Windows %APPDATA%, macOS Application Support,
    Linux ~/.config), if there is one."""
    if sys.platform == "win32":
        app_data = Path(os.environ.get("APPDATA", Path.home() / "AppData" / "Roaming"))
    elif sys.platform == "darwin":
        app_data = Path.home() / "Library" / "Application Support"
    else:
        app_data = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    path = app_data / "ComfyUI" / DESKTOP_CONFIG_NAME
    return path if path.is_file() else None


@dataclass
class Target:
    """Where one ComfyUI reads the demo's files, and how that was found (printed for the user)."""
    root: Path
    how: str
    code: Optional[Path]
    diffusion_models: Path
    vae: Path
    output: Path
    datasets: Path

    def cond_places(self) -> Tuple[str, ...]:
        return cond_places(self.code)


def _default_folder(kind: str, fallback: Path, configs: Sequence[Path]) -> Path:
    """Where ComfyUI puts a new file of ``kind``: the last folder an extra_model_paths.yaml marks is_default for it
    (each such folder goes first in ComfyUI's list), else ``fallback`` (one ComfyUI always reads)."""
    chosen = fallback
    for got_kind, folder, is_default in extra_paths(configs):
        if got_kind == kind and is_default:
            chosen = folder
    return chosen


def target_for(root: Path, how: str, code: Optional[Path] = None, models: Optional[Path] = None,
               output: Optional[Path] = None, configs: Sequence[Path] = ()) -> Target:
    models = models or root / "models"
    if code is not None and (code / "extra_model_paths.yaml").is_file():
        configs = [code / "extra_model_paths.yaml", *configs]
    return Target(root, how, code,
                  _default_folder("diffusion_models", models / "diffusion_models", configs),
                  _default_folder("vae", models / "vae", configs),
                  output or root / "output",
                  _default_folder("datasets", root / "datasets", configs))


def _describe(running: Sequence[RunningComfyUI]) -> str:
    return "; ".join(f"pid {r.pid} runs {r.code / 'main.py'} with base folder {r.base}" for r in running)


def _root_of(pack: Path, running: Sequence[RunningComfyUI]) -> Tuple[Path, List[RunningComfyUI]]:
    """The folder holding the custom_nodes/ that loads ``pack``, and the running ComfyUIs that read it."""
    if pack.parent.name == "custom_nodes":
        folder = pack.parent.resolve()
        # By the folder, not by where a linked pack points: other ComfyUIs may link the same pack.
        return pack.parent.parent, [r for r in running if any(f.resolve() == folder for f in r.custom_nodes_folders())]
    mine = [r for r in running if r.holds(pack)]
    if len(mine) == 1:
        return mine[0].base, mine
    if mine:
        raise DemoError(f"{pack} is loaded by {len(mine)} running ComfyUIs ({_describe(mine)}): name the one to "
                        f"write into, e.g. --comfyui {mine[0].base}")
    hint = f" Running now: {_describe(running)}." if running else ""
    raise DemoError(f"{pack} is not inside a ComfyUI custom_nodes folder, so the ComfyUI to write into is not known. "
                    "Install the pack into ComfyUI/custom_nodes (or <base directory>/custom_nodes), or pass --comfyui "
                    "with the ComfyUI folder (the one holding main.py) or, if ComfyUI is started with "
                    "--base-directory DIR, that DIR." + hint)


def locate(pack: Optional[Path] = None, comfyui: Optional[Path] = None,
           running: Optional[Sequence[RunningComfyUI]] = None) -> Target:
    """Where the ComfyUI this pack is installed in (or the one at ``comfyui``) reads the demo's files: see the
    module's docstring for the layouts, in the order tried here."""
    running = running_comfyuis() if running is None else running
    if comfyui is not None:
        root = Path(comfyui).expanduser().resolve()
        mine = [r for r in running if root in (r.base, r.code)]
    else:
        root, mine = _root_of(pack or pack_dir(), running)
    if mine:
        r = mine[0]
        return target_for(r.base, f"the running ComfyUI (pid {r.pid}) reads it", r.code, r.models, r.output, r.configs)
    if is_comfyui_code(root):
        return target_for(root, "a ComfyUI folder", root)
    desktop = desktop_config()
    if desktop and any(kind == "custom_nodes" and folder.resolve() == (root / "custom_nodes").resolve()
                       for kind, folder, _ in extra_paths([desktop])):
        return target_for(root, f"a ComfyUI Desktop folder ({desktop})", None, configs=[desktop])
    return target_for(root, f"a base directory: ComfyUI started with --base-directory {root} reads it", None)


def cond_places(root: Optional[Path]) -> Tuple[str, ...]:
    """Where the ComfyUI at ``root`` has *Load Training Dataset* look for the saved conditioning, from its own code
    (comfy_extras/nodes_dataset.py): ``("datasets",)`` for one that lists the folders of datasets/ (0.33.0),
    ``("output",)`` for one that reads a folder of output/ (0.3.75, 0.14.1), both when ``root`` holds no such
    code (a --base-directory, e.g. ComfyUI Desktop's, or a folder named with --comfyui before ComfyUI is there)."""
    source = root / "comfy_extras" / "nodes_dataset.py" if root is not None else None
    try:
        text = source.read_text(encoding="utf-8", errors="replace") if source is not None else ""
    except OSError:
        text = ""
    start = text.find("class LoadTrainingDataset")
    if start < 0:
        return (COND_IN_OUTPUT, COND_IN_DATASETS)
    end = text.find("\nclass ", start + 1)
    body = text[start:end if end > 0 else len(text)]
    if "get_output_directory()" in body:
        return (COND_IN_OUTPUT,)
    if "dataset_dir(" in body or '"datasets"' in body:
        return (COND_IN_DATASETS,)
    return (COND_IN_OUTPUT, COND_IN_DATASETS)


# --------------------------------------------------------------------------------------------------- tensors

def _tensor_specs() -> Dict[str, List[Tuple[str, List[int]]]]:
    data = json.loads(TENSORS_FILE.read_text(encoding="utf-8"))
    return {kind: [(name, list(shape)) for name, shape in entries] for kind, entries in data["tensors"].items()}


def random_weights(specs: Sequence[Tuple[str, Sequence[int]]], seed: int):
    """Well-scaled random float32 weights for ``specs`` (name, shape), filled in sorted name order from one
    generator: matrices ~ N(0, 1/fan_in), 1-D norm weights/scales ~ 1 + N(0, 0.02), other 1-D ~ N(0, 0.02).
    devtools/tiny_dits.py fills the tiny models the tests build in-process with it too, so the files hold the same
    weights."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out = {}
    for name, shape in sorted(specs):
        if len(shape) >= 2:
            out[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * (math.prod(shape[1:]) ** -0.5)
        elif name.rsplit(".", 1)[-1] in ("weight", "scale"):
            out[name] = 1.0 + 0.02 * torch.randn(shape, generator=gen, dtype=torch.float32)
        else:
            out[name] = 0.02 * torch.randn(shape, generator=gen, dtype=torch.float32)
    return out


#: What ComfyUI's Save Training Dataset writes beside the shards; newer ComfyUIs list a datasets/ folder only if
#: it holds this file (or a .safetensors).
COND_METADATA = {"num_samples": 1, "num_shards": 1, "shard_size": 1000}


def conditioning(seed: int = SEED, tokens: int = COND_TOKENS):
    """What *Load Training Dataset* reads from one shard: a zero latent and one T5-shaped conditioning."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(int(seed) + 7)
    ctx = torch.randn((1, tokens, TEXT_DIM), generator=gen, dtype=torch.float32)
    return {"latents": [{"samples": torch.zeros((1, 16, 2, 8, 8), dtype=torch.float32)}],
            "conditioning": [[[ctx, {}]]]}


def recipe(seed: int = SEED) -> str:
    """Changes whenever the bytes this script writes would change (its code, the tensor list, the seed)."""
    src = Path(__file__).read_bytes() + TENSORS_FILE.read_bytes()
    return hashlib.sha256(src + f":{seed}".encode()).hexdigest()[:16]


def _is_current(path: Path, want: str) -> bool:
    if not path.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(_RECIPE_KEY) == want
    except Exception:  # a truncated or foreign file: write it again
        return False


def write_atomically(path: Path, write) -> None:
    """``write(tmp)`` a file beside ``path``, then put it in place (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def install(models_dir: "os.PathLike | str | None", output_dir: "os.PathLike | str | None", seed: int = SEED,
            force: bool = False, datasets_dir: "os.PathLike | str | None" = None, *,
            diffusion_models_dir: "os.PathLike | str | None" = None,
            vae_dir: "os.PathLike | str | None" = None) -> Dict[str, str]:
    """Write the two models and the saved conditioning, the latter into ``<output_dir>/<COND_FOLDER>`` and into
    ``<datasets_dir>/<COND_FOLDER>``, each that is not None, and return ``{"wan21" | "vae": path}`` plus
    ``"cond"`` (the output/ one) and ``"cond_dataset"`` (the datasets/ one) for those written. Both conditioning
    folders hold the same files (the shard and metadata.json). The models go to ``<models_dir>/diffusion_models``
    and ``<models_dir>/vae`` unless ``diffusion_models_dir`` / ``vae_dir`` name their folders."""
    import safetensors.torch
    import torch

    if output_dir is None and datasets_dir is None:
        raise ValueError("install() needs output_dir or datasets_dir for the conditioning")
    if models_dir is None and (diffusion_models_dir is None or vae_dir is None):
        raise ValueError("install() needs models_dir, or both diffusion_models_dir and vae_dir")
    unet = Path(diffusion_models_dir) if diffusion_models_dir is not None else Path(models_dir) / "diffusion_models"
    vae = Path(vae_dir) if vae_dir is not None else Path(models_dir) / "vae"
    specs, stamp = _tensor_specs(), recipe(seed)
    jobs = {"wan21": (unet / WAN21_FILE, "tiny random Wan 2.1 T2V, 4 blocks"),
            "vae": (vae / VAE_FILE, "tiny random Wan 2.1 VAE, width 8")}
    out: Dict[str, str] = {}
    for kind, (path, what) in jobs.items():
        if force or not _is_current(path, stamp):
            sd = random_weights(specs[kind], seed)
            write_atomically(path, lambda tmp: safetensors.torch.save_file(
                sd, str(tmp), metadata={"layerwise_offload": what, _RECIPE_KEY: stamp}))
        out[kind] = str(path)
    for key, parent in (("cond", output_dir), ("cond_dataset", datasets_dir)):
        if parent is None:
            continue
        folder = Path(parent) / COND_FOLDER
        write_atomically(folder / "shard_00000.pkl", lambda tmp: torch.save(conditioning(seed), str(tmp)))
        write_atomically(folder / "metadata.json",
                 lambda tmp: tmp.write_text(json.dumps(COND_METADATA, indent=2) + "\n", encoding="utf-8"))
        out[key] = str(folder)
    return out


def main(argv: Optional[List[str]] = None, pack: Optional[Path] = None) -> int:
    """The command; ``pack`` (for tests) stands for the pack folder this file is in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", help="the ComfyUI folder (the one holding main.py), or the folder ComfyUI is started "
                                      "with as --base-directory; default: the one this pack is installed in")
    ap.add_argument("--models-dir", help="models folder (default: where that ComfyUI reads models)")
    ap.add_argument("--output-dir", help="ComfyUI's output folder, where ComfyUI up to 0.14 reads the saved "
                                          "conditioning (default: <comfyui>/output, if that ComfyUI reads it there)")
    ap.add_argument("--datasets-dir", help="ComfyUI's datasets folder, where newer ComfyUIs (0.33) read it "
                                           "(default: <comfyui>/datasets, if that ComfyUI reads it there)")
    ap.add_argument("--force", action="store_true", help="rewrite the files even when they are current")
    a = ap.parse_args(argv)
    try:
        where = locate(pack, comfyui=Path(a.comfyui) if a.comfyui else None)
        places = where.cond_places()
        output_dir = a.output_dir or (where.output if COND_IN_OUTPUT in places else None)
        datasets_dir = a.datasets_dir or (where.datasets if COND_IN_DATASETS in places else None)
        folders = ({"models_dir": Path(a.models_dir)} if a.models_dir else
                   {"models_dir": None, "diffusion_models_dir": where.diffusion_models, "vae_dir": where.vae})
        print(f"{_LOG} writing into {where.root} ({where.how})")
        written = install(output_dir=output_dir, force=a.force, datasets_dir=datasets_dir, **folders)
    except (DemoError, OSError) as e:
        print(f"{_LOG} ERROR: {e}", file=sys.stderr)
        return 1
    for path in written.values():
        print(f"{_LOG} tiny demo: {path}")
    print(f"{_LOG} done. In ComfyUI: Templates > Extensions > layerwise-offload > \"A tiny demo\", then Run "
          "(no restart needed).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
