#!/usr/bin/env bash
# The ComfyUI side-by-side benchmark on a GPU, in one call, with no network (see bench/results/README.md).
#
#   bash bench/gpu_run.sh                # after bash bench/gpu_prep.sh here; the device call carries [".gpu"]
#
# Needs: python3 with torch (CUDA), numpy, scipy, einops, transformers, safetensors, psutil, pyyaml, pillow, tqdm
# (the H200 image has them), .gpu/ComfyUI (or COMFYUI_PATH) and .gpu/wheels (torchsde, trampoline).
# Environment: PRESETS (default flux,wan21_14b,qwen_image), STEPS (6), BUDGETS (0.3,0.5,0.7,0.9), DEVICE (cuda;
# cpu only to smoke-test this script: DEVICE=cpu PRESETS=tiny BUDGETS=0.9 PYTHON=.venv/bin/python),
# DEADLINE_S (layerwise sweep cut-off per preset, 90), TOTAL_S (hard limit for all presets, 480), PYTHON.
# Writes bench/results/gpu/ (CSV, summary CSV, meta JSON, PNG per preset, log) and, when $OUT is set (the device
# tool's output folder), $OUT/comfy_bench_gpu.tar.gz + the log + the summaries (within its 8-file limit).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
RESULTS="$ROOT/bench/results/gpu"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lwo_site \
        .gpu/wheels/*.whl || { echo "[gpu_run] could not install .gpu/wheels" >&2; exit 3; }
    export PYTHONPATH="/tmp/lwo_site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -z "${COMFYUI_PATH:-}" ]]; then
    if [[ -f .gpu/ComfyUI/main.py ]]; then export COMFYUI_PATH="$ROOT/.gpu/ComfyUI"; fi
fi

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1 || true
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    echo "COMFYUI_PATH=${COMFYUI_PATH:-<repo .comfyui/ComfyUI>}"
} 2>&1 | tee "$RESULTS/env.txt"

timeout --signal=INT --kill-after=20 "${TOTAL_S:-480}" \
    "$PY" -P bench/comfy_bench.py --device "${DEVICE:-cuda}" --preset "${PRESETS:-flux,wan21_14b,qwen_image}" \
        --steps "${STEPS:-6}" --budgets "${BUDGETS:-0.3,0.5,0.7,0.9}" --deadline-s "${DEADLINE_S:-90}" \
        --out "$RESULTS" 2>&1 | tee "$RESULTS/log.txt"
rc=${PIPESTATUS[0]}
echo "[gpu_run] exit status $rc" | tee -a "$RESULTS/log.txt"

if [[ -n "${OUT:-}" && -d "${OUT}" ]]; then
    tar -czf "$OUT/comfy_bench_gpu.tar.gz" -C "$ROOT/bench/results" gpu
    cp "$RESULTS/log.txt" "$OUT/"
    for f in "$RESULTS"/*_summary.csv; do [[ -f "$f" ]] && cp "$f" "$OUT/"; done
fi
exit "$rc"
