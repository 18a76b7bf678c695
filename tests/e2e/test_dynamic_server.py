"""A real ComfyUI 0.33 server with dynamic VRAM (comfy-aimdo's ``ModelPatcherDynamic``, through
tests/dynamic_vram_standin.py), driven over its HTTP API: the node takes ComfyUI's dynamic model over as an
ordinary patcher of the same model, with the latent ComfyUI computes and no more RAM than ComfyUI's own dynamic load.

The server (``main.py --cpu``, CPU loopback on) gets a tiny test-only custom node beside the pack
(:data:`STANDIN_INIT`): it loads the pack's tests/dynamic_vram_standin.py by file path and calls ``enable()``, what
main.py does when aimdo finds a GPU. It also writes a timeline (every log record and each ``executing`` event, with
its wall time) and logs each ``comfy.utils.load_torch_file`` call (a reload would show), and it offers
``POST /layerwise_offload_test/dynamic_vram`` to turn the stand-in off and on between prompts: a LoRA on a dynamic
model is applied only on the GPU's VBAR cast path, which the stand-in cannot run, so a LoRA chain's reference is
ComfyUI's NON-dynamic run, on the same server with the stand-in off (main.py's state without aimdo).

- UNETLoader -> LayerwiseOffload -> KSampler and Load Diffusion Model (Layerwise) -> LayerwiseOffload -> KSampler
  save bitwise the latent of the same graph without the node on the same dynamic server; no checkpoint is read
  again, and the log has no reload / delegate warning.
- UNETLoader -> LoraLoaderModelOnly -> LayerwiseOffload -> KSampler is bitwise ComfyUI's non-dynamic LoRA run.
- RAM (issue 25 item 3): the server runs in a memory cgroup (no swap); the big Wan of test_loader_cgroup.py
  (32 blocks of 64 MiB, 2.1 GiB) loads by UNETLoader, alone (ComfyUI's dynamic load), then -> the node with its
  defaults (resident -1, host_store auto) with RAM free, then the same in a cgroup limit of what ComfyUI alone
  took plus the CPU loopback's two streaming slots and one block of slack: it runs there, bitwise. The cgroup's
  peaks, the server's resident memory by kind and the times (the node's takeover, the load) are printed; what the
  node holds less the loopback's "VRAM" block copies is at most what ComfyUI alone took plus the slack
  (:func:`test_ram_with_the_node_is_comfyuis_own_dynamic_load` says what is counted).

Skipped (module) where the tests' ComfyUI has no dynamic VRAM that core loaders use (before 0.33).
"""

from __future__ import annotations

import os
import re
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from layerwise_offload.devtools import e2e_assets
from layerwise_offload.tests import dynamic_vram_standin
from layerwise_offload.devtools.server import PACK_FOLDER, ComfyServer, prepare_base_dir

if not dynamic_vram_standin.available():
    pytest.skip("this ComfyUI has no dynamic VRAM that core loaders use (0.33+)", allow_module_level=True)

from .conftest import CPU_LOOPBACK_ENV, server_args  # noqa: E402
from .cgroups import BIG_WAN_NAME as BIG_NAME, Cgroup, drop_page_cache, server_in, write_big_wan  # noqa: E402
from .server_support import (block_lora, one_step_prompt, saved_latent, settled_rss, tiny_prompt,  # noqa: E402
                             unload_everything)

NODE = "LayerwiseOffload"
LAYERWISE_LOADER = "LayerwiseOffloadLoadDiffusionModel"
LORA_NAME = "layerwise_offload_dynamic_tiny_lora.safetensors"
STANDIN_FOLDER = "layerwise_offload_test_dynamic_vram"
TOGGLE_ROUTE = "/layerwise_offload_test/dynamic_vram"
DYNAMIC_LOAD = "prepared for dynamic VRAM loading"
TAKEN_OVER = "the offload streams it as an ordinary model (the same model and weights, nothing reloaded or copied)"
MiB = 2**20

#: The test-only custom node: ComfyUI imports ``custom_nodes/<STANDIN_FOLDER>/__init__.py`` at start.
STANDIN_INIT = textwrap.dedent('''\
    """Test only (layerwise-offload tests/e2e/test_dynamic_server.py): ComfyUI 0.33's dynamic VRAM on the CPU
    (the pack's tests/dynamic_vram_standin.py), a timeline of the run, and a switch for the stand-in."""
    import importlib.util
    import logging
    import os
    import threading
    import time

    import comfy.model_patcher
    import comfy.utils
    from aiohttp import web
    from server import PromptServer

    HERE = os.path.dirname(os.path.abspath(__file__))
    STANDIN = os.path.join(os.path.dirname(HERE), {pack!r}, "tests", "dynamic_vram_standin.py")
    _spec = importlib.util.spec_from_file_location("layerwise_offload_test_dynamic_vram_standin", STANDIN)
    standin = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(standin)
    standin.enable()
    logging.info("[dynamic-vram-standin] enabled: core loaders build %s", comfy.model_patcher.CoreModelPatcher.__name__)

    _timeline = open(os.path.join(HERE, "timeline.log"), "a", buffering=1, encoding="utf-8")
    _lock = threading.Lock()


    def mark(when, text):
        with _lock:
            _timeline.write("%.4f %s\\n" % (when, " ".join(str(text).split())[:400]))


    class Timeline(logging.Handler):
        def emit(self, record):
            try:
                mark(record.created, record.getMessage())
            except Exception:
                pass


    logging.getLogger().addHandler(Timeline())

    _send_sync = PromptServer.instance.send_sync


    def send_sync(event, data, sid=None):
        if event in ("executing", "execution_start", "execution_success", "execution_error") and isinstance(data, dict):
            mark(time.time(), "event %s %s" % (event, data.get("node")))
        return _send_sync(event, data, sid)


    PromptServer.instance.send_sync = send_sync

    _load_torch_file = comfy.utils.load_torch_file


    def load_torch_file(ckpt, *args, **kwargs):
        logging.info("[dynamic-vram-standin] load_torch_file %s", ckpt)
        return _load_torch_file(ckpt, *args, **kwargs)


    comfy.utils.load_torch_file = load_torch_file


    @PromptServer.instance.routes.post({route!r})
    async def switch(request):
        body = await request.json()
        (standin.enable if body.get("enabled") else standin.disable)()
        enabled = comfy.model_patcher.CoreModelPatcher is comfy.model_patcher.ModelPatcherDynamic
        logging.info("[dynamic-vram-standin] %s", "enabled" if enabled else "disabled")
        return web.json_response({{"enabled": enabled}})


    NODE_CLASS_MAPPINGS = {{}}
    NODE_DISPLAY_NAME_MAPPINGS = {{}}
    ''').format(pack=PACK_FOLDER, route=TOGGLE_ROUTE)


def install_standin(base: Path) -> Path:
    folder = base / "custom_nodes" / STANDIN_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(STANDIN_INIT, encoding="utf-8")
    return folder / "timeline.log"


class DynamicServer:
    """The module's server and what the tests read beside it."""

    def __init__(self, server: ComfyServer, cgroup, timeline: Path):
        self.server, self.cgroup, self.timeline = server, cgroup, timeline

    def log_since(self, mark: int) -> str:
        return self.server.log_text()[mark:]

    def timeline_lines(self):
        lines = []
        for line in self.timeline.read_text(encoding="utf-8", errors="replace").splitlines():
            when, _, text = line.partition(" ")
            lines.append((float(when), text))
        return lines

    def set_dynamic(self, enabled: bool) -> None:
        status, body = self.server.request("POST", TOGGLE_ROUTE, {"enabled": enabled})
        assert status == 200 and body == {"enabled": enabled}, (status, body)

    def latent(self, prompt, timeout=240) -> torch.Tensor:
        return saved_latent(self.server, self.server.run_prompt(prompt, timeout=timeout))


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory, tiny_assets):
    """One --cpu server (CPU loopback) with the stand-in, inside a memory cgroup where one can be made (the RAM
    test needs it; the others run in a plain server otherwise)."""
    base = prepare_base_dir(tmp_path_factory.mktemp("dynamic_base"))
    for kind, sub in (("wan21", "diffusion_models"), ("vae", "vae")):
        (base / "models" / sub / Path(tiny_assets[kind]).name).symlink_to(tiny_assets[kind])
    e2e_assets.copy_cond(tiny_assets, base)
    (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
    state = safetensors.torch.load_file(tiny_assets["wan21"])
    safetensors.torch.save_file(block_lora(state), str(base / "models" / "loras" / LORA_NAME))
    timeline = install_standin(base)
    try:
        cgroup = Cgroup()
    except pytest.skip.Exception as why:  # no cgroup here: the RAM test skips with this reason
        cgroup = str(why)
    started = (ComfyServer(base, cpu=True, env={CPU_LOOPBACK_ENV: "1"}, extra_args=server_args())
               if isinstance(cgroup, str) else server_in(cgroup, base))
    with started as server:
        yield DynamicServer(server, cgroup, timeline)


def with_node(prompt, **offload):
    """``prompt`` with LayerwiseOffload (node "10") between what feeds node "5" and node "5"."""
    prompt["10"] = {"class_type": NODE, "inputs": {"model": prompt["5"]["inputs"]["model"], **offload}}
    prompt["5"]["inputs"]["model"] = ["10", 0]
    return prompt


def layerwise_loader(prompt, unet=e2e_assets.TINY_WAN21_NAME):
    prompt["1"] = {"class_type": LAYERWISE_LOADER, "inputs": {"unet_name": unet, "weight_dtype": "default"}}
    return prompt


def assert_no_reload_or_delegate(new_log: str) -> None:
    assert "[dynamic-vram-standin] load_torch_file" not in new_log, new_log[-3000:]  # nothing read again
    assert "layerwise-offload] loaded " not in new_log, new_log[-3000:]  # nor by the Layerwise loader
    assert "takes it over as an ordinary model" not in new_log, new_log[-3000:]  # the reload/delegate warning
    assert "ComfyUI reloads its weights" not in new_log and "To skip the reload" not in new_log, new_log[-3000:]
    assert "non-dynamic delegate" not in new_log.lower(), new_log[-3000:]


# ------------------------------------------------------------------------------------------------ latents

def test_the_server_loads_models_dynamically(dynamic):
    log = dynamic.server.log_text()
    assert "[dynamic-vram-standin] enabled: core loaders build ModelPatcherDynamic" in log, dynamic.server.log_tail()
    assert not [line for line in log.splitlines() if "Cannot import" in line or "IMPORT FAILED" in line], log
    unload_everything(dynamic.server)  # nothing cached: the prompt loads the model
    mark = len(dynamic.server.log_text())
    dynamic.latent(tiny_prompt(None, prefix="dyn/probe"))
    assert DYNAMIC_LOAD in dynamic.log_since(mark), dynamic.server.log_tail(40)


@pytest.mark.parametrize("loader", ["UNETLoader", LAYERWISE_LOADER])
def test_the_node_on_a_dynamic_model_is_comfyuis_dynamic_latent(dynamic, loader):
    def prompt(prefix, offload=None):
        p = tiny_prompt(None, prefix=prefix)
        if loader == LAYERWISE_LOADER:
            layerwise_loader(p)
        return with_node(p, **offload) if offload is not None else p

    unload_everything(dynamic.server)  # nothing cached: the reference loads and runs
    mark = len(dynamic.server.log_text())
    reference = dynamic.latent(prompt(f"dyn/{loader}/ref"))
    ref_log = dynamic.log_since(mark)
    assert DYNAMIC_LOAD in ref_log, ref_log[-3000:]  # the reference is 0.33's dynamic run
    assert reference.shape == (1, 16, 2, 8, 8) and torch.isfinite(reference).all()
    mark = len(dynamic.server.log_text())
    plans = [dict(resident_layers=-1, prefetch_size=1, residency_policy="leading", pin_memory=True,
                  host_store="auto"),
             dict(resident_layers=0, prefetch_size=1, residency_policy="leading", pin_memory=True, host_store="ram"),
             dict(resident_layers=2, prefetch_size=2, residency_policy="strided", pin_memory=False)]
    for i, plan in enumerate(plans):
        got = dynamic.latent(prompt(f"dyn/{loader}/node{i}", plan))
        assert torch.equal(got, reference), f"{loader}, {plan}: max |diff| {(got - reference).abs().max().item()}"
    new_log = dynamic.log_since(mark)
    assert TAKEN_OVER in new_log, new_log[-3000:]  # the loader's dynamic model, taken over
    assert re.search(r"\[layerwise-offload\].*plan", new_log) and "passed through" not in new_log, new_log[-3000:]
    assert_no_reload_or_delegate(new_log)  # the loader's output was cached: the node used the very model
    # ... and left the dynamic model as it found it.
    again = dynamic.latent(prompt(f"dyn/{loader}/ref_after"))
    assert torch.equal(again, reference)
    if loader == LAYERWISE_LOADER:  # both loaders build the same model
        assert torch.equal(reference, dynamic.latent(tiny_prompt(None, prefix="dyn/unet_ref")))


def test_a_lora_before_the_node_is_comfyuis_non_dynamic_lora_run(dynamic):
    unload_everything(dynamic.server)
    dynamic.set_dynamic(False)
    try:
        mark = len(dynamic.server.log_text())
        # A fresh cache (unload_everything) and ComfyUI's classic patcher: its own LoRA, applied as it loads.
        reference = dynamic.latent(one_step_prompt(lora=LORA_NAME, prefix="dyn/lora_ref"))
        assert DYNAMIC_LOAD not in dynamic.log_since(mark)
    finally:
        unload_everything(dynamic.server)
        dynamic.set_dynamic(True)
    plain = dynamic.latent(one_step_prompt(prefix="dyn/lora_none"))
    assert not torch.equal(plain, reference), "the LoRA changes nothing: no test"
    mark = len(dynamic.server.log_text())
    node = dict(resident_layers=2, prefetch_size=1, residency_policy="leading", pin_memory=True, host_store="auto")
    got = dynamic.latent(one_step_prompt(lora=LORA_NAME, offload=node, prefix="dyn/lora_node"))
    new_log = dynamic.log_since(mark)
    assert TAKEN_OVER in new_log, new_log[-3000:]
    assert torch.equal(got, reference), f"max |diff| {(got - reference).abs().max().item()}"
    assert "[dynamic-vram-standin] load_torch_file" in new_log  # the LoRA file (the model was cached)
    assert f"load_torch_file {dynamic.server.base_dir}/models/diffusion_models" not in new_log, new_log[-3000:]
    assert "takes it over as an ordinary model" not in new_log and "To skip the reload" not in new_log


# ------------------------------------------------------------------------------------------------ RAM

DEFAULTS = dict(resident_layers=-1, prefetch_size=1, residency_policy="leading", pin_memory=True, host_store="auto")
#: What the figures may differ by besides the loopback's slots: the server's own memory moves by about 10 MiB
#: between runs here (Python objects, the latent, glibc arenas); one 64 MiB block of the big Wan covers it.
SLACK = 64 * MiB


def rss_parts(pid: int) -> dict:
    """The process's resident memory by kind (/proc/<pid>/status): RssAnon, RssFile, RssShmem, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in status)
                if k in ("RssAnon", "RssFile", "RssShmem")}


class Peak:
    """The cgroup's peak usage from now on: cgroup v1's max_usage_in_bytes (reset by a write), or v2's memory.peak
    reset for one open file (kernel 6.12+). ``None`` where neither can be reset (v2's peak since the cgroup
    was made then says nothing of one run)."""

    def __init__(self, cgroup):
        self.cgroup, self.fd = cgroup, None
        if (cgroup.path / "memory.max_usage_in_bytes").exists():
            cgroup.reset_peak()
            return
        try:
            self.fd = os.open(cgroup.path / "memory.peak", os.O_RDWR)
            os.write(self.fd, b"reset\n")
        except OSError:
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None

    def read(self):
        if (self.cgroup.path / "memory.max_usage_in_bytes").exists():
            return self.cgroup.peak()
        if self.fd is None:
            return None
        try:
            return int(os.pread(self.fd, 64, 0))
        finally:
            os.close(self.fd)


def cgroup_stat(cgroup) -> dict:
    path = cgroup.path / "memory.stat"
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())} if path.exists() else {}


def node_seconds(timeline, node: str) -> float:
    """How long node ``node`` ran: from its ``executing`` event to the next event (the next node's start, or the
    prompt's end)."""
    events = [(when, text) for when, text in timeline if text.startswith("event ")]
    for i, (when, text) in enumerate(events):
        if text == f"event executing {node}":
            return events[i + 1][0] - when
    raise AssertionError(f"node {node} did not run: {events}")


def big_prompt(prefix, offload):
    prompt = one_step_prompt(offload=offload, unet=BIG_NAME, prefix=prefix)
    prompt["6"]["inputs"]["cfg"] = 1.0  # ComfyUI skips the negative: half the compute, the same weights in RAM
    if offload is not None:
        prompt["11"] = {"class_type": "LayerwiseOffloadStats", "inputs": {"model": ["10", 0], "after": ["6", 0]}}
    return prompt


def measure(dynamic, path, label, offload, limit_growth=None) -> dict:
    """One big-Wan prompt from an empty cache and a cold page cache, ``limit_growth`` above what the server held
    before it (None: no limit). Figures are growths from before the prompt: the cgroup's peak, the server's
    resident memory by kind at the end, and from the timeline the loader's, the node's and the model load's time."""
    server, cgroup = dynamic.server, dynamic.cgroup
    unload_everything(server)
    drop_page_cache(path)
    settled_rss(server.proc.pid)  # the unload is done
    before, usage_before = rss_parts(server.proc.pid), cgroup.usage()
    if limit_growth is not None:
        cgroup.set_limit(usage_before + limit_growth)
    peak = Peak(cgroup)
    since, mark = time.time(), len(server.log_text())
    try:
        prefix = "dynram/" + re.sub(r"\W+", "_", label).strip("_") + ("" if limit_growth is None else "_limited")
        entry = server.run_prompt(big_prompt(prefix, offload), timeout=600)
        after, peak, stat = rss_parts(server.proc.pid), peak.read(), cgroup_stat(cgroup)
    finally:
        cgroup.set_limit(None)
    timeline, log = [t for t in dynamic.timeline_lines() if t[0] >= since], dynamic.log_since(mark)

    def at(pattern):
        return next(when for when, text in timeline if re.search(pattern, text))
    run = dict(label=label, latent=saved_latent(server, entry), log=log, limit=limit_growth, stat=stat,
               peak=None if peak is None else peak - usage_before, usage_before=usage_before,
               **{kind: after[kind] - before[kind] for kind in after},
               loader_s=node_seconds(timeline, "1"), sampler_s=node_seconds(timeline, "6"),
               vram_blocks=0, ram_held=0)
    assert log.count(f"load_torch_file {path}") == 1, log[-3000:]  # the loader read it once, nothing else
    assert_no_reload_or_delegate(log.replace(f"load_torch_file {path}", ""))
    if offload is None:
        run["load_s"] = at(DYNAMIC_LOAD) - at("Requested to load")  # ComfyUI's dynamic load
    else:
        assert TAKEN_OVER in log, log[-3000:]
        run["node_s"] = node_seconds(timeline, "10")  # the takeover: the loader's output to the node's
        run["load_s"] = at(r"host store: \d+ blocks packed") - at("Requested to load")  # packing included
        stats = entry["outputs"]["11"]["layerwise_offload"][0]
        run["vram_blocks"], run["ram_held"] = stats["vram"]["blocks"], stats["ram"]["held"]
    return run


def report(run) -> str:
    def mib(n):
        return "n/a" if n is None else f"{n / MiB:+.0f} MiB"
    limit = "no limit" if run["limit"] is None else f"cgroup limit {mib(run['limit'])}"
    node = f"the node {run['node_s'] * 1000:.0f} ms, " if "node_s" in run else ""
    loopback = (f" ({run['vram_blocks'] / MiB:.0f} MiB of it the loopback's \"VRAM\" block copies; the host store "
                f"holds {run['ram_held'] / MiB:.0f} MiB)" if run["vram_blocks"] else "")
    return (f"[layerwise-offload] {run['label']} ({limit}): cgroup peak {mib(run['peak'])}, RSS anonymous "
            f"{mib(run['RssAnon'])} + shmem {mib(run['RssShmem'])} + file {mib(run['RssFile'])}{loopback}; "
            f"page cache at the end {page_cache(run) / MiB:.0f} MiB ({unmapped_cache(run) / MiB:.0f} MiB "
            f"of it mapped by none); times: UNETLoader {run['loader_s'] * 1000:.0f} ms, {node}model load "
            f"{run['load_s']:.2f} s, KSampler (load included) {run['sampler_s']:.2f} s")


def test_ram_with_the_node_is_comfyuis_own_dynamic_load(dynamic):
    """The big Wan (2.1 GiB) by UNETLoader on the dynamic server in its cgroup: ComfyUI alone, then -> the node
    with its defaults with RAM free, then -> the node in a cgroup limited to what ComfyUI alone took plus the
    loopback's two streaming slots (prefetch 1: on a GPU they are VRAM) and :data:`SLACK`.

    What the node may hold beyond ComfyUI: on the CPU loopback the "VRAM" is RAM, so its block copies on the
    "device" (every block resident when RAM is free: auto plans from the free RAM; two streaming slots in the
    limit) are taken off its figures, exactly (the Stats node's ``vram.blocks``). ComfyUI alone holds the weights
    as the file's page cache (aimdo maps the file); the node's host store holds them as anonymous memory (it
    copies the mapped blocks and drops their pages) or leaves them in the file (its disk tier reads them straight
    from the checkpoint) when RAM is short.
    """
    if isinstance(dynamic.cgroup, str):
        pytest.skip(dynamic.cgroup)
    server = dynamic.server
    path = server.base_dir / "models" / "diffusion_models" / BIG_NAME
    figures = write_big_wan(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written back: dropping its page cache then drops all of it (dirty pages stay)
    finally:
        os.close(fd)
    server.run_prompt(one_step_prompt(offload=DEFAULTS, prefix="dynram/warm"))  # imports and caches, tiny model
    slots = 2 * figures["block"]
    alone = measure(dynamic, path, "ComfyUI alone (dynamic)", None)
    # What ComfyUI alone took: its cgroup peak (or, where the peak cannot be reset, its resident memory).
    took = alone["peak"] if alone["peak"] is not None else alone["RssAnon"] + alone["RssShmem"] + alone["RssFile"]
    free = measure(dynamic, path, "-> node (defaults)", DEFAULTS)
    tight = measure(dynamic, path, "-> node (defaults)", DEFAULTS, limit_growth=took + slots + SLACK)
    unload_everything(server)
    print(f"\n[layerwise-offload] ComfyUI 0.33 dynamic VRAM (stand-in), UNETLoader, a {figures['weights'] / MiB:.0f} "
          f"MiB Wan 2.1 ({BIG_NAME}: blocks {figures['blocks'] / MiB:.0f} MiB, 32 of "
          f"{figures['block'] / MiB:.0f} MiB), 1 step; growth from what the server held before each run:")
    for run in (alone, free, tight):
        print(report(run))
    for line in tight["log"].splitlines():
        if "[layerwise-offload] host store" in line or "[layerwise-offload] run:" in line:
            print("  limited: " + line[line.index("[layerwise-offload]"):][:300])

    assert torch.equal(free["latent"], alone["latent"]) and torch.equal(tight["latent"], alone["latent"])
    # RAM free: what the node holds apart from its "VRAM" copies (the host store, anonymous; its ring, shmem) is
    # at most what ComfyUI's dynamic load held in all (its mapped page cache).
    assert held(free) <= took + SLACK, report(free)
    # In the limit (the kernel holds the cgroup to it, page cache reclaimed first) the prompt ran, auto streamed
    # (only the two slots on the "device"), and what the node cannot give back to the kernel fits in what
    # ComfyUI alone took.
    assert tight["vram_blocks"] <= slots and held(tight) <= took + SLACK, report(tight)
    if alone["peak"] is not None:  # the peaks, less the loopback's copies and the page cache nothing maps (clean:
        # the kernel reclaims it before it would fail; the packing leaves about 80 MiB of the checkpoint cached)
        for run in (free, tight):
            assert run["peak"] - run["vram_blocks"] - unmapped_cache(run) <= took + SLACK, report(run)


def held(run) -> int:
    """What the server holds that the kernel cannot reclaim (no swap), less the loopback's "VRAM" block copies."""
    return run["RssAnon"] + run["RssShmem"] - run["vram_blocks"]


def page_cache(run) -> int:
    return run["stat"].get("cache", run["stat"].get("file", 0))  # cgroup v1's name, v2's


def unmapped_cache(run) -> int:
    """The cgroup's page cache that no process maps (clean here: the kernel reclaims it first)."""
    return max(0, page_cache(run) - run["stat"].get("mapped_file", run["stat"].get("file_mapped", 0)))
