"""Files a real ComfyUI server needs to run the tiny demo and the end-to-end tests, written with ComfyUI's own classes.

A Wan graph normally needs a UMT5-XXL text encoder (5.7B parameters, fixed size: ComfyUI reads no size from the
file) and a Wan VAE. Neither exists at tiny size in a form ComfyUI 0.3.75 detects, except the VAE, so:

* **Conditioning without a text encoder.** ComfyUI 0.3.75 has exactly one core node that produces CONDITIONING from
  nothing but a file: ``LoadTrainingDataset`` (comfy_extras/nodes_dataset.py, "experimental"). It ``torch.load``\\s
  (``weights_only=True``) every ``shard_*.pkl`` in ``<output>/<folder_name>/`` and returns lists of latents and
  conditionings. :func:`write_conditioning_dataset` writes one shard holding one T5-shaped conditioning
  ``[1, tokens, 4096]`` (what CLIPLoader type "wan" + CLIPTextEncode would give). The demo workflow takes the
  positive from it and the negative from ``ConditioningZeroOut``. (``LotusConditioning`` also takes no input, but
  its context is 1024 wide and Wan's ``text_embedding`` expects 4096.)
* **A tiny Wan 2.1 VAE.** ComfyUI reads the Wan 2.1 VAE width from ``decoder.head.0.gamma`` (comfy/sd.py), so a
  random ``comfy.ldm.wan.vae.WanVAE(dim=8)`` is detected by ``VAELoader``; ``VAEDecode`` turns the tiny latent into
  frames (noise, but real frames) that ``SaveImage`` shows in the browser.
* **A model that is not a DiT**, for the error path: an SD1.5-family UNet (``comfy.supported_models.SD15``: model
  channels 320 and context 768 are fixed by the matcher, depth is read from the file) with one level, one res block
  and one transformer block: ~17M parameters, detected by ``UNETLoader`` as SD1.5 (``BaseModel`` / ``UNetModel``).

The tiny Wan 2.1 DiT itself comes from :func:`devtools.tiny_dits.save_tiny_wan21`.

Command line (used by scripts/run.sh)::

    python -P devtools/e2e_assets.py --base <ComfyUI base folder>     # models/ and output/ under it

Everything is deterministic (fixed seeds) and skipped when the file already exists with the same recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Dict, Optional

if __package__ in (None, ""):  # run as a script: register the repo as the package `layerwise_offload`, re-enter
    import importlib.util as _ilu

    _p = Path(__file__).resolve().parent / "comfy_env.py"
    _spec = _ilu.spec_from_file_location("_lwo_comfy_env", _p)
    _mod = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.register_pack()
    from layerwise_offload.devtools import e2e_assets as _real

    sys.exit(_real.main())

import torch

from .comfy_env import import_comfyui

__all__ = [
    "TINY_WAN21_NAME",
    "TINY_WAN21_VAE_NAME",
    "TINY_SD15_UNET_NAME",
    "TINY_COND_FOLDER",
    "TINY_COND_TOKENS",
    "save_tiny_wan21_vae",
    "save_tiny_sd15_unet",
    "write_conditioning_dataset",
    "install_demo_assets",
    "tiny_wan_prompt",
    "main",
]

#: File names under models/diffusion_models, models/vae and output/ (what the tiny workflow and the tests refer to).
TINY_WAN21_NAME = "layerwise_offload_tiny_wan21.safetensors"
TINY_WAN21_VAE_NAME = "layerwise_offload_tiny_wan21_vae.safetensors"
TINY_SD15_UNET_NAME = "layerwise_offload_tiny_sd15_unet.safetensors"
TINY_COND_FOLDER = "layerwise_offload_tiny_wan21_cond"
TINY_COND_TOKENS = 8

_RECIPE_VERSION = "1"  # bump when a builder below changes, so install_demo_assets rewrites the files


def _init(module: torch.nn.Module, seed: int) -> None:
    from .tiny_dits import init_tiny_weights

    init_tiny_weights(module, seed)


def _save(sd: Dict[str, torch.Tensor], path: Path, what: str) -> str:
    import safetensors.torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # several test runs may write at once
    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    safetensors.torch.save_file(sd, str(tmp), metadata={"layerwise_offload": what})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return str(path)


def save_tiny_wan21_vae(path: "os.PathLike | str", seed: int = 0, dim: int = 8) -> str:
    """A random Wan 2.1 VAE of width ``dim`` (real: 96), as ``VAELoader`` expects it (keys ``decoder.head.0.gamma``,
    ``decoder.middle.0.residual.0.gamma``, ...). Latent 16 channels, x8 spatial, x4 temporal, like the real one."""
    import_comfyui()
    import comfy.ldm.wan.vae

    vae = comfy.ldm.wan.vae.WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                   temperal_downsample=[False, True, True], dropout=0.0)
    _init(vae, seed)
    # Norm gains near 1 and small weights keep the decoded frames in a sane range (it is still noise).
    return _save(vae.state_dict(), Path(path), "tiny random Wan 2.1 VAE (dim %d)" % dim)


def save_tiny_sd15_unet(path: "os.PathLike | str", seed: int = 0) -> str:
    """A tiny SD1.5-family UNet (not a DiT) that ``UNETLoader`` detects as ``SD15``: model_channels 320 and
    context_dim 768 (fixed by ComfyUI's matcher), one level, one res block, one transformer block (~17M params)."""
    env = import_comfyui()
    cfg_cls = env.supported_models.SD15
    unet_config = {
        **cfg_cls.unet_config,
        "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
        "in_channels": 4, "out_channels": 4, "num_res_blocks": [1], "channel_mult": [1],
        "transformer_depth": [1], "transformer_depth_output": [1, 1], "transformer_depth_middle": 1,
        "use_temporal_resblock": False,
    }
    model_config = cfg_cls(unet_config)
    model_config.set_inference_dtype(torch.float16, None)
    model = model_config.get_model({}, "")
    _init(model.diffusion_model, seed)
    return _save(model.diffusion_model.state_dict(), Path(path), "tiny SD1.5-family UNet (not a DiT)")


def write_conditioning_dataset(output_dir: "os.PathLike | str", folder: str = TINY_COND_FOLDER, seed: int = 0,
                               tokens: int = TINY_COND_TOKENS, context_dim: int = 4096) -> str:
    """Write ``<output_dir>/<folder>/shard_00000.pkl`` for the ``LoadTrainingDataset`` node: one sample, a zero
    latent ``[1, 16, 2, 8, 8]`` and a random T5-shaped conditioning ``[[tensor[1, tokens, context_dim], {}]]``.
    Returns the folder path."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + 7)
    ctx = torch.randn((1, tokens, context_dim), generator=gen, dtype=torch.float32)
    shard = {
        "latents": [{"samples": torch.zeros((1, 16, 2, 8, 8), dtype=torch.float32)}],
        "conditioning": [[[ctx, {}]]],
    }
    d = Path(output_dir) / folder
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"shard_00000.pkl.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        torch.save(shard, f)
    os.replace(tmp, d / "shard_00000.pkl")
    return str(d)


def _atomic(path: Path, save, seed: int) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save(tmp, seed=seed)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _stamp(seed: int) -> str:
    src = Path(__file__).read_bytes() + (Path(__file__).parent / "tiny_dits.py").read_bytes()
    return hashlib.sha256(src + f"{_RECIPE_VERSION}:{seed}".encode()).hexdigest()[:16]


def install_demo_assets(models_dir: "os.PathLike | str", output_dir: "os.PathLike | str", seed: int = 0,
                        with_sd15: bool = True, force: bool = False) -> Dict[str, str]:
    """Write every tiny asset into a ComfyUI layout and return ``{kind: path}``:

    - ``wan21``: ``<models_dir>/diffusion_models/layerwise_offload_tiny_wan21.safetensors`` (tiny_dits),
    - ``vae``: ``<models_dir>/vae/layerwise_offload_tiny_wan21_vae.safetensors``,
    - ``sd15``: ``<models_dir>/diffusion_models/layerwise_offload_tiny_sd15_unet.safetensors`` (if ``with_sd15``),
    - ``cond``: ``<output_dir>/layerwise_offload_tiny_wan21_cond/`` (for ``LoadTrainingDataset``).

    A stamp file next to each model records the recipe; files with a matching stamp are not rewritten."""
    from .tiny_dits import save_tiny_wan21

    models_dir, output_dir = Path(models_dir), Path(output_dir)
    stamp = _stamp(seed)
    jobs = {
        "wan21": (models_dir / "diffusion_models" / TINY_WAN21_NAME, lambda p: _atomic(p, save_tiny_wan21, seed)),
        "vae": (models_dir / "vae" / TINY_WAN21_VAE_NAME, lambda p: save_tiny_wan21_vae(p, seed=seed)),
    }
    if with_sd15:
        jobs["sd15"] = (models_dir / "diffusion_models" / TINY_SD15_UNET_NAME,
                        lambda p: save_tiny_sd15_unet(p, seed=seed))
    out: Dict[str, str] = {}
    for kind, (path, build) in jobs.items():
        stamp_file = path.with_name(path.name + ".stamp")
        if force or not path.is_file() or not stamp_file.is_file() or stamp_file.read_text() != stamp:
            build(path)
            tmp = stamp_file.with_name(f"{stamp_file.name}.{os.getpid()}.tmp")
            tmp.write_text(stamp)
            os.replace(tmp, stamp_file)
        out[kind] = str(path)
    out["cond"] = write_conditioning_dataset(output_dir, seed=seed)
    return out


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


def main(argv: Optional[list] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write the tiny demo/test assets into a ComfyUI base folder.")
    ap.add_argument("--base", required=True, help="ComfyUI base folder (holds models/ and output/)")
    ap.add_argument("--models-dir", help="models folder (default: <base>/models)")
    ap.add_argument("--output-dir", help="output folder (default: <base>/output)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sd15", action="store_true", help="skip the tiny SD1.5 UNet (only the tests need it)")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    base = Path(a.base).resolve()
    res = install_demo_assets(a.models_dir or base / "models", a.output_dir or base / "output", seed=a.seed,
                              with_sd15=not a.no_sd15, force=a.force)
    print(json.dumps(res, indent=1))
    return 0
