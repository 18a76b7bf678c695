"""Load Diffusion Model (Layerwise): ComfyUI's own loader, with the weights left in the safetensors file.

ComfyUI's UNETLoader reads the whole file into anonymous RAM (0.3.75 copies every tensor into the model's freshly
allocated parameters), so a DiT bigger than RAM cannot even load. This node hands ComfyUI's
``load_diffusion_model_state_dict`` a state dict of zero-copy views over a read-only private mapping of the file
(offload/disk/checkpoint.py). ComfyUI detects the model, picks dtypes and operations and builds its own model
class as always; its parameters are allocated but never written (untouched pages cost no RAM). Only the copy
step changes, and only while this node calls ComfyUI: where ComfyUI's default parameter loading would copy a
mapped tensor into a parameter of the same dtype and shape, the parameter becomes that tensor instead. A weight
ComfyUI converts (weight_dtype, a custom layer's own loading) is converted as before, and is then simply not
file-backed. The result is a plain ComfyUI model (bitwise equal to UNETLoader's); with the offload node after it
the streamed disk blocks are read from the file itself (host_store auto or disk).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

import comfy.sd
import folder_paths

from ..offload import CheckpointError, CheckpointFile, format_bytes, locate

log = logging.getLogger("layerwise_offload")

LOADER_NODE_ID = "LayerwiseOffloadLoadDiffusionModel"
LOADER_DISPLAY_NAME = "Load Diffusion Model (Layerwise)"
LOADER_CATEGORY = "model_patches/layerwise_offload"
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
LOADER_DESCRIPTION = (
    "Loads a diffusion model like Load Diffusion Model, but leaves its weights in the .safetensors file (mapped, "
    "read on use) instead of copying the whole model into RAM. Put Layerwise Offload (DiT) after it with "
    "host_store auto or disk to stream the blocks that do not fit in RAM straight from the file; alone it is an "
    "ordinary model. Other formats load as Load Diffusion Model does.")
LOADER_TOOLTIPS = {
    "unet_name": "A diffusion model from models/diffusion_models (the same list as Load Diffusion Model).",
    "weight_dtype": ("As in Load Diffusion Model. default keeps the file's dtype where ComfyUI does, and only those "
                     "weights stay in the file; an fp8 choice converts (and so copies) the weights it changes."),
}

_LOCK = threading.Lock()  # one scoped loading at a time: the hook below is process-wide while it is in place


def model_options_for(weight_dtype: str) -> dict:
    """UNETLoader's model_options for ``weight_dtype``."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"[layerwise-offload] weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, "
                         f"got {weight_dtype!r}")
    options = {}
    if weight_dtype.startswith("fp8_e4m3fn"):
        options["dtype"] = torch.float8_e4m3fn
        if weight_dtype == "fp8_e4m3fn_fast":
            options["fp8_optimizations"] = True
    elif weight_dtype == "fp8_e5m2":
        options["dtype"] = torch.float8_e5m2
    return options


def _assignable(param, value, checkpoint: CheckpointFile) -> bool:
    """Whether copying ``value`` into ``param`` would leave byte for byte the file's tensor: then it is taken."""
    if type(param) is not torch.nn.Parameter or type(value) is not torch.Tensor or param.device.type != "cpu":
        return False
    if param.dtype != value.dtype or tuple(param.shape) != tuple(value.shape):
        return False
    where = locate(value)
    return where is not None and where[0] == checkpoint.path


@contextlib.contextmanager
def weights_left_in(checkpoint: CheckpointFile):
    """While inside, PyTorch's default parameter loading takes a mapped tensor of ``checkpoint`` as the parameter
    instead of copying it (what ``load_state_dict(assign=True)`` does, for those tensors only). Layers with
    loading of their own are untouched; those that call the default for the rest get the same treatment."""
    original = torch.nn.Module._load_from_state_dict
    taken = [0]

    def load(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if local_metadata.get("assign_to_params_buffers", False):
            return original(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                            error_msgs)
        keep = {}
        for name, param in self._parameters.items():
            value = state_dict.get(prefix + name)
            if param is not None and value is not None and _assignable(param, value, checkpoint):
                keep[name] = (param, value)
        rest = {k: v for k, v in state_dict.items() if k[len(prefix):] not in keep} if keep else state_dict
        original(self, rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        for name, (param, value) in keep.items():
            with torch.inference_mode(param.is_inference()):
                if value.is_inference() != param.is_inference():
                    value = checkpoint.view_at(locate(value)[1], value.dtype, tuple(value.shape))
                self._parameters[name] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            if prefix + name in missing_keys:
                missing_keys.remove(prefix + name)
            taken[0] += 1

    with _LOCK:
        torch.nn.Module._load_from_state_dict = load
        try:
            yield taken
        finally:
            torch.nn.Module._load_from_state_dict = original


def load_diffusion_model_layerwise(path: str, model_options: dict, disable_dynamic: bool = False):
    """ComfyUI's load_diffusion_model for ``path``, with the weights ComfyUI keeps as they are left in the file.

    On ComfyUI 0.33+ with dynamic VRAM ComfyUI loads by assignment, and the model is a ModelPatcherDynamic over
    the same views. ``cached_patcher_init`` is set as core's loaders set it, so that ComfyUI can build the
    non-dynamic copy it asks for (``get_non_dynamic_delegate``, e.g. for hooked conditioning) by calling this
    again with ``disable_dynamic=True``."""
    dynamic_choice = {"disable_dynamic": True} if disable_dynamic else {}  # older ComfyUIs lack the argument
    if not path.lower().endswith((".safetensors", ".sft")):
        log.info("[layerwise-offload] %s is not a .safetensors file: loaded as Load Diffusion Model does", path)
        return comfy.sd.load_diffusion_model(path, model_options=model_options, **dynamic_choice)
    try:
        checkpoint = CheckpointFile(path)
    except CheckpointError as error:
        raise RuntimeError(f"{error}. Load it with Load Diffusion Model, or re-download the file.") from error
    state_dict = checkpoint.state_dict()
    file_bytes = sum(info.nbytes for info in checkpoint.tensors.values())
    with weights_left_in(checkpoint):
        model = comfy.sd.load_diffusion_model_state_dict(state_dict, model_options=model_options,
                                                          metadata=checkpoint.metadata or None, **dynamic_choice)
    if model is None:
        raise RuntimeError(f"[layerwise-offload] ERROR: Could not detect model type of: {path}\n"
                           f"{comfy.sd.model_detection_error_hint(path, state_dict)}")
    model.cached_patcher_init = (load_diffusion_model_layerwise, (path, model_options))
    in_file = [p for p in model.model.parameters() if locate(p) is not None]
    kept = sum(p.numel() * p.element_size() for p in in_file)
    log.info("[layerwise-offload] loaded %s: %d weights (%s of %s) left in the file, the rest in RAM",
             path, len(in_file), format_bytes(kept), format_bytes(file_bytes))
    return model


def load_layerwise(unet_name: str, weight_dtype: str = "default"):
    options = model_options_for(weight_dtype)
    path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
    return load_diffusion_model_layerwise(path, options)


def diffusion_model_names():
    return folder_paths.get_filename_list("diffusion_models")
