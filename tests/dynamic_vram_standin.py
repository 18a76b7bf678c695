"""ComfyUI 0.33+'s dynamic VRAM on a machine with no GPU, for tests: its own classes and load path, with only
comfy-aimdo's device set-up stood in.

On NVIDIA, ComfyUI's ``main.py`` initialises comfy-aimdo (``control.init()``, then ``control.init_devices(...)``
for each GPU) and, when that works, makes ``ModelPatcherDynamic`` the class every core loader builds
(``comfy.model_patcher.CoreModelPatcher``) and turns ``comfy.memory_management.aimdo_enabled`` on, which makes
``comfy.utils.load_torch_file`` map safetensors through aimdo's ``ModelMMAP`` and load the weights by assignment
(zero copy). :func:`dynamic_vram` does the same in-process:

* ``comfy_aimdo.control.init()`` is the real one (aimdo's library loads without a GPU; its file mapping and host
  buffers work on the CPU). ``init_devices`` is what needs a GPU: it is not called.
* ``ModelPatcherDynamic.__new__`` hands a CPU load device back to the classic ``ModelPatcher``, and
  ``partially_unload`` asserts the load device is not the CPU; the stand-in plays a GPU on the CPU (as the offload's
  CPU loopback does), so the reroute is lifted and an unload on the CPU does what ``partially_unload`` does with no
  VBAR (it restores the force-loaded backups). Everything else in the class runs as written: ``load()`` (its
  ``_load_list(for_dynamic=True)``, the LowVramPatch set-up, aimdo host buffers), ``clone(disable_dynamic=...,
  model_override=...)``, ``get_non_dynamic_delegate()``, ``detach``, ``__del__``.
* What cannot run: the VBAR (``_vbar_get`` returns None for a CPU device, so no module gets ``_v``) and with it
  the VBAR cast path in ``comfy.ops``. Without it ComfyUI casts every weight the classic way, and LoRA patches of a
  dynamic model (``weight_lowvram_function``, applied only on the VBAR path) are not applied: a dynamic run with a
  LoRA on this stand-in is not what a GPU computes, so tests compare LoRA runs against ComfyUI's non-dynamic run.

``dynamic_vram()`` is a context manager (tests); :func:`enable` is the same for a whole process (a test server's
custom node). Both refuse a ComfyUI without ``ModelPatcherDynamic``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

_saved = {}


def available() -> bool:
    """Whether this ComfyUI has dynamic VRAM that takes over core loaders (0.33+: ``clone(model_override=)``)."""
    import inspect

    import comfy.model_patcher as model_patcher
    dynamic = getattr(model_patcher, "ModelPatcherDynamic", None)
    if dynamic is None:
        return False
    return "model_override" in inspect.signature(model_patcher.ModelPatcher.clone).parameters


def init_library() -> None:
    """Load comfy-aimdo's library (no GPU needed: its host buffers and file mappings work on the CPU), which
    ``ModelPatcherDynamic.__init__`` uses for its pin state."""
    import comfy_aimdo.control

    if comfy_aimdo.control.lib is not None:
        return
    if not comfy_aimdo.control.init():
        raise RuntimeError("[layerwise-offload] comfy-aimdo's library did not load")
    # main.py initialises aimdo before anything imports its modules, which bind the library (and declare its
    # functions) at import: ComfyUI was imported first here, so they bind it now, in place.
    for name in ("host_buffer", "model_mmap", "model_vbar", "torch", "vram_buffer"):
        module = sys.modules.get(f"comfy_aimdo.{name}")
        if module is not None:
            importlib.reload(module)


def enable() -> None:
    """What ComfyUI's main.py does when comfy-aimdo finds a GPU, with the CPU as that GPU."""
    import comfy.memory_management as memory_management
    import comfy.model_patcher as model_patcher

    if not available():
        raise RuntimeError("[layerwise-offload] this ComfyUI has no dynamic VRAM to stand in for (needs 0.33+)")
    if _saved:
        return
    init_library()
    dynamic = model_patcher.ModelPatcherDynamic
    _saved.update(core=model_patcher.CoreModelPatcher, aimdo=memory_management.aimdo_enabled,
                  new=dynamic.__dict__["__new__"], partially_unload=dynamic.__dict__["partially_unload"])
    partially_unload = _saved["partially_unload"]

    def __new__(cls, *args, **kwargs):  # the CPU is the GPU here: no reroute to the classic patcher
        return model_patcher.ModelPatcher.__new__(cls)
    dynamic.__new__ = staticmethod(__new__)

    def unload_on_the_cpu(self, device_to, memory_to_free=0, force_patch_weights=False):
        if self.load_device.type != "cpu":
            return partially_unload(self, device_to, memory_to_free, force_patch_weights)
        assert not force_patch_weights
        return self.restore_loaded_backups()  # ComfyUI's own fallback when its VBAR frees too little
    dynamic.partially_unload = unload_on_the_cpu
    model_patcher.CoreModelPatcher = dynamic
    memory_management.aimdo_enabled = True


def disable() -> None:
    import comfy.memory_management as memory_management
    import comfy.model_patcher as model_patcher

    if not _saved:
        return
    model_patcher.ModelPatcherDynamic.__new__ = _saved["new"]
    model_patcher.ModelPatcherDynamic.partially_unload = _saved["partially_unload"]
    model_patcher.CoreModelPatcher = _saved["core"]
    memory_management.aimdo_enabled = _saved["aimdo"]
    _saved.clear()


@contextlib.contextmanager
def dynamic_vram():
    enable()
    try:
        yield
    finally:
        disable()
