#!/usr/bin/env bash
# Set up the environments (fast when nothing changed), then run pytest on every tested ComfyUI.
#   bash scripts/test.sh                      # all of tests/, on ComfyUI 0.3.75 and then on 0.14.1
#   bash scripts/test.sh tests/comfy -x -q    # extra arguments go to pytest; a path replaces the default tests/
#   COMFYUI_VERSIONS=0.14.1 bash scripts/test.sh tests/comfy   # one version only
#   COMFYUI_PATH=/my/ComfyUI bash scripts/test.sh              # your own ComfyUI instead (one run, in .venv)
# Every version runs even when an earlier one failed; the exit status is non-zero if any failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Default to tests/ unless a path (or node id) was given.
has_path=0
for a in "$@"; do
    [[ "$a" != -* && -e "${a%%::*}" ]] && has_path=1
done
args=("$@")
if [[ $has_path == 0 ]]; then args=(tests "$@"); fi

run_pytest() {  # venv-dir, then ComfyUI folder
    # -P: do not put the current folder (the repo root) on sys.path; its nodes/ would shadow ComfyUI's `nodes`.
    COMFYUI_PATH="$2" "$1/bin/python" -P -m pytest "${args[@]}"
}

if [[ -n "${COMFYUI_PATH:-}" ]]; then
    bash scripts/setup_env.sh
    # End-to-end extras: Debian Chromium + Playwright (Python) for tests/e2e/test_browser.py.
    bash scripts/install_browser.sh
    exec "$ROOT/.venv/bin/python" -P -m pytest "${args[@]}"
fi

read -r -a versions <<< "${COMFYUI_VERSIONS:-0.3.75 0.14.1}"
declare -A venv_of=([0.3.75]=.venv [0.14.1]=.venv-0.14.1)
declare -A comfy_of=([0.3.75]=.comfyui/ComfyUI [0.14.1]=.comfyui/ComfyUI-0.14.1)
for v in "${versions[@]}"; do
    [[ -n "${venv_of[$v]:-}" ]] || { echo "[layerwise-offload] ERROR: COMFYUI_VERSIONS names $v; tested versions are 0.3.75 and 0.14.1" >&2; exit 2; }
    COMFYUI_VERSION="$v" bash scripts/setup_env.sh
    VENV="${venv_of[$v]}" bash scripts/install_browser.sh
done

failed=()
summary=()
for v in "${versions[@]}"; do
    echo "[layerwise-offload] ===== tests on ComfyUI $v (${venv_of[$v]}, ${comfy_of[$v]}) ====="
    status=0
    run_pytest "$ROOT/${venv_of[$v]}" "$ROOT/${comfy_of[$v]}" || status=$?
    summary+=("ComfyUI $v: pytest exit $status")
    [[ $status == 0 ]] || failed+=("$v")
done
# The newest frontend (PyPI comfyui-frontend-package, served with --front-end-root) over ComfyUI 0.14.1: the Stats
# node's browser tests (what a person sees of the pack: the picture at the opening zoom, the hints), when the whole
# suite (no path given) ran on 0.14.1. FRONTEND_158=0 leaves it out. test_browser.py's older checks (node search,
# missing-node detection) are written against the pinned frontends 1.32 and 1.39.
if [[ $has_path == 0 && " ${versions[*]} " == *" 0.14.1 "* && "${FRONTEND_158:-1}" != 0 ]]; then
    echo "[layerwise-offload] ===== Stats node browser tests on ComfyUI 0.14.1 with frontend 1.58.1 ====="
    status=0
    static="$(bash scripts/install_frontend.sh | tail -n 1)" || status=$?
    if [[ $status == 0 ]]; then
        args=(tests/e2e/test_browser_stats.py "$@")
        LAYERWISE_OFFLOAD_FRONTEND_ROOT="$static" run_pytest "$ROOT/.venv-0.14.1" "$ROOT/.comfyui/ComfyUI-0.14.1" \
            || status=$?
    fi
    summary+=("ComfyUI 0.14.1 + frontend 1.58.1 (browser): pytest exit $status")
    [[ $status == 0 ]] || failed+=("0.14.1+frontend-1.58.1")
fi
for line in "${summary[@]}"; do echo "[layerwise-offload] $line"; done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "[layerwise-offload] FAILED on ComfyUI ${failed[*]}" >&2
    exit 1
fi
