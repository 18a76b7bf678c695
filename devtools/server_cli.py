"""Command line over devtools/server.py: run the tiny demo workflow once through a real server (``smoke``, what
``bash scripts/run.sh --smoke`` calls), or serve ComfyUI from a base directory with this pack linked (``serve``).

    .venv/bin/python -P devtools/server_cli.py smoke [--comfyui DIR] [--base DIR] [--gpu]
    .venv/bin/python -P devtools/server_cli.py serve --base DIR [--port N] [--gpu] [extra main.py arguments]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

if __name__ == "__main__" and __package__ in (None, ""):
    # Run by path: register the repository as the package `layerwise_offload`, then run this module from it.
    import importlib.util as _ilu

    _spec = _ilu.spec_from_file_location("_lwo_comfy_env", Path(__file__).resolve().parent / "comfy_env.py")
    _env = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_env)
    _env.register_pack()
    from layerwise_offload.devtools import server_cli as _cli

    sys.exit(_cli._main())

from .server import ComfyServer, PathLike, ServerError, prepare_base_dir, repo_root  # noqa: E402


def smoke(base_dir: Optional[PathLike] = None, workflow: Optional[PathLike] = None, cpu: bool = True,
          comfyui_path: Optional[PathLike] = None, timeout: float = 240.0) -> Dict[str, Any]:
    """Start a server on a free port, run the tiny demo workflow through the API as the frontend would send it,
    stop the server, and return ``{"url", "outputs", "seconds"}``. Raises on any failure (with the log tail)."""
    from .workflow_api import validate_workflow, workflow_to_prompt  # relative: run as a module or by path

    workflow = Path(workflow) if workflow else next((repo_root() / "workflows").glob("A tiny demo*.json"))
    wf = json.loads(Path(workflow).read_text(encoding="utf-8"))
    srv = ComfyServer(base_dir, cpu=cpu, env={"LAYERWISE_OFFLOAD_CPU_LOOPBACK": "1"}, comfyui_path=comfyui_path)
    t0 = time.monotonic()
    with srv:
        info = srv.object_info()
        problems = validate_workflow(wf, info, check_files=True)
        if problems:
            raise ServerError(f"{workflow} does not fit this server:\n" + "\n".join(problems))
        entry = srv.run_prompt(workflow_to_prompt(wf, info), timeout=timeout)
        files = [str(p) for p in srv.output_files(entry)]
    return {"url": srv.url, "outputs": files, "seconds": round(time.monotonic() - t0, 1)}


def _main(argv: Optional[Iterable[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Start ComfyUI with this pack (serve), or run the tiny demo once (smoke).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("serve", help="start ComfyUI in a base directory with the pack linked; Ctrl+C stops it")
    sp.add_argument("--base", required=True)
    sp.add_argument("--port", type=int, default=None)
    sp.add_argument("--gpu", action="store_true", help="do not pass --cpu")
    sm = sub.add_parser("smoke", help="start a server, run the tiny demo workflow, stop")
    sm.add_argument("--base", default=None, help="base directory (default: ComfyUI's own folders)")
    sm.add_argument("--comfyui", default=None, help="ComfyUI folder (default: $COMFYUI_PATH or .comfyui/ComfyUI)")
    sm.add_argument("--gpu", action="store_true", help="do not pass --cpu")
    a, rest = ap.parse_known_args(argv)
    if a.cmd == "smoke":
        res = smoke(a.base, cpu=not a.gpu, comfyui_path=a.comfyui)
        print(json.dumps(res, indent=1))
        return 0
    base = prepare_base_dir(a.base)
    srv = ComfyServer(base, port=a.port, cpu=not a.gpu, env={"LAYERWISE_OFFLOAD_CPU_LOOPBACK": "1"},
                      extra_args=rest)
    srv.start()
    print(f"ComfyUI at {srv.url} (log: {srv.log_path}); Ctrl+C stops it", flush=True)
    try:
        while srv.alive():
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
