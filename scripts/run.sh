#!/usr/bin/env bash
# Set up the environment, then run the engine demo (scripts/demo_engine.py) with the given arguments.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
if [[ ! -f scripts/demo_engine.py ]]; then
    echo "[layerwise-offload] ERROR: scripts/demo_engine.py does not exist yet" >&2
    exit 2
fi
exec .venv/bin/python scripts/demo_engine.py "$@"
