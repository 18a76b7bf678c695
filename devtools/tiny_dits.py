"""Tiny random-weight DiTs built from ComfyUI's OWN model classes, for tests, demos and benchmarks on a CPU.

Each builder returns a real ``comfy.model_patcher.ModelPatcher`` (what ``comfy.sd.load_diffusion_model`` returns
and what a MODEL socket carries), with its weights on ComfyUI's offload device (the CPU), float32, filled from a
fixed seed: two builds with the same seed are bitwise equal, and four Euler steps take well under a second.

Families (``TINY_FAMILIES``) and the block lists their diffusion model has, in call order (DESIGN.md section 4):

=============== ================================ ====================================================
key             ComfyUI classes                  block lists (attribute on ``diffusion_model``)
=============== ================================ ====================================================
``wan21``       WAN21_T2V / model_base.WAN21     ``blocks`` (4)
``flux``        Flux / model_base.Flux           ``double_blocks`` (2), ``single_blocks`` (3)
``qwen_image``  QwenImage / model_base.QwenImage ``transformer_blocks`` (3)
``hunyuan_video`` HunyuanVideo / model_base.HunyuanVideo ``double_blocks`` (2), ``single_blocks`` (2)
``sd3``         SD3 / model_base.SD3             ``joint_blocks`` (3)
``lumina2``     Lumina2 / model_base.Lumina2     ``context_refiner`` (2), ``noise_refiner`` (2), ``layers`` (3)
``ltxv``        LTXV / model_base.LTXV           ``transformer_blocks`` (3); ``scale_shift_table`` on each block and on
                                                 the model itself (parameters of non-leaf modules)
=============== ================================ ====================================================

The tiny Wan 2.1 has the shapes ComfyUI's detector understands (dim 256 = 2 heads of 128, text_dim 4096, ffn 512),
so :func:`save_tiny_wan21` writes a ``.safetensors`` file that ``comfy.sd.load_diffusion_model`` loads as Wan 2.1
t2v, with the same weights as :func:`build_wan21`. The other families use dims that detection would not recover
(e.g. Flux detection fixes 24 heads), so they exist only in-process.

ComfyUI must be importable: this module calls :func:`.comfy_env.import_comfyui` (CPU mode) on first use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .comfy_env import import_comfyui, with_fields_this_comfyui_needs

__all__ = [
    "TinyFamily",
    "TINY_FAMILIES",
    "WAN21_TINY_CONFIG",
    "build_tiny",
    "build_wan21",
    "build_flux",
    "build_qwen_image",
    "build_hunyuan_video",
    "build_sd3",
    "build_lumina2",
    "build_ltxv",
    "save_tiny_wan21",
    "load_tiny_wan21",
    "make_conditioning",
    "block_lists",
    "sample",
    "init_tiny_weights",
]

Conditioning = List[List[Any]]  # ComfyUI CONDITIONING: [[cross_attn_tensor, {"pooled_output": ..., ...}], ...]

# Dims shared by the tiny text conditionings (real models: 4096 for T5, 3584 for Qwen2.5-VL, 768/2048 pooled).
TEXT_TOKENS = 8


# --------------------------------------------------------------------------------------------------- weights

def _is_norm_scale(name: str, t: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return t.ndim == 1 and leaf in ("weight", "scale")


@torch.no_grad()
def init_tiny_weights(module: torch.nn.Module, seed: int, buffers: Sequence[str] = ()) -> torch.nn.Module:
    """Fill every parameter of ``module`` (and the named ``buffers``) deterministically from ``seed``.

    ComfyUI's ops skip weight init (``comfy.ops.disable_weight_init``), so a freshly built model holds whatever
    ``torch.empty`` returned; this gives it well-scaled random weights instead: matrices ~ N(0, 1/fan_in),
    1-D norm weights/scales ~ 1 + N(0, 0.02), biases and other 1-D parameters ~ N(0, 0.02). Parameters are filled in
    sorted name order from one CPU generator, so the result depends only on ``seed`` and the parameter names/shapes.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    named = dict(module.named_parameters())
    all_buffers = dict(module.named_buffers())
    for b in buffers:
        if b not in all_buffers:
            raise KeyError(f"init_tiny_weights: no buffer {b!r} on {type(module).__name__}")
        named[b] = all_buffers[b]
    for name in sorted(named):
        t = named[name]
        if t.ndim >= 2:
            fan_in = math.prod(t.shape[1:])
            v = torch.randn(t.shape, generator=gen, dtype=torch.float32) * (fan_in ** -0.5)
        elif _is_norm_scale(name, t):
            v = 1.0 + 0.02 * torch.randn(t.shape, generator=gen, dtype=torch.float32)
        else:
            v = 0.02 * torch.randn(t.shape, generator=gen, dtype=torch.float32)
        t.copy_(v.to(dtype=t.dtype, device=t.device))
    return module


# --------------------------------------------------------------------------------------------------- builders

def _build(config_cls_name: str, unet_config: Dict[str, Any], seed: int, dtype: torch.dtype,
           buffers: Sequence[str] = ()):
    """Instantiate ``comfy.supported_models.<config_cls_name>(unet_config)`` the way
    ``comfy.sd.load_diffusion_model_state_dict`` does, fill the weights from ``seed`` and wrap it in a ModelPatcher."""
    env = import_comfyui()
    mm = env.model_management
    cfg_cls = getattr(env.supported_models, config_cls_name)
    unet_config = with_fields_this_comfyui_needs({**cfg_cls.unet_config, **unet_config})
    if not cfg_cls.matches(unet_config):
        raise AssertionError(f"{config_cls_name}.matches() rejects the tiny config {unet_config}")
    model_config = cfg_cls(unet_config)
    model_config.set_inference_dtype(dtype, None)

    load_device = mm.get_torch_device()
    offload_device = mm.unet_offload_device()
    model = model_config.get_model({}, "")
    model = model.to(offload_device)
    init_tiny_weights(model.diffusion_model, seed, buffers=buffers)
    model.eval()
    return env.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=offload_device)


#: Wan 2.1 t2v as ComfyUI's detector reads it back from a file: num_heads = dim // 128, text_dim fixed at 4096.
WAN21_TINY_CONFIG: Dict[str, Any] = dict(
    image_model="wan2.1", model_type="t2v",
    dim=256, num_heads=2, ffn_dim=512, num_layers=4, text_dim=4096,
    in_dim=16, out_dim=16, freq_dim=256, patch_size=(1, 2, 2), window_size=(-1, -1),
    qk_norm=True, cross_attn_norm=True, eps=1e-6,
)


def build_wan21(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny Wan 2.1 t2v (4 ``blocks``, dim 256, 2 heads, text_dim 4096). Latent [B, 16, T, H, W]."""
    return _build("WAN21_T2V", WAN21_TINY_CONFIG, seed, dtype)


def build_flux(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny Flux.1 dev (guidance embed; 2 ``double_blocks`` + 3 ``single_blocks``, hidden 64, 2 heads,
    T5 context 64, pooled 32). Latent [B, 16, H, W]."""
    return _build("Flux", dict(
        image_model="flux", guidance_embed=True,
        in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
        hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=3,
        axes_dim=[8, 12, 12], theta=10000, patch_size=2, qkv_bias=True,
    ), seed, dtype)


def build_qwen_image(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny Qwen-Image (3 ``transformer_blocks``, 2 heads of 32, text 64). Latent [B, 16, 1, H, W]."""
    return _build("QwenImage", dict(
        image_model="qwen_image",
        patch_size=2, in_channels=64, out_channels=16, num_layers=3,
        attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
        axes_dims_rope=(8, 12, 12),
    ), seed, dtype)


def build_hunyuan_video(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny HunyuanVideo (2 ``double_blocks`` + 2 ``single_blocks``, hidden 64, 2 heads, text 64, pooled 32,
    guidance embed). Latent [B, 16, T, H, W]."""
    return _build("HunyuanVideo", dict(
        image_model="hunyuan_video",
        in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
        hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2,
        axes_dim=[8, 12, 12], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
        guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
    ), seed, dtype)


def build_sd3(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny SD3 MMDiT (3 ``joint_blocks``, hidden 128 = 64 * depth 2, 2 heads, context 64, pooled 32).
    Latent [B, 16, H, W]. Its ``pos_embed`` buffer (``torch.empty`` in ComfyUI) is filled from the seed too."""
    return _build("SD3", dict(
        in_channels=16, out_channels=16, patch_size=2, depth=2, num_blocks=3,
        input_size=None, adm_in_channels=32,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 64, "out_features": 128}},
        num_patches=256, pos_embed_max_size=16, pos_embed_scaling_factor=None,
        qk_norm="rms", x_block_self_attn_layers=[],
    ), seed, dtype, buffers=("pos_embed",))


def build_lumina2(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny Lumina 2 NextDiT (2 ``context_refiner`` + 2 ``noise_refiner`` + 3 ``layers``, dim 64, 2 heads / 1 kv
    head, caption features 64). Latent [B, 16, H, W]."""
    return _build("Lumina2", dict(
        image_model="lumina2",
        patch_size=2, in_channels=16, dim=64, n_layers=3, n_refiner_layers=2,
        n_heads=2, n_kv_heads=1, multiple_of=16, ffn_dim_multiplier=4.0, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=64, axes_dims=[8, 12, 12], axes_lens=[300, 512, 512], rope_theta=10000.0,
    ), seed, dtype)


def build_ltxv(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny LTX-Video (3 ``transformer_blocks``, 2 heads of 32, T5 context 64 with an integer attention mask).
    Latent [B, 128, T, H, W]. Its blocks and the model hold ``scale_shift_table`` parameters beside child modules,
    which ComfyUI's own load never patches."""
    return _build("LTXV", dict(
        image_model="ltxv", in_channels=128, cross_attention_dim=64, attention_head_dim=32,
        num_attention_heads=2, caption_channels=64, num_layers=3,
    ), seed, dtype)


# --------------------------------------------------------------------------------------------------- file round trip

def save_tiny_wan21(path: "os.PathLike | str", seed: int = 0) -> str:
    """Write the tiny Wan 2.1 (:func:`build_wan21` with ``seed``) as a ``.safetensors`` diffusion model (keys as in
    the official checkpoints: ``blocks.0.self_attn.q.weight``, ``head.modulation``, ...), float32. Returns the path.
    ``comfy.sd.load_diffusion_model(path)`` (the UNETLoader node) detects it as Wan 2.1 t2v."""
    import safetensors.torch

    patcher = build_wan21(seed=seed)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    safetensors.torch.save_file(sd, path, metadata={"layerwise_offload": "tiny wan2.1 t2v test model"})
    return path


def load_tiny_wan21(path: "os.PathLike | str"):
    """Load a file written by :func:`save_tiny_wan21` through ``comfy.sd.load_diffusion_model`` (float32), the same
    path the UNETLoader node takes. Returns the ModelPatcher."""
    env = import_comfyui()
    patcher = env.sd.load_diffusion_model(os.fspath(path), model_options={"dtype": torch.float32})
    if patcher is None:
        raise RuntimeError(f"comfy.sd.load_diffusion_model did not recognise {path}")
    return patcher


# --------------------------------------------------------------------------------------------------- conditioning

def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def _cond_factory(context_dim: int, pooled_dim: Optional[int] = None, guidance: Optional[float] = None,
                  tokens: int = TEXT_TOKENS, attention_mask: bool = False
                  ) -> Callable[[int], Tuple[Conditioning, Conditioning]]:
    def make(seed: int = 0) -> Tuple[Conditioning, Conditioning]:
        gen = torch.Generator(device="cpu").manual_seed(int(seed) + 1_000_003)
        out = []
        for _ in range(2):  # positive, negative
            extra: Dict[str, Any] = {}
            ctx = _randn(gen, 1, tokens, context_dim)
            if pooled_dim is not None:
                extra["pooled_output"] = _randn(gen, 1, pooled_dim)
            if guidance is not None:
                extra["guidance"] = guidance
            if attention_mask:  # LTXV's T5 encoder hands one over; integer, as the model expects
                extra["attention_mask"] = torch.ones(1, tokens, dtype=torch.long)
            out.append([[ctx, extra]])
        return out[0], out[1]
    return make


# --------------------------------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class TinyFamily:
    """One tiny model family: ``build(seed=0, dtype=float32) -> ModelPatcher``, the ``latent_shape`` to sample,
    ``conditioning(seed=0) -> (positive, negative)`` CONDITIONING lists with the right dims, and the names of its
    block lists on ``patcher.model.diffusion_model`` in call order, with their lengths."""
    name: str
    build: Callable[..., Any]
    latent_shape: Tuple[int, ...]
    conditioning: Callable[..., Tuple[Conditioning, Conditioning]]
    block_lists: Tuple[str, ...]
    block_counts: Tuple[int, ...]
    comfy_config: str  # class name in comfy.supported_models
    notes: str = ""

    @property
    def num_blocks(self) -> int:
        return sum(self.block_counts)


TINY_FAMILIES: Dict[str, TinyFamily] = {
    f.name: f for f in (
        TinyFamily("wan21", build_wan21, (1, 16, 2, 8, 8), _cond_factory(4096),
                   ("blocks",), (4,), "WAN21_T2V", "T5 context 4096 (as detected from files)"),
        TinyFamily("flux", build_flux, (1, 16, 16, 16), _cond_factory(64, pooled_dim=32, guidance=3.5),
                   ("double_blocks", "single_blocks"), (2, 3), "Flux", "guidance 3.5 in the conditioning"),
        TinyFamily("qwen_image", build_qwen_image, (1, 16, 1, 16, 16), _cond_factory(64),
                   ("transformer_blocks",), (3,), "QwenImage", "5-D latent with T=1 (Wan 2.1 latent format)"),
        TinyFamily("hunyuan_video", build_hunyuan_video, (1, 16, 2, 8, 8),
                   _cond_factory(64, pooled_dim=32, guidance=6.0),
                   ("double_blocks", "single_blocks"), (2, 2), "HunyuanVideo", "pooled 32, guidance 6.0"),
        TinyFamily("sd3", build_sd3, (1, 16, 16, 16), _cond_factory(64, pooled_dim=32),
                   ("joint_blocks",), (3,), "SD3", "pooled 32 (adm_in_channels)"),
        TinyFamily("lumina2", build_lumina2, (1, 16, 16, 16), _cond_factory(64),
                   ("context_refiner", "noise_refiner", "layers"), (2, 2, 3), "Lumina2",
                   "context_refiner runs on the text first, then noise_refiner on the image, then layers"),
        TinyFamily("ltxv", build_ltxv, (1, 128, 2, 4, 4), _cond_factory(64, attention_mask=True),
                   ("transformer_blocks",), (3,), "LTXV", "scale_shift_table on blocks and model (non-leaf)"),
    )
}


def build_tiny(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """``TINY_FAMILIES[family].build(seed=seed, dtype=dtype)`` with a helpful error for unknown names."""
    try:
        fam = TINY_FAMILIES[family]
    except KeyError:
        raise KeyError(f"unknown tiny family {family!r}; known: {sorted(TINY_FAMILIES)}") from None
    return fam.build(seed=seed, dtype=dtype)


def make_conditioning(family: str, seed: int = 0) -> Tuple[Conditioning, Conditioning]:
    """``(positive, negative)`` CONDITIONING for ``family``, random from ``seed``."""
    return TINY_FAMILIES[family].conditioning(seed)


def block_lists(patcher, family: Optional[str] = None) -> Dict[str, torch.nn.ModuleList]:
    """The block lists of a tiny model's diffusion model, ``{attribute: ModuleList}`` in call order. ``family``
    defaults to the one whose ComfyUI config class built ``patcher``."""
    if family is None:
        cfg_name = type(patcher.model.model_config).__name__
        matches = [f for f in TINY_FAMILIES.values() if f.comfy_config == cfg_name]
        if not matches:
            raise KeyError(f"no tiny family for ComfyUI config {cfg_name}")
        family = matches[0].name
    dm = patcher.get_model_object("diffusion_model")
    out = {}
    for attr in TINY_FAMILIES[family].block_lists:
        lst = getattr(dm, attr, None)
        if not isinstance(lst, torch.nn.ModuleList):
            raise AttributeError(f"{type(dm).__name__} has no ModuleList {attr!r}")
        out[attr] = lst
    return out


# --------------------------------------------------------------------------------------------------- sampling

def sample(patcher, latent: "torch.Tensor | Sequence[int] | None" = None, seed: int = 0, steps: int = 4,
           positive: Optional[Conditioning] = None, negative: Optional[Conditioning] = None,
           cfg: float = 2.0, sampler_name: str = "euler", scheduler: str = "simple", denoise: float = 1.0,
           family: Optional[str] = None, callback=None) -> torch.Tensor:
    """Run ``comfy.sample.sample`` (what KSampler does, minus the node) and return the output latent tensor.

    ``latent``: a tensor (the starting latent, usually zeros), a shape, or None for the family's
    ``latent_shape`` of zeros. ``positive``/``negative`` default to ``TINY_FAMILIES[family].conditioning(seed)``.
    Noise comes from ``comfy.sample.prepare_noise(latent, seed)``, as in the KSampler node. ``cfg`` defaults to 2.0
    so both cond and uncond run (cfg == 1.0 makes ComfyUI skip the negative). ``family`` defaults to the one that
    built ``patcher`` (see :func:`block_lists`).
    """
    env = import_comfyui()
    if family is None:
        cfg_name = type(patcher.model.model_config).__name__
        matches = [f for f in TINY_FAMILIES.values() if f.comfy_config == cfg_name]
        family = matches[0].name if matches else None
    if latent is None or not isinstance(latent, torch.Tensor):
        if latent is None:
            if family is None:
                raise ValueError("sample(): pass latent= for a model that is not a tiny family")
            latent = TINY_FAMILIES[family].latent_shape
        latent = torch.zeros(tuple(latent), dtype=torch.float32)
    if positive is None or negative is None:
        if family is None:
            raise ValueError("sample(): pass positive= and negative= for a model that is not a tiny family")
        pos, neg = TINY_FAMILIES[family].conditioning(seed)
        positive = pos if positive is None else positive
        negative = neg if negative is None else negative
    latent = env.sample.fix_empty_latent_channels(patcher, latent)
    noise = env.sample.prepare_noise(latent, seed)
    return env.sample.sample(
        patcher, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
        denoise=denoise, callback=callback, disable_pbar=True, seed=seed,
    )
