"""Files a real ComfyUI server needs to run the tiny demo and the end-to-end tests.

The demo's three files (tiny Wan 2.1 DiT, tiny Wan 2.1 VAE, saved conditioning) are written by the pack's own
shipped script, demo/install_tiny_demo.py, the same step a user runs, so the tests load exactly what users get.
That script needs no ComfyUI code: it reads the tensors' names and shapes from demo/tiny_demo_tensors.json, which
this module writes from ComfyUI's own classes (``--write-tensors``; tests/comfy/test_tiny_demo_files.py checks
the files against those classes, bitwise). The conditioning stands in for the UMT5-XXL text encoder: ComfyUI's
core node ``LoadTrainingDataset`` loads one saved T5-shaped conditioning from output/ (0.3.75, 0.14.1) or
datasets/ (0.33.0: only the folders holding a metadata.json); the test servers' base folders get it in both
(:func:`copy_cond`). ``VAELoader`` reads the Wan 2.1 VAE width from ``decoder.head.0.gamma``, so a random
``WanVAE(dim=8)`` is detected. For the error path, the tests also get a model that is not a DiT: a ~17M-parameter
SD1.5-family UNet.

    python -P devtools/e2e_assets.py --base <ComfyUI base folder>     # models/, output/ and datasets/ under it
    python -P devtools/e2e_assets.py --write-tensors                  # demo/tiny_demo_tensors.json

Everything is deterministic (fixed seeds) and skipped when the file already exists with the same recipe.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Dict, Optional

if not __package__:  # run by path: register the pack so the relative imports below work
    import runpy
    runpy.run_path(str(Path(__file__).with_name("comfy_env.py")))["enter_pack"](globals())

import torch  # noqa: E402

from ..demo import install_tiny_demo as demo  # noqa: E402  (the shipped writer: the tests use what users get)
from .comfy_env import import_comfyui  # noqa: E402
from .tiny_dits import init_tiny_weights  # noqa: E402
from .tiny_unet import build_tiny_sd15  # noqa: E402

#: File names under models/diffusion_models, models/vae and output/ or datasets/ (what the tiny workflow and the
#: tests refer to).
TINY_WAN21_NAME, TINY_WAN21_VAE_NAME, TINY_COND_FOLDER = demo.WAN21_FILE, demo.VAE_FILE, demo.COND_FOLDER
TINY_SD15_UNET_NAME = "layerwise_offload_tiny_sd15_unet.safetensors"
VAE_CONFIG = dict(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)


def build_tiny_wan21_vae(seed: int = 0) -> torch.nn.Module:
    """The tiny Wan 2.1 VAE from ComfyUI's own class (real width 96; latent 16 channels, x8 spatial, x4
    temporal, like the real one), filled like the tiny DiTs. ``VAELoader`` reads the width from
    ``decoder.head.0.gamma``."""
    import_comfyui()
    import comfy.ldm.wan.vae

    vae = comfy.ldm.wan.vae.WanVAE(**VAE_CONFIG)
    init_tiny_weights(vae, seed)
    return vae


def comfyui_tensor_specs() -> Dict[str, list]:
    """``{"wan21" | "vae": [[name, shape], ...]}`` of the demo's two models as the imported ComfyUI builds them:
    what demo/tiny_demo_tensors.json must list (``--write-tensors`` rewrites it)."""
    from .tiny_dits import build_wan21

    import_comfyui()
    import comfy.ldm.wan.vae

    with torch.device("meta"):
        vae = comfy.ldm.wan.vae.WanVAE(**VAE_CONFIG)
    dit = build_wan21(seed=0).model.diffusion_model
    return {kind: [[k, list(v.shape)] for k, v in sorted(m.state_dict().items())]
            for kind, m in (("wan21", dit), ("vae", vae))}


def save_tiny_sd15_unet(path: "os.PathLike | str", seed: int = 0) -> str:
    """The tiny SD1.5-family UNet (devtools/tiny_unet.py: not a DiT) as a file ``UNETLoader`` detects as SD15."""
    import safetensors.torch

    unet = build_tiny_sd15(seed).model.diffusion_model
    sd = {k: v.detach().to("cpu").contiguous() for k, v in unet.state_dict().items()}
    demo.write_atomically(Path(path), lambda tmp: safetensors.torch.save_file(  # several test runs may write at once
        sd, str(tmp), metadata={"layerwise_offload": "tiny SD1.5-family UNet (not a DiT)"}))
    return str(path)


def install_demo_assets(models_dir: "os.PathLike | str", output_dir: "os.PathLike | str | None", seed: int = 0,
                        with_sd15: bool = True, force: bool = False,
                        datasets_dir: "os.PathLike | str | None" = None) -> Dict[str, str]:
    """Write every tiny asset into a ComfyUI layout and return ``{kind: path}``: ``wan21``, ``vae``, ``cond``
    (under ``output_dir``) and ``cond_dataset`` (under ``datasets_dir``, if given) as demo/install_tiny_demo.py
    writes them for a user, and ``sd15`` (if ``with_sd15``):
    ``<models_dir>/diffusion_models/layerwise_offload_tiny_sd15_unet.safetensors``, with a stamp file beside it
    recording its recipe (a file with a matching stamp is not rewritten)."""
    out = demo.install(models_dir, output_dir, seed=seed, force=force, datasets_dir=datasets_dir)
    if with_sd15:
        path = Path(models_dir) / "diffusion_models" / TINY_SD15_UNET_NAME
        stamp = hashlib.sha256(Path(__file__).read_bytes() + f"{seed}".encode()).hexdigest()[:16]
        stamp_file = path.with_name(path.name + ".stamp")
        if force or not path.is_file() or not stamp_file.is_file() or stamp_file.read_text() != stamp:
            save_tiny_sd15_unet(path, seed=seed)
            demo.write_atomically(stamp_file, lambda tmp: tmp.write_text(stamp))
        out["sd15"] = str(path)
    return out


def copy_cond(assets: Dict[str, str], base: "os.PathLike | str") -> None:
    """Copy the saved conditioning of ``assets`` (:func:`install_demo_assets`) into the ComfyUI base folder
    ``base`` where every tested ComfyUI's *Load Training Dataset* reads it: output/ (0.3.75, 0.14.1) and
    datasets/ (0.33.0)."""
    import shutil

    src = Path(assets.get("cond") or assets["cond_dataset"])
    for parent in ("output", "datasets"):
        shutil.copytree(src, Path(base) / parent / TINY_COND_FOLDER, dirs_exist_ok=True)


def tiny_wan_prompt(loader: dict, model_node: dict, seed: int, steps: int, prefix: str) -> dict:
    """The tiny demo as an API prompt: ``loader`` (node "1") -> ``model_node`` (node "5", its ``model`` input
    wired to "1") -> KSampler (cfg 2, the saved conditioning and its zeroed copy) -> SaveLatent under ``prefix``."""
    model_node = {**model_node, "inputs": {**model_node["inputs"], "model": ["1", 0]}}
    return {
        "1": loader,
        "2": {"class_type": "LoadTrainingDataset", "inputs": {"folder_name": TINY_COND_FOLDER}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 1]}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                  "batch_size": 1}},
        "5": model_node,
        "6": {"class_type": "KSampler", "inputs": {
            "model": ["5", 0], "positive": ["2", 1], "negative": ["3", 0], "latent_image": ["4", 0],
            "seed": seed, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
            "denoise": 1.0}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": prefix}},
    }


def write_tensor_specs() -> Path:
    """Rewrite demo/tiny_demo_tensors.json from the imported ComfyUI's classes."""
    path = Path(demo.TENSORS_FILE)
    data = {"about": "names and shapes of the tiny demo's tensors, from ComfyUI's Wan 2.1 classes; written by "
                     "devtools/e2e_assets.py --write-tensors, checked by tests/comfy/test_tiny_demo_files.py",
            "tensors": comfyui_tensor_specs()}
    path.write_text(json.dumps(data, separators=(",", ":")).replace('],["', '],\n["') + "\n", encoding="utf-8")
    return path


def main(argv: Optional[list] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write the tiny demo/test assets into a ComfyUI base folder.")
    ap.add_argument("--base", help="ComfyUI base folder (holds models/, output/ and datasets/)")
    ap.add_argument("--no-sd15", action="store_true", help="skip the tiny SD1.5 UNet (only the tests need it)")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--write-tensors", action="store_true",
                    help="only rewrite demo/tiny_demo_tensors.json from this ComfyUI's classes")
    a = ap.parse_args(argv)
    if a.write_tensors:
        print(f"wrote {write_tensor_specs()}")
        return 0
    if not a.base:
        ap.error("--base is required")
    base = Path(a.base).resolve()
    res = install_demo_assets(base / "models", base / "output", with_sd15=not a.no_sd15, force=a.force,
                              datasets_dir=base / "datasets")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
