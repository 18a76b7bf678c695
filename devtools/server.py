"""Start and stop a real ComfyUI server (``python main.py``) with this pack installed, and talk to its HTTP API.

Used by tests/e2e and devtools/server_cli.py (scripts/run.sh). Nothing here imports ComfyUI or torch: the server
is a child process, and the API calls use only the standard library. A server gets its own base directory
(``--base-directory``: models/, custom_nodes/, input/, output/, temp/ and user/ under it), so tests never touch the
ComfyUI checkout, with ``custom_nodes/layerwise-offload`` a symlink to the repository; ComfyUI imports the folder
as a package named after its path, so the repository root never lands on ``sys.path``.

    base = prepare_base_dir("/tmp/base")
    with ComfyServer(base, cpu=True, env={"LAYERWISE_OFFLOAD_CPU_LOOPBACK": "1"}) as srv:
        entry = srv.run_prompt(prompt)                   # queue, wait for /history, raise on failure
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .comfy_env import PathLike, repo_root
from .comfy_env import comfyui_path as default_comfyui_path

#: The folder name the pack gets under custom_nodes (ComfyUI lists its templates under this name).
PACK_FOLDER = "layerwise-offload"


class ServerError(RuntimeError):
    """The server did not start, died, or answered something unexpected. The message ends with its log tail."""


class PromptRejected(ServerError):
    """POST /prompt answered 400: validation failed. ``body`` is the JSON answer (``error``, ``node_errors``)."""

    def __init__(self, body: Dict[str, Any]):
        self.body = body
        super().__init__(f"prompt rejected: {json.dumps(body)[:2000]}")


class PromptFailed(ServerError):
    """The prompt ran and failed. ``entry`` is its /history entry; ``error`` the ``execution_error`` message."""

    def __init__(self, entry: Dict[str, Any]):
        self.entry = entry
        self.error = execution_error(entry)
        msg = self.error.get("exception_message", "") if self.error else json.dumps(entry.get("status"))[:1000]
        super().__init__(f"prompt failed: {msg}")


def execution_error(entry: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``execution_error`` message of a /history entry, or None."""
    for kind, data in (entry.get("status") or {}).get("messages", []):
        if kind == "execution_error":
            return data
    return None


def _child_setup() -> None:
    """In the child, before exec. SIGINT back to its default: a test run started in the background by a shell
    (``cmd &`` without job control) ignores SIGINT, the child would inherit that, and Python then installs no
    KeyboardInterrupt handler, so :meth:`ComfyServer.stop`'s Ctrl+C would do nothing and ComfyUI would end by
    SIGTERM, without its exit handlers. And, on Linux, a SIGTERM when the process that started it dies (a killed test
    run must not leave a ComfyUI behind; the child has its own session, so no terminal signal reaches it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def default_python() -> str:
    """This interpreter when it is one of the repository's venvs (.venv, .venv-0.14.1, ...: each matches one
    ComfyUI version), else .venv's, else this one."""
    # Unresolved too: a git worktree's venvs may be symlinks to another checkout's.
    if sys.prefix != sys.base_prefix and repo_root() in (Path(sys.prefix).parent, Path(sys.prefix).resolve().parent):
        return sys.executable
    venv = repo_root() / ".venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def prepare_base_dir(base: PathLike) -> Path:
    """Create a ComfyUI base directory (custom_nodes, models/{diffusion_models,vae,text_encoders}, input, output,
    temp, user) with ``custom_nodes/layerwise-offload`` a link to this repository (a stale link is replaced)."""
    base = Path(base).resolve()
    for sub in ("custom_nodes", "models/diffusion_models", "models/vae", "models/text_encoders", "input", "output",
                "temp", "user"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_FOLDER
    if link.is_symlink() and Path(os.readlink(link)) != repo_root():
        link.unlink()
    elif link.exists() and not link.is_symlink():
        raise FileExistsError(f"{link} exists and is not a symlink; remove it or install elsewhere")
    if not link.is_symlink():
        link.symlink_to(repo_root(), target_is_directory=True)
    return base


class ComfyServer:
    """One ComfyUI server process: ``python main.py --listen 127.0.0.1 --port P --base-directory B [--cpu]`` on a
    free port, with the repository's venv for it (:func:`default_python`).

    ``env`` entries are added to the child's environment (e.g. ``LAYERWISE_OFFLOAD_CPU_LOOPBACK=1``).
    ``extra_args`` go to main.py as they are. The log (stdout+stderr) goes to ``<base>/comfyui.log``. Use as a
    context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, base_dir: Optional[PathLike], cpu: bool = True, env: Optional[Mapping[str, str]] = None,
                 extra_args: Sequence[str] = (), comfyui_path: Optional[PathLike] = None) -> None:
        self.comfyui_path = Path(comfyui_path).resolve() if comfyui_path else default_comfyui_path()
        # base_dir None: ComfyUI's own folders (no --base-directory), as a user's install runs.
        self.use_base_arg = base_dir is not None
        self.base_dir = Path(base_dir).resolve() if base_dir is not None else self.comfyui_path
        self.host = "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a port that is free now (the OS picks it)
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        self.cpu = cpu
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.python = default_python()
        self.log_path = (self.base_dir / "comfyui.log" if self.use_base_arg else
                         self.comfyui_path / "user" / "layerwise_offload_server.log")
        self.proc: Optional[subprocess.Popen] = None
        self.client_id = uuid.uuid4().hex
        self._log_file = None

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> List[str]:
        cmd = [self.python, "main.py", "--listen", self.host, "--port", str(self.port), "--disable-auto-launch"]
        if self.use_base_arg:
            # The default database lives in the ComfyUI checkout (user/comfyui.db); keep a test's in its base
            # folder. Not sqlite:///:memory: -- ComfyUI 0.14.1's asset scanner then queries a table that the
            # in-memory migration created on another connection.
            cmd += ["--base-directory", str(self.base_dir), "--database-url", f"sqlite:///{self.base_dir}/comfyui.db"]
        if self.cpu:
            cmd.append("--cpu")
        return cmd + self.extra_args

    def start(self, timeout: float = 180.0) -> "ComfyServer":
        if self.proc is not None:
            return self
        self.base_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"})
        env.update(self.env)
        # A PYTHONPATH that holds the repository root would shadow ComfyUI's `nodes` module.
        env.pop("PYTHONPATH", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(("\n==== " + " ".join(self.command()) + "\n").encode())
        self.proc = subprocess.Popen(self.command(), cwd=str(self.comfyui_path), env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_child_setup if os.name == "posix" else None)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"ComfyUI exited with code {self.proc.returncode} while starting\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/api/system_stats", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise ServerError(f"ComfyUI did not answer on {self.url} within {timeout:.0f} s\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        """Stop the server as Ctrl+C would (SIGINT: ComfyUI exits and runs its exit handlers), escalating to SIGTERM
        and SIGKILL after ``timeout`` and 5 s. Returns the signal that ended it (None: it had ended already)."""
        proc, self.proc = self.proc, None
        ended_by = None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)  # its own session: the group is ComfyUI and its children only
                except ProcessLookupError:
                    break
                ended_by = sig
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return ended_by

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "---- ComfyUI log tail (%s) ----\n%s" % (self.log_path, "\n".join(self.log_text().splitlines()[-lines:]))

    # ------------------------------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0):
        """``(status, parsed JSON or bytes)`` for ``method path``; HTTP errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        # Template names have spaces and commas; an already quoted path stays as it is.
        path = urllib.parse.quote(path, safe="/?&=%:@+")
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        except (urllib.error.URLError, ConnectionError) as e:
            raise ServerError(f"{method} {path}: {e}\n{self.log_tail()}") from e
        if "json" in ctype:
            return status, json.loads(raw or b"null")
        return status, raw

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        status, body = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ServerError(f"GET {path} -> {status}: {body!r:.500}")
        return body

    def object_info(self, node_class: Optional[str] = None) -> Dict[str, Any]:
        if node_class:
            return self.get_json("/api/object_info/" + urllib.parse.quote(node_class)).get(node_class, {})
        return self.get_json("/api/object_info", timeout=60)

    def queue_prompt(self, prompt: Dict[str, Any], extra_data: Optional[Dict[str, Any]] = None) -> str:
        """POST /prompt; returns the prompt id. Raises :class:`PromptRejected` on a validation error."""
        payload: Dict[str, Any] = {"prompt": prompt, "client_id": self.client_id}
        if extra_data:
            payload["extra_data"] = extra_data
        status, body = self.request("POST", "/api/prompt", payload)
        if status == 400:
            raise PromptRejected(body if isinstance(body, dict) else {"raw": repr(body)})
        if status != 200 or not isinstance(body, dict) or "prompt_id" not in body:
            raise ServerError(f"POST /prompt -> {status}: {body!r:.1000}\n{self.log_tail()}")
        if body.get("node_errors"):
            raise PromptRejected(body)
        return body["prompt_id"]

    def wait_for(self, prompt_id: str, timeout: float = 120.0, poll: float = 0.1) -> Dict[str, Any]:
        """Poll ``/history/<id>`` until the prompt finished (success or error); returns its history entry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get_json("/api/history/" + prompt_id)
            entry = hist.get(prompt_id) if isinstance(hist, dict) else None
            if entry and (entry.get("status") or {}).get("status_str") in ("success", "error"):
                return entry
            if not self.alive() and self.proc is not None:
                raise ServerError(f"ComfyUI died while running {prompt_id}\n{self.log_tail()}")
            time.sleep(poll)
        raise ServerError(f"prompt {prompt_id} did not finish within {timeout:.0f} s\n{self.log_tail()}")

    def run_prompt(self, prompt: Dict[str, Any], timeout: float = 120.0, check: bool = True) -> Dict[str, Any]:
        """Queue ``prompt`` (API format), wait, and return its /history entry; raises :class:`PromptFailed` when
        it ran into an error and ``check`` is true."""
        entry = self.wait_for(self.queue_prompt(prompt), timeout)
        if check and entry["status"]["status_str"] != "success":
            raise PromptFailed(entry)
        return entry

    def output_files(self, entry: Dict[str, Any], kind: Optional[str] = None) -> List[Path]:
        """Paths of the files a finished prompt wrote (``kind``: "images", "latents", ... or all)."""
        out: List[Path] = []
        for node_out in (entry.get("outputs") or {}).values():
            for k, files in node_out.items():
                if kind is not None and k != kind or not isinstance(files, list):
                    continue
                for f in files:
                    if isinstance(f, dict) and "filename" in f:
                        root = self.base_dir / (f.get("type") or "output")
                        out.append(root / f.get("subfolder", "") / f["filename"])
        return out

    def free_memory(self) -> None:
        """POST /free: unload models and free memory (what the UI's "Unload models" button does)."""
        self.request("POST", "/api/free", {"unload_models": True, "free_memory": True})
