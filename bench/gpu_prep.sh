#!/usr/bin/env bash
# Prepare .gpu/ so that bench/gpu_run.sh can run on a GPU machine with torch but no ComfyUI and no network.
# Run it HERE (a machine with the dev environment and PyPI access), once:
#
#   bash bench/gpu_prep.sh
#
# It makes (all ignored by git through .git/info/exclude, never committed):
#   .gpu/ComfyUI/   a copy of the ComfyUI checkout ($COMFYUI_PATH or .comfyui/ComfyUI), minus its tests and model files (~23 MB)
#   .gpu/wheels/    wheels of what ComfyUI needs at import and the GPU image lacks: torchsde + trampoline
#                   (pure Python; the image already has torch, einops, transformers, safetensors, scipy, psutil,
#                   pyyaml, pillow, tqdm, aiohttp, matplotlib). The benchmark imports ComfyUI without its
#                   `nodes` module, so av, kornia, spandrel and the frontend are not needed.
# Then, on the GPU machine (device tool): carry [".gpu"], command "bash bench/gpu_run.sh".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SRC="${COMFYUI_PATH:-$ROOT/.comfyui/ComfyUI}"
[[ -f "$SRC/main.py" && -d "$SRC/comfy" ]] || { echo "no ComfyUI at $SRC (run scripts/setup_env.sh)" >&2; exit 1; }
PY="${PYTHON:-$ROOT/.venv/bin/python}"

mkdir -p .gpu
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

rm -rf .gpu/ComfyUI && mkdir -p .gpu/ComfyUI
tar -C "$SRC" --exclude=./tests --exclude=./tests-unit --exclude=./.git --exclude='__pycache__' \
    --exclude=./output --exclude=./temp --exclude=./user --exclude=./models -cf - . | tar -C .gpu/ComfyUI -xf -
mkdir -p .gpu/ComfyUI/models  # model files are not needed: the benchmark builds its models in-process
rm -f .gpu/ComfyUI/extra_model_paths.yaml

mkdir -p .gpu/wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d .gpu/wheels torchsde==0.2.6 trampoline==0.1.2
du -sh .gpu/ComfyUI .gpu/wheels
echo "[gpu_prep] ready: carry [\".gpu\"] and run: bash bench/gpu_run.sh"
