#!/usr/bin/env bash
# Prepare .gpu/ for bench/gpu_run.sh on a GPU machine with Python 3.12 and torch but no ComfyUI and no network. Run it
# HERE (the dev environment and PyPI), once: bash bench/gpu_prep.sh. It makes (ignored through .git/info/exclude;
# < 60 MiB, checked):
#   .gpu/comfyui-0.3.75.tar.gz, .gpu/comfyui-0.33.0.tar.gz   the two ComfyUIs ($COMFYUI_PATH or .comfyui/ComfyUI;
#                                .comfyui/ComfyUI-0.33.0, else $COMFYUI_033_TARBALL), minus tests and model files
#   .gpu/wheels/                 torchsde + trampoline (pure Python; both ComfyUIs import them, the GPU image lacks them)
#   .gpu/wheels-0.33.0/          comfy-aimdo and comfy-kitchen as .venv-0.33.0 has them, for the device's Python
#                                ($DEVICE_PYTHON, 3.12), without their ROCm libraries (kitchen's is 150 MB; loaded only
#                                under HIP); kitchen's CUDA library (172 MB, 47 MB deflated) stored and the wheel xz'd
#                                (.whl.xz, 21 MB; gpu_run.sh unpacks it with Python's lzma)
#   .gpu/wheels-torchaudio/      torchaudio for the device's torch ($DEVICE_TORCHAUDIO, 2.11.*): 0.33's comfy.sd imports
#                                it; gpu_run.sh installs it only where the image has none (its compiled parts load only
#                                when an audio node runs)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SRC="${COMFYUI_PATH:-$ROOT/.comfyui/ComfyUI}"
SRC33="${COMFYUI_033_PATH:-$ROOT/.comfyui/ComfyUI-0.33.0}"
TARBALL33="${COMFYUI_033_TARBALL:-/work/shared/comfyui/ComfyUI-0.33.0.tar.gz}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
PY33="${PYTHON_033:-$ROOT/.venv-0.33.0/bin/python}"
DEVICE_PYTHON="${DEVICE_PYTHON:-3.12}"
DEVICE_TORCHAUDIO="${DEVICE_TORCHAUDIO:-2.11.*}"
[[ -f "$SRC/main.py" && -d "$SRC/comfy" ]] || { echo "no ComfyUI at $SRC (run scripts/setup_env.sh)" >&2; exit 1; }

mkdir -p .gpu
EXCLUDE="$(git rev-parse --git-path info/exclude)"  # in a worktree .git is a file; this finds the real one
grep -qxF '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
rm -rf .gpu/ComfyUI .gpu/comfyui-0.14.1.tar.gz .gpu/wheels-0.14.1  # what earlier versions of this script made

pack_comfyui() {  # $1: ComfyUI folder, $2: tarball to write
    tar -C "$1" --exclude=./tests --exclude=./tests-unit --exclude=./.git --exclude='__pycache__' --exclude=./output \
        --exclude=./temp --exclude=./user --exclude=./models --exclude=./extra_model_paths.yaml -czf "$2" .
}
pack_comfyui "$SRC" .gpu/comfyui-0.3.75.tar.gz
if [[ -f "$SRC33/main.py" ]]; then
    pack_comfyui "$SRC33" .gpu/comfyui-0.33.0.tar.gz
else  # upstream's source tarball has one top folder; gpu_run.sh wants ./main.py at the top, as pack_comfyui writes
    unpacked="$(mktemp -d)"
    tar -xzf "$TARBALL33" -C "$unpacked"
    top="$(find "$unpacked" -mindepth 1 -maxdepth 2 -name main.py -printf '%h\n' | head -1)"
    [[ -n "$top" ]] || { echo "no main.py in $TARBALL33" >&2; exit 1; }
    pack_comfyui "$top" .gpu/comfyui-0.33.0.tar.gz
    rm -rf "$unpacked"
fi

rm -rf .gpu/wheels .gpu/wheels-0.33.0 .gpu/wheels-torchaudio .gpu/peers
mkdir -p .gpu/wheels .gpu/wheels-0.33.0 .gpu/wheels-torchaudio
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
    -d .gpu/wheels torchsde==0.2.6 trampoline==0.1.2
version_of() { "$PY33" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
AIMDO="$(version_of comfy-aimdo 0.4.13)"
KITCHEN="$(version_of comfy-kitchen 0.2.31)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
    "${PLATFORMS[@]}" -d .gpu/wheels-0.33.0 "comfy-aimdo==$AIMDO" "comfy-kitchen==$KITCHEN"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
    "${PLATFORMS[@]}" -d .gpu/wheels-torchaudio "torchaudio==$DEVICE_TORCHAUDIO"
"$PY" - .gpu/wheels-0.33.0/*.whl <<'EOF'
import sys, zipfile, os
DROP = ("comfy_kitchen/backends/hip/_C", "comfy_aimdo/aimdo_rocm")  # loaded only under ROCm
STORE = "comfy_kitchen/backends/cuda/_C"  # stored, so xz over the whole wheel compresses it (47 -> 21 MB)
for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith(DROP):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                dropped = tuple(d.encode() for d in DROP)
                data = b"".join(line for line in data.splitlines(True) if not line.startswith(dropped))
            stored = item.filename.startswith(STORE)
            dst.writestr(item, data, zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
    os.replace(path + ".tmp", path)
EOF
xz -6 -T0 .gpu/wheels-0.33.0/comfy_kitchen-*.whl  # -> .whl.xz (minutes on two busy cores)
du -sh .gpu/* .gpu
size_mib=$(( $(du -sk .gpu | cut -f1) / 1024 ))
if (( size_mib >= 60 )); then echo "[gpu_prep] .gpu is ${size_mib} MiB, over the 60 MiB the device call can carry" >&2; exit 1; fi
echo "[gpu_prep] ready for a device Python $DEVICE_PYTHON: carry [\".gpu\"] and run: bash bench/gpu_run.sh"
