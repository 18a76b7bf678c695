#!/usr/bin/env bash
# Main job: set up everything, install this pack into ComfyUI, write a tiny demo model, start ComfyUI.
#
#   bash scripts/run.sh            # serve on http://127.0.0.1:${PORT:-8188} until Ctrl+C
#   bash scripts/run.sh --smoke    # start on a free port, run the tiny demo workflow once through the API, stop
#
# Steps (each one idempotent, fast when already done):
#   1. scripts/setup_env.sh: .venv (torch 2.14.1) + ComfyUI 0.3.75 in .comfyui/ComfyUI (or $COMFYUI_PATH)
#   2. a ComfyUI base folder of this pack, .comfyui/run/ (ComfyUI's --base-directory): custom_nodes/ holds a
#      link to this repository, models/ the tiny demo, output/ what the demo writes, user/ the UI settings
#   3. tiny demo assets (devtools/e2e_assets.py): a 4-block random Wan 2.1 DiT in models/diffusion_models, a tiny
#      random Wan 2.1 VAE in models/vae, and a saved T5-shaped conditioning in output/ (there is no tiny UMT5-XXL)
#   4. python main.py --base-directory .comfyui/run --listen ${LISTEN:-127.0.0.1} --port ${PORT:-8188}, with --cpu
#      and LAYERWISE_OFFLOAD_CPU_LOOPBACK=1 unless a CUDA GPU is usable (then the real GPU offload runs)
#
# COMFYUI_PATH=/path/to/ComfyUI runs that ComfyUI instead, in this pack's .venv and base folder: nothing is
# written into it (its models/ are read through --extra-model-paths-config; its own custom nodes are not loaded).
# Its requirements.txt is installed into this pack's .venv only with --install-comfyui-requirements.
#
# Environment: PORT, LISTEN, COMFYUI_PATH, FORCE_CPU=1 (--cpu even with a GPU), LAYERWISE_OFFLOAD_RUN_BASE (base
# folder, default .comfyui/run); extra arguments after `--` go to main.py (bash scripts/run.sh -- --verbose DEBUG).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { echo "[layerwise-offload] $*"; }
die() { echo "[layerwise-offload] ERROR: $*" >&2; exit 1; }

SMOKE=0
INSTALL_COMFY_REQS=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --smoke) SMOKE=1; shift ;;
        --install-comfyui-requirements) INSTALL_COMFY_REQS=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

# ---------------------------------------------------------------- 1. environment
PY="$ROOT/.venv/bin/python"
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    COMFY_DIR="$(cd "$COMFYUI_PATH" && pwd)"
else
    COMFY_DIR="$ROOT/.comfyui/ComfyUI"
fi
check_their_requirements() {
    # A user's ComfyUI: its requirements go into this pack's .venv only when asked (they may, e.g., pin another
    # frontend version than the one this .venv has).
    [[ -n "${COMFYUI_PATH:-}" && $INSTALL_COMFY_REQS == 0 && -x "$PY" ]] || return 0
    local missing
    if ! missing="$("$PY" -P devtools/missing_requirements.py "$COMFY_DIR/requirements.txt")"; then
        die "the ComfyUI at $COMFY_DIR needs packages that $ROOT/.venv lacks or has at other versions:
$missing
Run again with --install-comfyui-requirements to pip install them into $ROOT/.venv (never into your ComfyUI or
its Python; torch, torchvision and torchaudio are left out)."
    fi
}
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    [[ -f "$COMFY_DIR/requirements.txt" ]] && check_their_requirements  # before set-up: fail fast
    [[ $INSTALL_COMFY_REQS == 1 ]] || export LAYERWISE_OFFLOAD_SKIP_COMFYUI_REQUIREMENTS=1
fi
bash scripts/setup_env.sh
[[ -f "$COMFY_DIR/main.py" ]] || die "no ComfyUI at $COMFY_DIR"
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    if [[ $INSTALL_COMFY_REQS == 1 ]]; then
        log "installed the requirements of $COMFY_DIR/requirements.txt (without torch*) into $ROOT/.venv, as asked"
    elif [[ -f "$COMFY_DIR/requirements.txt" ]]; then
        check_their_requirements
    fi
    # Running another ComfyUI must not leave files in it: no bytecode caches either.
    export PYTHONDONTWRITEBYTECODE=1
fi

pip_q() {
    "$PY" -m pip --disable-pip-version-check install -q "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}

# ---------------------------------------------------------------- 2. the pack's own ComfyUI base folder
BASE="${LAYERWISE_OFFLOAD_RUN_BASE:-$ROOT/.comfyui/run}"
mkdir -p "$BASE"
BASE="$(cd "$BASE" && pwd)"
"$PY" -P devtools/server_cli.py prepare --base "$BASE"  # folders + custom_nodes/layerwise-offload -> this repository
# What ComfyUI Manager runs after cloning. The torch pin keeps any requirement from swapping ComfyUI's torch.
torch_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
pip_q -r "$ROOT/requirements.txt" "torch==$torch_version"
BASE_ARGS=(--base-directory "$BASE" --database-url "sqlite:///$BASE/user/comfyui.db")
if [[ -n "${COMFYUI_PATH:-}" ]]; then
    # The user's models stay visible, read in place.
    models_yaml="$BASE/extra_model_paths.yaml"
    {
        echo "# Written by scripts/run.sh: the models of $COMFY_DIR, read in place."
        echo "your_comfyui:"
        echo "    base_path: $COMFY_DIR/models"
        for d in "$COMFY_DIR"/models/*/; do
            [[ -d "$d" ]] && echo "    $(basename "$d"): $(basename "$d")"
        done
    } > "$models_yaml"
    BASE_ARGS+=(--extra-model-paths-config "$models_yaml")
    log "your ComfyUI at $COMFY_DIR runs with this pack's base folder $BASE (custom nodes, outputs, settings);"
    log "its models are read from $COMFY_DIR/models; nothing is written into $COMFY_DIR"
fi

# ---------------------------------------------------------------- 3. tiny demo assets
log "writing the tiny demo model, VAE and conditioning into $BASE/{models,output}"
"$PY" -P devtools/e2e_assets.py --base "$BASE" --no-sd15 >/dev/null

# ---------------------------------------------------------------- 4. start ComfyUI
DEVICE_ARGS=(--cpu)
DEVICE_WORDS="CPU (--cpu; LAYERWISE_OFFLOAD_CPU_LOOPBACK=1 runs the real offload manager on the CPU)"
if [[ "${FORCE_CPU:-0}" != 1 ]] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    DEVICE_ARGS=()
    DEVICE_WORDS="GPU $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
fi
export LAYERWISE_OFFLOAD_CPU_LOOPBACK=1
if ! "$PY" -c "import torchaudio" 2>/dev/null; then
    # No torchaudio build for this torch on the package index: ComfyUI then reports its audio node files as
    # "IMPORT FAILED" with a traceback at start. Everything else works.
    log "note: torchaudio is not installed (no build for torch $torch_version here), so ComfyUI will print"
    log "      'IMPORT FAILED' for its audio nodes (nodes_audio.py and a few others); nothing else is affected"
fi

if [[ $SMOKE == 1 ]]; then
    gpu_flag=()
    [[ ${#DEVICE_ARGS[@]} -eq 0 ]] && gpu_flag=(--gpu)
    log "smoke run on $DEVICE_WORDS: start ComfyUI, run the tiny demo workflow, stop"
    exec "$PY" -P devtools/server_cli.py smoke --comfyui "$COMFY_DIR" --base "$BASE" "${gpu_flag[@]}"
fi

PORT="${PORT:-8188}"
LISTEN="${LISTEN:-127.0.0.1}"
if "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(0 if s.connect_ex(('$LISTEN', $PORT)) == 0 else 1)" 2>/dev/null; then
    die "port $PORT on $LISTEN is already in use (another ComfyUI?). Stop it or run: PORT=8189 bash scripts/run.sh"
fi
URL_HOST="$LISTEN"
[[ "$LISTEN" == "0.0.0.0" ]] && URL_HOST=127.0.0.1
cat <<EOF
[layerwise-offload] ------------------------------------------------------------------------------------------
[layerwise-offload] ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$COMFY_DIR/comfyui_version.py") with layerwise-offload on $DEVICE_WORDS
[layerwise-offload] Open  http://$URL_HOST:$PORT  (ready when the log below says "To see the GUI go to")
[layerwise-offload] Then: click "Templates" in the left sidebar (same as the menu's "Browse Templates"), pick
[layerwise-offload]       EXTENSIONS > layerwise-offload > "A tiny demo - random 4-block Wan 2.1, ...", and
[layerwise-offload]       press Run. A 4-block random Wan 2.1 samples through Layerwise Offload (DiT); the Stats node
[layerwise-offload]       shows the run on itself, and the latent and 5 noise frames land in
[layerwise-offload]       $BASE/output/layerwise_offload/
[layerwise-offload] The other templates (Flux.1-dev, Wan 2.1 14B, Wan 2.2 A14B, Qwen-Image, HunyuanVideo) need the
[layerwise-offload] real model files; each has a note on choosing resident_layers. Ctrl+C stops ComfyUI.
[layerwise-offload] ------------------------------------------------------------------------------------------
EOF
cd "$COMFY_DIR"
exec "$PY" main.py "${BASE_ARGS[@]}" --listen "$LISTEN" --port "$PORT" "${DEVICE_ARGS[@]}" "${EXTRA[@]}"
