"""ComfyUI layer of layerwise-offload: node classes, the ModelPatcher bridge, DiT block discovery."""
