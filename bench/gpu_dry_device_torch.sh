#!/usr/bin/env bash
# The GPU run's dry run with the device image's Python and torch (3.12, torch 2.11) instead of this machine's venvs:
# proves that the pack, both ComfyUIs and every bench step import and run, bitwise, on that torch. Not part of the
# test suite: it downloads torch 2.11's CUDA wheels (about 4.6 GB in the venv) from PyPI.
#   bash bench/gpu_dry_device_torch.sh                 # venv in /tmp/lwo_venv312, results in /tmp/lwo_dry312
#   DEVICE_PYTHON_BIN=/usr/bin/python3.12 VENV=/x bash bench/gpu_dry_device_torch.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-/tmp/lwo_venv312}"
RESULTS="${RESULTS:-/tmp/lwo_dry312}"
PY312="${DEVICE_PYTHON_BIN:-$(command -v python3.12 || ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}"
[[ -x "$PY312" ]] || { echo "[gpu_dry] no Python 3.12 found: set DEVICE_PYTHON_BIN" >&2; exit 2; }
[[ -f .comfyui/ComfyUI/main.py && -f .comfyui/ComfyUI-0.33.0/main.py ]] \
    || { echo "[gpu_dry] no ComfyUI trees: run bash scripts/test.sh once" >&2; exit 2; }
if ! "$VENV/bin/python" -c 'import torch, torchaudio, comfy_aimdo' >/dev/null 2>&1; then
    "$PY312" -m venv "$VENV"
    # the device image's torch; torchvision and torchaudio built for it; both ComfyUIs' requirements
    "$VENV/bin/pip" install -q 'torch==2.11.0' 'torchvision==0.26.0' 'torchaudio==2.11.0'
    "$VENV/bin/pip" install -q numpy einops 'transformers>=4.50.3' tokenizers sentencepiece safetensors aiohttp yarl \
        pyyaml Pillow scipy tqdm psutil alembic SQLAlchemy filelock av requests simpleeval blake3 kornia spandrel \
        'pydantic~=2.0' 'pydantic-settings~=2.0' torchsde comfy-kitchen==0.2.31 comfy-aimdo==0.4.13 \
        'torch==2.11.0' 'torchvision==0.26.0' 'torchaudio==2.11.0'
fi
PYTHON="$VENV/bin/python" PYTHON_033="$VENV/bin/python" WORK="${WORK:-/tmp/lwo_gpu312}" RESULTS="$RESULTS" \
    bash bench/gpu_run.sh --dry-run
"$VENV/bin/python" - "$RESULTS/steps.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
bad = [r for r in rows if r["bitwise_equal_full"] != "True"]
print(f"[gpu_dry] {len(rows)} rows, {len(rows) - len(bad)} bitwise equal to the full load")
sys.exit(1 if bad or not rows else 0)
PY
