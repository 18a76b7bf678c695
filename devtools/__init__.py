"""Developer tools for layerwise-offload (tests, demos, benchmarks; not shipped, never loaded by ComfyUI). Import
it as ``layerwise_offload.devtools`` after ``devtools/comfy_env.py``'s ``enter_pack`` (tests/conftest.py does)."""
