#!/usr/bin/env bash
# Prepare .gpu/ for bench/gpu_run.sh on a GPU machine with torch but no ComfyUI and no network. Run it HERE (the dev
# environment and PyPI), once: bash bench/gpu_prep.sh. It makes (ignored through .git/info/exclude; < 60 MiB):
#   .gpu/comfyui-0.3.75.tar.gz, .gpu/comfyui-0.14.1.tar.gz   the two ComfyUIs ($COMFYUI_PATH or .comfyui/ComfyUI;
#                                .comfyui/ComfyUI-0.14.1, else $COMFYUI_014_TARBALL), minus tests and model files
#   .gpu/wheels/                 torchsde + trampoline (pure Python; both ComfyUIs import them, the GPU image lacks them)
#   .gpu/wheels-0.14.1/          comfy-aimdo and comfy-kitchen as .venv-0.14.1 has them, for the device's Python
#                                ($DEVICE_PYTHON, 3.12), kitchen without its ROCm library (150 MB, loaded only under HIP)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SRC="${COMFYUI_PATH:-$ROOT/.comfyui/ComfyUI}"
SRC14="${COMFYUI_014_PATH:-$ROOT/.comfyui/ComfyUI-0.14.1}"
TARBALL14="${COMFYUI_014_TARBALL:-/work/shared/comfyui/ComfyUI-0.14.1.tar.gz}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PY14="${PYTHON_014:-$ROOT/.venv-0.14.1/bin/python}"
DEVICE_PYTHON="${DEVICE_PYTHON:-3.12}"
[[ -f "$SRC/main.py" && -d "$SRC/comfy" ]] || { echo "no ComfyUI at $SRC (run scripts/setup_env.sh)" >&2; exit 1; }

mkdir -p .gpu
EXCLUDE="$(git rev-parse --git-path info/exclude)"  # in a worktree .git is a file; this finds the real one
grep -qxF '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
rm -rf .gpu/ComfyUI  # the uncompressed copy of earlier versions of this script

pack_comfyui() {  # $1: ComfyUI folder, $2: tarball to write
    tar -C "$1" --exclude=./tests --exclude=./tests-unit --exclude=./.git --exclude='__pycache__' --exclude=./output \
        --exclude=./temp --exclude=./user --exclude=./models --exclude=./extra_model_paths.yaml -czf "$2" .
}
pack_comfyui "$SRC" .gpu/comfyui-0.3.75.tar.gz
if [[ -f "$SRC14/main.py" ]]; then
    pack_comfyui "$SRC14" .gpu/comfyui-0.14.1.tar.gz
else
    cp "$TARBALL14" .gpu/comfyui-0.14.1.tar.gz
fi

rm -rf .gpu/wheels .gpu/wheels-0.14.1 .gpu/peers && mkdir -p .gpu/wheels .gpu/wheels-0.14.1
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
    -d .gpu/wheels torchsde==0.2.6 trampoline==0.1.2
version_of() { "$PY14" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
AIMDO="$(version_of comfy-aimdo 0.6.0)"
KITCHEN="$(version_of comfy-kitchen 0.2.40)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels-0.14.1 "comfy-aimdo==$AIMDO" "comfy-kitchen==$KITCHEN"
"$PY" - .gpu/wheels-0.14.1/comfy_kitchen-*.whl <<'EOF'
import sys, zipfile, os
path = sys.argv[1]
drop = "comfy_kitchen/backends/hip/_C"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith(drop):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(True) if not line.startswith(drop.encode()))
        dst.writestr(item, data)
os.replace(path + ".tmp", path)
EOF
du -sh .gpu/* .gpu
size_mib=$(( $(du -sk .gpu | cut -f1) / 1024 ))
if (( size_mib >= 60 )); then echo "[gpu_prep] .gpu is ${size_mib} MiB, over the 60 MiB the device call can carry" >&2; exit 1; fi
echo "[gpu_prep] ready for a device Python $DEVICE_PYTHON: carry [\".gpu\"] and run: bash bench/gpu_run.sh"
