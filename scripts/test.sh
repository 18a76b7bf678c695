#!/usr/bin/env bash
# Set up the environments (fast when nothing changed), then run pytest on every tested ComfyUI.
#   bash scripts/test.sh                      # all of tests/, on ComfyUI 0.3.75 and 0.33.0 side by side
#   bash scripts/test.sh tests/comfy -x -q    # extra arguments go to pytest; a path replaces the default tests/
#   COMFYUI_VERSIONS=0.33.0 bash scripts/test.sh tests/comfy   # one version only (0.14.1 can be named too)
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

run_pytest() {  # venv-dir, ComfyUI folder, then pytest's arguments
    # -P: do not put the current folder (the repo root) on sys.path; its nodes/ would shadow ComfyUI's `nodes`.
    COMFYUI_PATH="$2" "$1/bin/python" -P -m pytest "${@:3}"
}

if [[ -n "${COMFYUI_PATH:-}" ]]; then
    bash scripts/setup_env.sh
    # End-to-end extras: Debian Chromium + Playwright (Python) for tests/e2e/test_browser.py.
    bash scripts/install_browser.sh
    exec "$ROOT/.venv/bin/python" -P -m pytest "${args[@]}"
fi

read -r -a versions <<< "${COMFYUI_VERSIONS:-0.3.75 0.33.0}"
declare -A venv_of=([0.3.75]=.venv [0.33.0]=.venv-0.33.0 [0.14.1]=.venv-0.14.1)
declare -A comfy_of=([0.3.75]=.comfyui/ComfyUI [0.33.0]=.comfyui/ComfyUI-0.33.0 [0.14.1]=.comfyui/ComfyUI-0.14.1)
for v in "${versions[@]}"; do
    [[ -n "${venv_of[$v]:-}" ]] || { echo "[layerwise-offload] ERROR: COMFYUI_VERSIONS names $v; tested versions are 0.3.75 and 0.33.0 (0.14.1 on request)" >&2; exit 2; }
    COMFYUI_VERSION="$v" bash scripts/setup_env.sh
    VENV="${venv_of[$v]}" bash scripts/install_browser.sh
done

# The versions run side by side (each pytest is mostly one busy core; on 2 cores this halves the wall time), each
# with its own pytest temp folder, their lines prefixed with the version. PARALLEL=0 runs them one after another.
# The newest frontend (PyPI comfyui-frontend-package, served with --front-end-root) over ComfyUI 0.33.0 runs when
# the whole suite (no path given) runs on 0.33.0: after the 0.3.75 half where both run (the shorter one: 26 against
# 27.5 min of pytest in a full run on 2 cores), else after the 0.33.0 run. It holds the Stats node's browser tests
# (what a person sees of the pack: the picture at the opening zoom, the hints), the tiny demo run from the page, and
# a template's missing model offered for download. FRONTEND_158=0 leaves it out. test_browser.py's other checks run with each ComfyUI's
# own frontend (1.32 for 0.3.75, 1.49 for 0.33.0).
results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
# tests/unit never imports ComfyUI and both venvs hold the same torch: when the whole suite runs on both versions,
# it runs once, in the 0.3.75 half (the 0.33.0 half has the dynamic-VRAM tests).
once=()
if [[ $has_path == 0 && " ${versions[*]} " == *" 0.3.75 "* && " ${versions[*]} " == *" 0.33.0 "* ]]; then
    once=(--ignore=tests/unit)
fi
frontend_after=""
if [[ $has_path == 0 && "${FRONTEND_158:-1}" != 0 && " ${versions[*]} " == *" 0.33.0 "* ]]; then
    frontend_after=0.33.0
    [[ " ${versions[*]} " == *" 0.3.75 "* ]] && frontend_after=0.3.75
fi
run_version() {  # version: writes "<label>|<exit status>" lines into $results/<version>
    local v="$1" status=0 skip=()
    shift
    [[ $v == 0.33.0 ]] && skip=("${once[@]}")
    echo "[layerwise-offload] ===== tests on ComfyUI $v (${venv_of[$v]}, ${comfy_of[$v]}) ====="
    run_pytest "$ROOT/${venv_of[$v]}" "$ROOT/${comfy_of[$v]}" "${args[@]}" "${skip[@]}" --basetemp="$results/tmp-$v" || status=$?
    echo "ComfyUI $v|$status" >> "$results/$v"
    if [[ $v == "$frontend_after" ]]; then
        echo "[layerwise-offload] ===== browser tests on ComfyUI 0.33.0 with frontend 1.58.1 ====="
        status=0
        local static
        static="$(bash scripts/install_frontend.sh | tail -n 1)" || status=$?
        if [[ $status == 0 ]]; then
            LAYERWISE_OFFLOAD_FRONTEND_ROOT="$static" run_pytest "$ROOT/.venv-0.33.0" "$ROOT/.comfyui/ComfyUI-0.33.0" \
                tests/e2e/test_browser_stats.py \
                tests/e2e/test_browser.py::test_missing_diffusion_model_of_a_template_is_offered_for_download \
                "$@" --basetemp="$results/tmp-frontend" || status=$?
        fi
        echo "ComfyUI 0.33.0 + frontend 1.58.1 (browser)|$status" >> "$results/$v"
    fi
}
pids=()
for v in "${versions[@]}"; do
    if [[ "${PARALLEL:-1}" != 0 && ${#versions[@]} -gt 1 ]]; then
        # One thread each: two runs of torch's default two threads on two cores spin against each other (OpenMP
        # busy-waits) and run slower side by side than one after another. sed -u: whole lines, each marked with
        # its version, as they come.
        ( set -o pipefail; export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
          run_version "$v" "$@" 2>&1 | sed -u "s/^/[$v] /" ) &
        pids+=($!)
    else
        run_version "$v" "$@"
    fi
done
for pid in "${pids[@]}"; do wait "$pid" || true; done
failed=()
summary=()
for v in "${versions[@]}"; do
    if [[ ! -s "$results/$v" ]]; then
        summary+=("ComfyUI $v: did not finish")
        failed+=("$v")
        continue
    fi
    while IFS='|' read -r label status; do
        summary+=("$label: pytest exit $status")
        [[ $status == 0 ]] || failed+=("$label")
    done < "$results/$v"
done
for line in "${summary[@]}"; do echo "[layerwise-offload] $line"; done
if [[ ${#failed[@]} -gt 0 ]]; then
    printf "[layerwise-offload] FAILED: %s\n" "${failed[@]}" >&2
    exit 1
fi
