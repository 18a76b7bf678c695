"""Never more RAM than ComfyUI alone, with no slack (issue 26): in a memory cgroup (no swap) at ComfyUI alone's own
limit, the smallest at which ComfyUI alone completes the prompt (found here), the node at its defaults completes
the same prompt, bitwise equal to ComfyUI alone, three times over.

For each loader (ComfyUI's UNETLoader, Load Diffusion Model (Layerwise), ComfyUI-GGUF's UnetLoaderGGUF), on
whichever ComfyUI runs the suite, ComfyUI alone is the loader straight into the sampler, without the node. It runs
once with no limit (its cgroup peak), then under limits bisected between what the warm server holds and that peak,
to 32 MiB (first tried: what the server holds plus the model's file, the floor of a loader that copies the weights). At the smallest limit it completed under, plus that resolution, plus the two streaming slots of prefetch 1 (the CPU loopback's
"VRAM": a GPU holds them in VRAM), the node runs at its defaults (resident_layers auto, prefetch 1, residency_policy
auto: leading on the CPU loopback, pin_memory on, host_store auto) three times: each completes, bitwise ComfyUI alone's latent, without the "host
memory is short" refusal, auto keeping no resident block (a resident would be more loopback "VRAM" than the two
slots), and the server lives. Before every run everything is unloaded and the model's file dropped from the page
cache, so each run starts from the same state and page-cache timing cannot flip the outcome. What the server holds
between runs still drifts on a busy machine: the first node run that does not complete is followed by ComfyUI alone
at its limit again; where alone does not complete there either, alone's limit is searched again, and either way the
run is repeated, once. A second failure stands. The cgroup's reclaimable memory (page cache of what the server read
or wrote) is reclaimed before every run, so each starts from the server's own memory.

A run that does not fit meets the cgroup's OOM killer, as a user's ComfyUI would: a fresh server, warmed up the
same way, takes over. (Switching the killer off instead, cgroup v1's ``oom_kill_disable``, was tried: system calls
then fail with ENOMEM or EFAULT where the killer would kill, and page faults on a mapped checkpoint can spin for
minutes without ever reporting ``under_oom``.) When the node does not complete, its own smallest limit is
searched too, and the failure names both, the phase it stopped in (loading, the node's check, packing, sampling)
and the log's host-store plan.

The models are Wan 2.1 DiTs of tiny activations and 8 blocks of 64 MiB: fp32 safetensors (dim 1024, ffn 4096) for
UNETLoader and the Layerwise loader, an F16 .gguf (ffn 12288) for ComfyUI-GGUF (skipped where shared/peers or the
gguf package is missing). Skipped where no memory cgroup can be made (not root, no memory controller).
``LAYERWISE_OFFLOAD_LIMIT_BLOCKS`` (8) sets the block count, ``LAYERWISE_OFFLOAD_LIMIT_RUNS`` (3) the node's runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import safetensors.torch
import torch

from layerwise_offload.devtools import e2e_assets, peers, tiny_dits
from layerwise_offload.devtools.server import ServerError, execution_error, prepare_base_dir

from .conftest import CPU_LOOPBACK_ENV, server_args
from .cgroups import Cgroup, ServerInCgroup, drop_page_cache
from .server_support import one_step_prompt, saved_latent, unload_everything

MiB = 2**20
RESOLUTION = 32 * MiB
# The issue's own case is LAYERWISE_OFFLOAD_LIMIT_BLOCKS=32 LAYERWISE_OFFLOAD_LIMIT_RUNS=10 -k UNETLoader (2.1 GiB,
# ten runs; not in the suite: about half an hour).
RUNS = int(os.environ.get("LAYERWISE_OFFLOAD_LIMIT_RUNS", "3"))
BLOCKS = int(os.environ.get("LAYERWISE_OFFLOAD_LIMIT_BLOCKS", "8"))
RUN_TIMEOUT = 150.0 * max(1, BLOCKS // 8)  # seconds per run: loading and one step grow with the model
MODEL_NAME = "layerwise_offload_limit_wan21.safetensors"
GGUF_NAME = "layerwise_offload_limit_wan21_F16.gguf"
WARM_GGUF_NAME = "layerwise_offload_limit_tiny_wan21_F16.gguf"
CONFIG = dict(tiny_dits.WAN21_TINY_CONFIG, dim=1024, num_heads=8, ffn_dim=4096, num_layers=BLOCKS)  # fp32: 64 MiB each
GGUF_CONFIG = dict(CONFIG, ffn_dim=12288)  # F16 matrices: 64 MiB blocks
# The node as a user drops it in (checked against the node's own defaults).
DEFAULTS = {"resident_layers": -1, "prefetch_size": 1, "residency_policy": "auto", "pin_memory": True,
            "host_store": "auto"}
LAYERWISE_LOADER = "LayerwiseOffloadLoadDiffusionModel"
GGUF_LOADER = "UnetLoaderGGUF"
LOADERS = ("UNETLoader", LAYERWISE_LOADER, GGUF_LOADER)
EMPTY_PROMPT = {"1": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 16, "height": 16, "length": 1,
                                                                          "batch_size": 1}},
                "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "limit/none"}}}
# Log lines that mark how far a prompt got, in order, each with the phase that follows it: a run that stopped is
# in the phase after the last one seen.
PHASES = ((r"got prompt", "loading the model"),
          (r"model weight dtype|gguf qtypes|\] loaded .* left in the file",
           "the loader's weights, then the node's host-memory check (or ComfyUI alone's load)"),
          (r"\]\s.*plan: .* resident, prefetch", "ComfyUI's load (the node's packing)"),
          (r"\] host store: \d+ of \d+ blocks on disk", "packing (blocks on disk first)"),
          (r"\] host store: \d+ blocks packed", "sampling, up to its first forward (the disk tier's first read)"),
          (r"auto plan: \d+/\d+ blocks resident", "sampling"),
          (r"\] run: ", "done"))


def gguf_missing() -> Optional[str]:
    """Why ComfyUI-GGUF cannot run here, or None."""
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package (a dev package of scripts/setup_env.sh) is not installed"
    if peers.peer_tarball() is None:
        return f"no shared/peers/{peers.GGUF_TARBALL} beside the repository (set LAYERWISE_OFFLOAD_SHARED)"
    return None


def model_of(loader: str) -> str:
    return GGUF_NAME if loader == GGUF_LOADER else MODEL_NAME


def prompt(loader: str, name: str, prefix: str, offload=None) -> dict:
    """The one-step tiny-demo prompt with ``loader`` loading ``name`` (node "1"), through the node if ``offload``."""
    p = one_step_prompt(offload=offload, unet=name, prefix=prefix)
    if loader == LAYERWISE_LOADER:
        p["1"] = {"class_type": LAYERWISE_LOADER, "inputs": {"unet_name": name, "weight_dtype": "default"}}
    elif loader == GGUF_LOADER:
        p["1"] = {"class_type": GGUF_LOADER, "inputs": {"unet_name": name}}
    return p


def phase(log: str) -> str:
    reached = "queued"
    for pattern, after in PHASES:
        if re.search(pattern, log):
            reached = after
    return reached


# ------------------------------------------------------------------------------------------------ the cgroup
def oom_kills(cgroup: Cgroup) -> int:
    """How many tasks the cgroup's OOM killer has killed (v1: memory.oom_control, v2: memory.events)."""
    for name in ("memory.oom_control", "memory.events"):
        try:
            found = re.search(r"^oom_kill (\d+)", (cgroup.path / name).read_text(), re.M)
        except OSError:
            continue
        if found:
            return int(found.group(1))
    return 0


@dataclass
class Attempt:
    completed: bool
    limit: Optional[int]
    peak: int  # the cgroup's peak
    before: int  # the cgroup's usage when the run started
    seconds: float
    log: str  # what the server logged during the run
    why: str = ""  # why it did not complete
    latent: Optional[torch.Tensor] = None

    @property
    def disk_plan(self) -> str:
        found = re.search(r"host store: \d+ of \d+ blocks on disk[^\n]*", self.log)
        if found:
            return found.group(0)[:300]
        return "no blocks on disk" if self.completed else "no 'blocks on disk' line (not planned, or all in RAM)"

    @property
    def residents(self) -> Optional[int]:
        found = re.search(r"auto plan: (\d+)/\d+ blocks resident", self.log)
        return int(found.group(1)) if found else None


@dataclass
class Servers:
    """The module's server in the cgroup: one, until the OOM killer takes it; then a fresh one, warmed up the same
    way. ``summary``: the lines printed again at the end of the module."""

    cgroup: Cgroup
    base: Path
    block: Dict[str, int]  # loader -> the largest block as the manager copies it (a streaming slot)
    gguf_missing: Optional[str]
    server: Optional[ServerInCgroup] = None
    starts: int = 0
    start_seconds: float = 0.0
    limits: Dict[str, tuple] = field(default_factory=dict)  # loader -> ComfyUI alone's (smallest limit, free run)
    summary: List[str] = field(default_factory=list)
    said: bool = False

    def ensure(self) -> ServerInCgroup:
        if self.server is not None and self.server.alive():
            return self.server
        if self.server is not None:
            self.server.stop()
        started = time.perf_counter()
        self.cgroup.set_limit(None)
        self.server = ServerInCgroup(self.cgroup, self.base, cpu=True, env={CPU_LOOPBACK_ENV: "1"},
                                     extra_args=server_args())
        self.server.start(timeout=300)
        # Imports and caches of every path the runs take (the sampler, the node, each loader), on tiny models.
        warm = {"resident_layers": 0, "prefetch_size": 1}
        self.server.run_prompt(prompt("UNETLoader", e2e_assets.TINY_WAN21_NAME, "limit/warm", warm))
        self.server.run_prompt(prompt(LAYERWISE_LOADER, e2e_assets.TINY_WAN21_NAME, "limit/warm", warm))
        if self.gguf_missing is None:
            self.server.run_prompt(prompt(GGUF_LOADER, WARM_GGUF_NAME, "limit/warm", warm))
        unload_everything(self.server)
        self.starts += 1
        self.start_seconds += time.perf_counter() - started
        return self.server

    def say(self, line: str, summary: bool = False) -> None:
        print(("" if self.said else "\n") + line)
        self.said = True
        if summary:
            self.summary.append(line)


def write_models(models: Path, missing_gguf: Optional[str]) -> Dict[str, int]:
    """The fp32 safetensors Wan and (where ComfyUI-GGUF runs) the F16 .gguf one; returns each loader's block bytes."""
    patcher = tiny_dits._build("WAN21_T2V", CONFIG, 11, torch.float32)
    state = {k: v.detach().contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}
    del patcher
    safetensors.torch.save_file(state, str(models / MODEL_NAME))
    block = sum(t.nbytes for k, t in state.items() if k.startswith("blocks.0."))
    figures = {"UNETLoader": block, LAYERWISE_LOADER: block}
    del state
    if missing_gguf is None:
        from layerwise_offload.devtools.quantized_models import save_gguf, save_tiny_wan21_gguf

        save_tiny_wan21_gguf(models / WARM_GGUF_NAME, "F16", seed=0)
        patcher = tiny_dits._build("WAN21_T2V", GGUF_CONFIG, 12, torch.float16)
        state = {k: v.detach().contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}
        del patcher
        save_gguf(state, models / GGUF_NAME, "F16")
        # save_gguf writes the block matrices F16 and everything else float32: the block as the manager copies it.
        figures[GGUF_LOADER] = sum(t.numel() * (2 if t.ndim == 2 else 4) for k, t in state.items()
                                   if k.startswith("blocks.0."))
        del state
    return figures


@pytest.fixture(scope="module")
def limit_servers(tmp_path_factory, tiny_assets):
    cgroup = Cgroup()
    base = prepare_base_dir(tmp_path_factory.mktemp("ram_limit_base"))
    for kind, sub in (("wan21", "diffusion_models"), ("vae", "vae")):
        (base / "models" / sub / tiny_assets[kind].split("/")[-1]).symlink_to(tiny_assets[kind])
    e2e_assets.copy_cond(tiny_assets, base)
    missing = gguf_missing()
    if missing is None:
        peers.unpack_peer(base / "custom_nodes")
    servers = Servers(cgroup, base, write_models(base / "models" / "diffusion_models", missing), missing)
    try:
        yield servers
    finally:
        if servers.server is not None:
            servers.server.stop()
        cgroup.remove()
        print("\n".join(["", "[layerwise-offload] RAM at ComfyUI alone's limit:"] + servers.summary))


# ------------------------------------------------------------------------------------------------ one run
def wait(servers: Servers, server, prompt_id: str, timeout: float):
    """(its /history entry, or None and why it did not complete)."""
    deadline, kills = time.monotonic() + timeout, oom_kills(servers.cgroup)
    while time.monotonic() < deadline:
        if not server.alive():
            return None, "OOM-killed" if oom_kills(servers.cgroup) > kills else "the server died"
        try:
            history = server.get_json("/api/history/" + prompt_id, timeout=5)
        except (ServerError, OSError):  # dying
            time.sleep(0.1)
            continue
        entry = history.get(prompt_id) if isinstance(history, dict) else None
        if entry and (entry.get("status") or {}).get("status_str") in ("success", "error"):
            if entry["status"]["status_str"] != "success":
                error = execution_error(entry) or {}
                return None, "failed: " + str(error.get("exception_message", entry["status"]))[:1500]
            return entry, ""
        time.sleep(0.1)
    server.stop()  # hung: not a completion; a fresh server takes over
    return None, f"no answer within {timeout:.0f} s"


def runs_prompts(server) -> bool:
    """Whether the server still runs a prompt (an exception that escapes ComfyUI's prompt worker stops it for good)."""
    try:
        server.free_memory()
        server.run_prompt(EMPTY_PROMPT, timeout=30)
        return True
    except ServerError:
        return False


def attempt(servers: Servers, loader: str, limit: Optional[int], prefix: str, offload=None,
            timeout: float = RUN_TIMEOUT) -> Attempt:
    """One run under ``limit`` (None: none), from the same state every time: the warm server, nothing loaded, the
    model's file out of the page cache."""
    server = servers.ensure()
    cgroup = servers.cgroup
    unload_everything(server)
    drop_page_cache(server.base_dir / "models" / "diffusion_models" / model_of(loader))
    cgroup.reclaim()
    before = cgroup.usage()
    log_start = len(server.log_text())
    started = time.perf_counter()
    entry, why = None, ""
    try:
        try:
            cgroup.set_limit(limit)
        except OSError as error:  # EBUSY: the server alone holds more than that, page cache reclaimed
            why = f"the limit is below what the server holds ({error})"
        else:
            cgroup.reset_peak()
            entry, why = wait(servers, server, server.queue_prompt(prompt(loader, model_of(loader), prefix, offload)),
                              timeout)
    finally:
        peak = cgroup.peak()
        cgroup.set_limit(None)
    log = server.log_text()[log_start:]
    result = Attempt(entry is not None, limit, peak, before, time.perf_counter() - started, log, why)
    if entry is not None:
        result.latent = saved_latent(server, entry)
    elif server.alive() and not runs_prompts(server):
        why += "; then the server ran no more prompts"
        server.stop()  # a fresh server takes over
    result.why = why
    text = "no limit" if limit is None else f"limit {limit / MiB:.0f} MiB"
    outcome = "completed" if result.completed else f"{why[:160]} [{phase(log)}]"
    servers.say(f"[layerwise-offload] {prefix}: {text}: {outcome}; cgroup peak {peak / MiB:.0f} MiB, usage at start "
                f"{before / MiB:.0f} MiB, {result.seconds:.1f} s")
    return result


# ------------------------------------------------------------------------------------------------ limits
def comfyui_alone_limit(servers: Servers, loader: str):
    """ComfyUI alone's smallest limit (to RESOLUTION), its unlimited run, and its latent: bisection between what
    the server holds before the run (it cannot complete there) and its unlimited peak. Found once per loader."""
    if loader in servers.limits:
        return servers.limits[loader]
    free = attempt(servers, loader, None, f"limit/{loader}/alone_free")
    assert free.completed, free.why + "\n" + free.log[-3000:]
    low, high = free.before, -(-free.peak // RESOLUTION) * RESOLUTION
    # A loader that copies the weights into RAM (UNETLoader) cannot complete below what the server holds plus the
    # file, and each failed run costs an OOM kill and a fresh server (about 50 s; a completed run about 10): tried
    # first, that floor leaves the bisection mostly completed runs. A loader that maps the file completes there,
    # and the bisection goes on below it.
    # Near its limit a run may neither complete nor be killed (page faults on the mapped file spin): alone counts
    # as not completing there after ten times its unlimited run's time, not the whole RUN_TIMEOUT.
    patience = min(RUN_TIMEOUT, max(45.0, 10 * free.seconds))
    file_bytes = (servers.base / "models" / "diffusion_models" / model_of(loader)).stat().st_size
    floor = (free.before + file_bytes - RESOLUTION) // 4096 * 4096

    def completes(limit: int) -> bool:
        tried = attempt(servers, loader, limit, f"limit/{loader}/alone", timeout=patience)
        if tried.completed:
            assert torch.equal(tried.latent, free.latent), f"{loader} alone under {limit} B: another latent"
        return tried.completed

    tries = [floor] if low + RESOLUTION < floor < high - RESOLUTION else []
    while tries or high - low > RESOLUTION:
        limit = tries.pop() if tries else (low + high) // 2 // 4096 * 4096
        if completes(limit):
            high = limit
        else:
            low = limit
    servers.limits[loader] = high, free
    return high, free


def node_limit(servers: Servers, loader: str, failed_at: int, ceiling: int, settings=DEFAULTS) -> Optional[int]:
    """The node's own smallest limit (to RESOLUTION) above ``failed_at``, up to ``ceiling`` (None: not found)."""
    low, step, high = failed_at, RESOLUTION, None
    while high is None and low < ceiling:
        tried = min(low + step, ceiling)
        if attempt(servers, loader, tried, f"limit/{loader}/node_needs", settings).completed:
            high = tried
        else:
            low, step = tried, 2 * step
    while high is not None and high - low > RESOLUTION:
        middle = (low + high) // 2 // 4096 * 4096
        if attempt(servers, loader, middle, f"limit/{loader}/node_needs", settings).completed:
            high = middle
        else:
            low = middle
    return high


# With a loader that leaves the weights in the file (ComfyUI alone then runs from reclaimable page cache), auto reads
# every block from the file through the disk tier's staging ring. That ring was prefetch + 2 whole blocks of
# anonymous RAM (the node needed alone's limit + the slots + 192 MiB); it became a few chunks whatever the block
# (2 x 16 MiB), which left the node 28 MiB above alone + the slots with ComfyUI-GGUF (measured at 4 MiB resolution)
# and failed this test once in CI; where RAM leaves no choice but the disk it is now 2 x 4 MiB (offload/disk/tier.py
# TIGHT_CHUNK_BYTES): 8 MiB above, inside the search's resolution.
# The slack the node gets over ComfyUI alone's own limit is all the CPU loopback's and the search's: the two
# streaming slots of prefetch 1 (2 x the largest block: RAM here, where the loopback's "VRAM" lives; on a GPU they
# are VRAM and the node adds no RAM for them) and the search's RESOLUTION (alone's true need lies anywhere in the
# RESOLUTION below the limit it found). Nothing is allowed for the node's own host side: what it adds over alone and
# the slots (the disk tier's 8 MiB ring where RAM leaves no choice) must fit inside that resolution.
# The case also with resident_layers = 0 (every block streamed by a count of the user's, no auto plan): in
# the release set, as LAYERWISE_OFFLOAD_LIMIT_BLOCKS=32 LAYERWISE_OFFLOAD_LIMIT_RUNS=10 on ComfyUI 0.33.0.
RESIDENT_0 = dict(DEFAULTS, resident_layers=0)


@pytest.mark.parametrize("loader,settings", [
    *[pytest.param(loader, DEFAULTS, id=loader) for loader in ("UNETLoader", LAYERWISE_LOADER, GGUF_LOADER)],
    pytest.param("UNETLoader", RESIDENT_0, id="UNETLoader-resident_0", marks=pytest.mark.release)])
def test_the_node_completes_at_comfyui_alones_own_limit(limit_servers, loader, settings):
    from layerwise_offload.nodes.offload_node import DEFAULTS as NODE_DEFAULTS

    assert NODE_DEFAULTS == DEFAULTS, "the node's defaults changed: update DEFAULTS here"
    servers = limit_servers
    if loader == GGUF_LOADER and servers.gguf_missing:
        pytest.skip(servers.gguf_missing)
    started = time.perf_counter()
    servers.said = False  # this test's first line on a line of its own
    limit, free = comfyui_alone_limit(servers, loader)
    # (measured on 0.3.75: the node needs alone + 121-130 MiB of its 128 MiB of slots, so at the grid point just
    # above alone's need it could miss by a couple of MiB without the resolution.)
    slots = 2 * servers.block[loader] + RESOLUTION
    servers.say(f"[layerwise-offload] {loader} ({settings_words(settings)}): ComfyUI alone's smallest limit "
                f"{limit / MiB:.0f} MiB (unlimited peak {free.peak / MiB:.0f} MiB, the server {free.before / MiB:.0f} "
                f"MiB before it); the node runs under {limit / MiB:.0f} + {slots / MiB:.0f} MiB: "
                f"{2 * servers.block[loader] / MiB:.0f} MiB of 2 loopback streaming slots of "
                f"{servers.block[loader] / MiB:.0f} MiB (RAM on the CPU loopback, VRAM on a GPU) and the search's "
                f"{RESOLUTION / MiB:.0f} MiB resolution", summary=True)
    run, retried = 0, False
    peaks = []
    while run < RUNS:
        got = attempt(servers, loader, limit + slots, f"limit/{loader}/node{run}", settings)
        servers.say(f"[layerwise-offload]   node run {run}: {'completed' if got.completed else got.why[:200]}; "
                    f"{got.disk_plan}; auto residents: {got.residents}", summary=True)
        if not got.completed and not retried:
            # The promise is a comparison under the same conditions, and on a busy machine the conditions drift:
            # what the server holds between runs moves by tens of MiB, and with four test processes on two cores
            # the node once needed alone + the slots + 65 MiB where it needs + 4 MiB on a quiet machine and + 16
            # MiB beside three CPU-bound processes (LAYERWISE_OFFLOAD_LIMIT_MEASURE). So one failure is followed by
            # ComfyUI alone at its limit: where alone no longer completes either, the server's state moved, and
            # alone's limit is searched again; where it does, the same run is repeated. Either way once: a node
            # that needs more than the allowance fails again.
            retried = True
            again = attempt(servers, loader, limit, f"limit/{loader}/alone_again")
            if not again.completed:
                del servers.limits[loader]
                limit, free = comfyui_alone_limit(servers, loader)
                servers.say(f"[layerwise-offload] {loader}: ComfyUI alone no longer completed at its limit either "
                            f"({again.why[:120]}): searched again, {limit / MiB:.0f} MiB; run {run} again",
                            summary=True)
            else:
                servers.say(f"[layerwise-offload] {loader}: ComfyUI alone completed at its limit again; run {run} "
                            "once more", summary=True)
            continue
        if not got.completed:
            needs = node_limit(servers, loader, limit + slots, free.peak + 4 * slots, settings)
            needs_text = (f"the node completes from {needs / MiB:.0f} MiB, {(needs - limit - slots) / MiB:.0f} MiB "
                          f"above ComfyUI alone + slots" if needs else "the node did not complete below "
                          f"{(free.peak + 4 * slots) / MiB:.0f} MiB either")
            head = (f"{loader}, run {run}: did not complete at ComfyUI alone's limit {limit / MiB:.0f} MiB + "
                    f"{slots / MiB:.0f} MiB of loopback slots: {got.why} (phase: {phase(got.log)}; host store: "
                    f"{got.disk_plan}; cgroup peak {got.peak / MiB:.0f} MiB; usage at start "
                    f"{got.before / MiB:.0f} MiB); {needs_text}")
            servers.say(f"[layerwise-offload] {head}", summary=True)
            ours = [line[line.index("[layerwise-offload]"):][:400] for line in got.log.splitlines()
                    if "[layerwise-offload]" in line]
            pytest.fail("\n".join([head] + ours[-12:] + got.log.splitlines()[-15:]), pytrace=False)
        assert torch.equal(got.latent, free.latent), f"{loader}, run {run}: not ComfyUI alone's latent"
        assert "host memory is short" not in got.log, got.log[-3000:]
        if settings["resident_layers"] == -1:
            assert got.residents == 0, f"auto kept {got.residents} resident blocks: more loopback 'VRAM' than the slots"
        peaks.append(got.peak)
        run += 1
    assert servers.server.alive()
    servers.say(f"[layerwise-offload] {loader} ({settings_words(settings)}): {len(peaks)} of {RUNS} runs completed "
                f"under {(limit + slots) / MiB:.0f} MiB, cgroup peaks {min(peaks) / MiB:.0f}-{max(peaks) / MiB:.0f} "
                f"MiB; {time.perf_counter() - started:.0f} s; {servers.starts} server start(s) so far "
                f"({servers.start_seconds:.0f} s)", summary=True)


def settings_words(settings) -> str:
    return "the node's defaults" if settings == DEFAULTS else ", ".join(
        f"{key}={value}" for key, value in settings.items() if DEFAULTS[key] != value)


# Not in the suite (about 8 minutes a loader): the node's own smallest limit against ComfyUI alone's, both searched
# to 4 MiB, so the RAM the node adds over alone + the loopback's slots is a figure, not a pass. Measured on 0.3.75
# with ComfyUI-GGUF: 28 MiB with the 32 MiB staging ring, 8 MiB with the 8 MiB one RAM-short plans now take.
@pytest.mark.skipif(not os.environ.get("LAYERWISE_OFFLOAD_LIMIT_MEASURE"),
                    reason="a measurement: LAYERWISE_OFFLOAD_LIMIT_MEASURE=1 searches the node's own limit too")
@pytest.mark.parametrize("loader", LOADERS)
def test_measure_what_the_node_adds_over_comfyui_alone_and_its_slots(limit_servers, loader, monkeypatch):
    from layerwise_offload.offload.disk.tier import STAGING_CHUNKS, TIGHT_CHUNK_BYTES

    servers = limit_servers
    if loader == GGUF_LOADER and servers.gguf_missing:
        pytest.skip(servers.gguf_missing)
    monkeypatch.setitem(globals(), "RESOLUTION", 4 * MiB)  # the searches read the module's figure
    servers.limits.pop(loader, None)
    alone, free = comfyui_alone_limit(servers, loader)
    slots = 2 * servers.block[loader]
    # From alone's own limit: blocks the tier plan sends to disk free RAM the slots can then take, so the node may
    # need less than alone + the slots.
    needs = node_limit(servers, loader, alone, free.peak + 4 * slots)
    assert needs is not None, f"{loader}: the node did not complete below {(free.peak + 4 * slots) / MiB:.0f} MiB"
    added = needs - alone - slots
    servers.say(f"[layerwise-offload] {loader}: ComfyUI alone {alone / MiB:.0f} MiB (the server {free.before / MiB:.0f} "
                f"MiB before it), the node {needs / MiB:.0f} MiB: {added / MiB:+.0f} MiB over alone + the slots "
                f"(4 MiB resolution)", summary=True)
    ring = STAGING_CHUNKS * TIGHT_CHUNK_BYTES
    assert added <= ring + 4 * MiB, f"{loader}: the node adds {added / MiB:.0f} MiB, over its {ring / MiB:.0f} MiB ring"
