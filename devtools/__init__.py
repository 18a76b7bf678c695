"""Developer tools for layerwise-offload: not loaded by ComfyUI, used by tests, demos and benchmarks.

- :mod:`.comfy_env`  finds and imports a real ComfyUI in-process (CPU mode), and registers this repository as the
  package ``layerwise_offload`` without running its ComfyUI entry point.
- :mod:`.tiny_dits`  builds tiny random-weight DiTs from ComfyUI's own model classes, and samples them.

Import it as ``layerwise_offload.devtools`` (tests/conftest.py registers the package; scripts call
``devtools/comfy_env.py``'s :func:`register_pack` first, see its docstring).
"""
