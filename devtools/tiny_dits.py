"""Tiny random-weight DiTs built from ComfyUI's OWN model classes, for tests, demos and benchmarks on a CPU.

Each family (``TINY_FAMILIES``: wan21, flux, qwen_image, hunyuan_video, sd3, lumina2, ltxv) builds a real
``comfy.model_patcher.ModelPatcher`` (what ``comfy.sd.load_diffusion_model`` returns) with float32 weights on
ComfyUI's offload device, filled from a fixed seed: two builds with the same seed are bitwise equal, and four Euler
steps take well under a second. The tiny Wan 2.1 has the shapes ComfyUI's detector understands, so
:func:`save_tiny_wan21` writes a file that ``comfy.sd.load_diffusion_model`` loads as Wan 2.1 t2v with the same
weights; the other families use dims detection would not recover, so they exist only in-process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..demo.install_tiny_demo import random_weights
from .comfy_env import import_comfyui, with_fields_this_comfyui_needs

Conditioning = List[List[Any]]  # ComfyUI CONDITIONING: [[cross_attn_tensor, {"pooled_output": ..., ...}], ...]

# Tokens of the tiny text conditionings.
TEXT_TOKENS = 8


# --------------------------------------------------------------------------------------------------- weights

@torch.no_grad()
def init_tiny_weights(module: torch.nn.Module, seed: int, buffers: Sequence[str] = ()) -> torch.nn.Module:
    """Fill every parameter of ``module`` (and the named ``buffers``) deterministically from ``seed``, by the rule
    the shipped demo writer fills its files with (demo/install_tiny_demo.py ``random_weights``: in sorted name
    order from one generator, so the result depends only on ``seed`` and the names and shapes). ComfyUI's ops skip
    weight init, so a freshly built model holds whatever ``torch.empty`` returned."""
    tensors = dict(module.named_parameters())
    all_buffers = dict(module.named_buffers())
    for b in buffers:
        if b not in all_buffers:
            raise KeyError(f"init_tiny_weights: no buffer {b!r} on {type(module).__name__}")
        tensors[b] = all_buffers[b]
    values = random_weights([(name, list(t.shape)) for name, t in tensors.items()], seed)
    for name, t in tensors.items():
        t.copy_(values[name].to(dtype=t.dtype, device=t.device))
    return module


# --------------------------------------------------------------------------------------------------- builders

def model_config_for(env, config_cls_name: str, unet_config: Dict[str, Any], dtype: torch.dtype):
    """``comfy.supported_models.<config_cls_name>`` over ``unet_config`` (with the fields this ComfyUI needs), as
    ComfyUI's loader makes it, computing in ``dtype``."""
    cfg_cls = getattr(env.supported_models, config_cls_name)
    unet_config = with_fields_this_comfyui_needs({**cfg_cls.unet_config, **unet_config})
    if not cfg_cls.matches(unet_config):
        raise ValueError(f"{config_cls_name}.matches() rejects the config {unet_config}")
    model_config = cfg_cls(unet_config)
    model_config.set_inference_dtype(dtype, None)
    return model_config


def _build(config_cls_name: str, unet_config: Dict[str, Any], seed: int, dtype: torch.dtype,
           buffers: Sequence[str] = ()):
    """Instantiate ``comfy.supported_models.<config_cls_name>(unet_config)`` the way
    ``comfy.sd.load_diffusion_model_state_dict`` does, fill the weights from ``seed`` and wrap it in a ModelPatcher."""
    env = import_comfyui()
    mm = env.model_management
    model_config = model_config_for(env, config_cls_name, unet_config, dtype)

    model = model_config.get_model({}, "").to(mm.unet_offload_device())
    init_tiny_weights(model.diffusion_model, seed, buffers=buffers)
    model.eval()
    return env.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                          offload_device=mm.unet_offload_device())


#: Wan 2.1 t2v as ComfyUI's detector reads it back from a file: num_heads = dim // 128, text_dim fixed at 4096.
WAN21_TINY_CONFIG: Dict[str, Any] = dict(
    image_model="wan2.1", model_type="t2v",
    dim=256, num_heads=2, ffn_dim=512, num_layers=4, text_dim=4096,
    in_dim=16, out_dim=16, freq_dim=256, patch_size=(1, 2, 2), window_size=(-1, -1),
    qk_norm=True, cross_attn_norm=True, eps=1e-6,
)


def build_wan21(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Tiny Wan 2.1 t2v (4 ``blocks``, dim 256, 2 heads, text_dim 4096). Latent [B, 16, T, H, W]."""
    return TINY_FAMILIES["wan21"].build(seed, dtype)


# --------------------------------------------------------------------------------------------------- file round trip

def tiny_wan21_state_dict(seed: int = 0) -> Dict[str, torch.Tensor]:
    """The weights of :func:`build_wan21` (keys as in the official checkpoints: ``blocks.0.self_attn.q.weight``,
    ``head.modulation``, ...), float32, on the CPU."""
    sd = build_wan21(seed=seed).model.diffusion_model.state_dict()
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_safetensors(sd: Dict[str, torch.Tensor], path: "os.PathLike | str", metadata: Dict[str, str]) -> str:
    import safetensors.torch

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    safetensors.torch.save_file(sd, path, metadata=metadata)
    return path


def save_tiny_wan21(path: "os.PathLike | str", seed: int = 0) -> str:
    """The tiny Wan 2.1 as a ``.safetensors`` diffusion model, which ``comfy.sd.load_diffusion_model`` (the
    UNETLoader node) detects as Wan 2.1 t2v. Returns the path."""
    return save_safetensors(tiny_wan21_state_dict(seed), path, {"layerwise_offload": "tiny wan2.1 t2v test model"})


# --------------------------------------------------------------------------------------------------- conditioning

def _cond_factory(context_dim: int, pooled_dim: Optional[int] = None, guidance: Optional[float] = None,
                  tokens: int = TEXT_TOKENS, attention_mask: bool = False
                  ) -> Callable[[int], Tuple[Conditioning, Conditioning]]:
    def make(seed: int = 0) -> Tuple[Conditioning, Conditioning]:
        gen = torch.Generator(device="cpu").manual_seed(int(seed) + 1_000_003)
        out = []
        for _ in range(2):  # positive, negative
            extra: Dict[str, Any] = {}
            ctx = torch.randn((1, tokens, context_dim), generator=gen, dtype=torch.float32)
            if pooled_dim is not None:
                extra["pooled_output"] = torch.randn((1, pooled_dim), generator=gen, dtype=torch.float32)
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
    """One tiny model family: its ComfyUI config class and tiny ``unet_config``, the ``latent_shape`` to sample,
    ``conditioning(seed=0) -> (positive, negative)`` CONDITIONING lists with the right dims, and the names of its
    block lists on ``patcher.model.diffusion_model`` in call order, with their lengths."""
    name: str
    comfy_config: str  # class name in comfy.supported_models
    unet_config: Dict[str, Any]
    latent_shape: Tuple[int, ...]
    conditioning: Callable[..., Tuple[Conditioning, Conditioning]]
    block_lists: Tuple[str, ...]
    block_counts: Tuple[int, ...]
    notes: str = ""
    buffers: Tuple[str, ...] = ()  # buffers ComfyUI leaves as torch.empty, filled from the seed too

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        return _build(self.comfy_config, self.unet_config, seed, dtype, self.buffers)

    @property
    def num_blocks(self) -> int:
        return sum(self.block_counts)


TINY_FAMILIES: Dict[str, TinyFamily] = {f.name: f for f in (
    TinyFamily("wan21", "WAN21_T2V", WAN21_TINY_CONFIG, (1, 16, 2, 8, 8), _cond_factory(4096), ("blocks",), (4,),
               "T5 context 4096 (as detected from files)"),
    TinyFamily("flux", "Flux", dict(
        image_model="flux", guidance_embed=True, in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
        hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=3, axes_dim=[8, 12, 12],
        theta=10000, patch_size=2, qkv_bias=True,
    ), (1, 16, 16, 16), _cond_factory(64, pooled_dim=32, guidance=3.5), ("double_blocks", "single_blocks"), (2, 3),
        "hidden 64, 2 heads, T5 context 64, pooled 32, guidance 3.5 in the conditioning"),
    TinyFamily("qwen_image", "QwenImage", dict(
        image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=3, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=64, axes_dims_rope=(8, 12, 12),
    ), (1, 16, 1, 16, 16), _cond_factory(64), ("transformer_blocks",), (3,),
        "2 heads of 32, text 64; 5-D latent with T=1 (Wan 2.1 latent format)"),
    TinyFamily("hunyuan_video", "HunyuanVideo", dict(
        image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
        hidden_size=64, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[8, 12, 12], theta=256,
        patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
        use_cond_type_embedding=False, vision_in_dim=None,
    ), (1, 16, 2, 8, 8), _cond_factory(64, pooled_dim=32, guidance=6.0), ("double_blocks", "single_blocks"), (2, 2),
        "hidden 64, 2 heads, text 64, pooled 32, guidance 6.0"),
    TinyFamily("sd3", "SD3", dict(
        in_channels=16, out_channels=16, patch_size=2, depth=2, num_blocks=3, input_size=None, adm_in_channels=32,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 64, "out_features": 128}},
        num_patches=256, pos_embed_max_size=16, pos_embed_scaling_factor=None, qk_norm="rms",
        x_block_self_attn_layers=[],
    ), (1, 16, 16, 16), _cond_factory(64, pooled_dim=32), ("joint_blocks",), (3,),
        "MMDiT, hidden 128 = 64 * depth 2, 2 heads, context 64, pooled 32 (adm_in_channels)", ("pos_embed",)),
    TinyFamily("lumina2", "Lumina2", dict(
        image_model="lumina2", patch_size=2, in_channels=16, dim=64, n_layers=3, n_refiner_layers=2, n_heads=2,
        n_kv_heads=1, multiple_of=16, ffn_dim_multiplier=4.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=64,
        axes_dims=[8, 12, 12], axes_lens=[300, 512, 512], rope_theta=10000.0,
    ), (1, 16, 16, 16), _cond_factory(64), ("context_refiner", "noise_refiner", "layers"), (2, 2, 3),
        "context_refiner runs on the text first, then noise_refiner on the image, then layers"),
    TinyFamily("ltxv", "LTXV", dict(
        image_model="ltxv", in_channels=128, cross_attention_dim=64, attention_head_dim=32, num_attention_heads=2,
        caption_channels=64, num_layers=3,
    ), (1, 128, 2, 4, 4), _cond_factory(64, attention_mask=True), ("transformer_blocks",), (3,),
        "T5 context 64 with an integer attention mask; scale_shift_table parameters on the blocks and the model "
        "beside child modules (non-leaf), which ComfyUI's own load never patches"),
)}


def build_tiny(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """``TINY_FAMILIES[family].build(seed=seed, dtype=dtype)`` with a helpful error for unknown names."""
    if family not in TINY_FAMILIES:
        raise KeyError(f"unknown tiny family {family!r}; known: {sorted(TINY_FAMILIES)}")
    return TINY_FAMILIES[family].build(seed=seed, dtype=dtype)


def make_conditioning(family: str, seed: int = 0) -> Tuple[Conditioning, Conditioning]:
    """``(positive, negative)`` CONDITIONING for ``family``, random from ``seed``."""
    return TINY_FAMILIES[family].conditioning(seed)


def _family_of(patcher) -> Optional[str]:
    """The tiny family whose ComfyUI config class built ``patcher``, or None."""
    name = type(patcher.model.model_config).__name__
    return next((f.name for f in TINY_FAMILIES.values() if f.comfy_config == name), None)


def block_lists(patcher, family: Optional[str] = None) -> Dict[str, torch.nn.ModuleList]:
    """The block lists of a tiny model's diffusion model, ``{attribute: ModuleList}`` in call order. ``family``
    defaults to the one whose ComfyUI config class built ``patcher``."""
    family = family or _family_of(patcher)
    if family is None:
        raise KeyError(f"no tiny family for ComfyUI config {type(patcher.model.model_config).__name__}")
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
    ``latent`` (a tensor, a shape, or None: the family's ``latent_shape``, zeros) and ``positive``/``negative`` (the
    family's conditioning from ``seed``) default from ``family``, the one that built ``patcher`` unless given. Noise
    comes from ``comfy.sample.prepare_noise(latent, seed)``, as in the KSampler node; ``cfg`` 2.0 runs both cond
    and uncond (at 1.0 ComfyUI skips the negative)."""
    env = import_comfyui()
    family = family or _family_of(patcher)
    if family is None and (latent is None or positive is None or negative is None):
        raise ValueError("sample(): pass latent=, positive= and negative= for a model that is not a tiny family")
    if latent is None:
        latent = TINY_FAMILIES[family].latent_shape
    if not isinstance(latent, torch.Tensor):
        latent = torch.zeros(tuple(latent), dtype=torch.float32)
    if positive is None or negative is None:
        pos, neg = TINY_FAMILIES[family].conditioning(seed)
        positive, negative = pos if positive is None else positive, neg if negative is None else negative
    latent = env.sample.fix_empty_latent_channels(patcher, latent)
    noise = env.sample.prepare_noise(latent, seed)
    return env.sample.sample(
        patcher, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
        denoise=denoise, callback=callback, disable_pbar=True, seed=seed,
    )
