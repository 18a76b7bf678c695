"""Write the files the "A tiny demo" template loads into the ComfyUI this pack is installed in.

Run it once from the pack's folder with the Python that runs your ComfyUI (its venv, or the portable build's
python_embeded\\python.exe), then open the template and press Run; no restart is needed:

    cd ComfyUI/custom_nodes/layerwise-offload
    python demo/install_tiny_demo.py

It finds that ComfyUI from its own location (custom_nodes/<this pack>/.., for a checkout and for a
--base-directory such as ComfyUI Desktop's) and writes the tiny Wan 2.1 T2V (4 blocks, random weights, 19 MB) into
models/diffusion_models, its VAE into models/vae, and one T5-shaped conditioning (there is no tiny UMT5-XXL text
encoder) where that ComfyUI's *Load Training Dataset* reads it: a folder of output/ (0.3.75, 0.14.1) or of
datasets/ (0.33.0); both where the code beside models/ does not say. `--comfyui DIR` names the folder yourself,
`--models-dir` / `--output-dir` / `--datasets-dir` override one each. Files already written by this version are
kept (`--force` rewrites them).

Only torch and safetensors are needed: the tensors' names and shapes (those of ComfyUI's own Wan 2.1 classes) are
listed in tiny_demo_tensors.json beside this file, and the weights come from fixed seeds, so every run writes the
same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

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


def find_comfyui(pack: Optional[Path] = None) -> Path:
    """The folder holding this ComfyUI's models/ and output/: custom_nodes/<pack>/.. of the pack folder."""
    pack = pack or pack_dir()
    if pack.parent.name != "custom_nodes":
        raise DemoError(f"{pack} is not inside a ComfyUI custom_nodes folder, so the ComfyUI to write into is not "
                        "known: install the pack into ComfyUI/custom_nodes, or pass --comfyui /path/to/ComfyUI")
    root = pack.parent.parent
    if not ((root / "main.py").is_file() or (root / "models").is_dir()):
        raise DemoError(f"{root} (the folder holding {pack.parent}) has neither main.py nor models/: pass the "
                        "ComfyUI folder (or its --base-directory) with --comfyui")
    return root


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


def install(models_dir: "os.PathLike | str", output_dir: "os.PathLike | str | None", seed: int = SEED,
            force: bool = False, datasets_dir: "os.PathLike | str | None" = None) -> Dict[str, str]:
    """Write the two models and the saved conditioning, the latter into ``<output_dir>/<COND_FOLDER>`` and into
    ``<datasets_dir>/<COND_FOLDER>``, each that is not None, and return ``{"wan21" | "vae": path}`` plus
    ``"cond"`` (the output/ one) and ``"cond_dataset"`` (the datasets/ one) for those written. Both conditioning
    folders hold the same files (the shard and metadata.json)."""
    import safetensors.torch
    import torch

    if output_dir is None and datasets_dir is None:
        raise ValueError("install() needs output_dir or datasets_dir for the conditioning")
    models_dir = Path(models_dir)
    specs, stamp = _tensor_specs(), recipe(seed)
    jobs = {"wan21": (models_dir / "diffusion_models" / WAN21_FILE, "tiny random Wan 2.1 T2V, 4 blocks"),
            "vae": (models_dir / "vae" / VAE_FILE, "tiny random Wan 2.1 VAE, width 8")}
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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", help="the ComfyUI folder (or its --base-directory) to write into; default: the "
                                      "one this pack is installed in")
    ap.add_argument("--models-dir", help="models folder (default: <comfyui>/models)")
    ap.add_argument("--output-dir", help="ComfyUI's output folder, where ComfyUI up to 0.14 reads the saved "
                                          "conditioning (default: <comfyui>/output, if that ComfyUI reads it there)")
    ap.add_argument("--datasets-dir", help="ComfyUI's datasets folder, where newer ComfyUIs (0.33) read it "
                                           "(default: <comfyui>/datasets, if that ComfyUI reads it there)")
    ap.add_argument("--force", action="store_true", help="rewrite the files even when they are current")
    a = ap.parse_args(argv)
    try:
        root = Path(a.comfyui).expanduser().resolve() if a.comfyui else find_comfyui()
        places = cond_places(root)
        output_dir = a.output_dir or (root / "output" if COND_IN_OUTPUT in places else None)
        datasets_dir = a.datasets_dir or (root / "datasets" if COND_IN_DATASETS in places else None)
        written = install(a.models_dir or root / "models", output_dir, force=a.force, datasets_dir=datasets_dir)
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
