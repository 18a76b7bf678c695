"""A DiT bigger than its memory allowance runs to the end: Load Diffusion Model (Layerwise) leaves the blocks in
the safetensors file and the offload node streams them from it (host_store auto), bitwise equal to ComfyUI's full
load computed outside the limit. host_store = ram is refused with the clear message and the server keeps serving.

One fresh server inside a memory cgroup (no swap). The model is a real ComfyUI Wan 2.1 of tiny activations but
32 blocks of 64 MiB (2.1 GiB, fp32, written once per module into a tmp folder). In the suite the limit is what the
warm server holds before the model (Python, torch, ComfyUI: about 0.55 GiB here, half this model) plus half the
file, plus what the CPU loopback's "VRAM" holds (the two streaming slots of prefetch 1; a GPU holds those in VRAM).
``LAYERWISE_OFFLOAD_BIG_DIT_BLOCKS=72 LAYERWISE_OFFLOAD_CGROUP_HALF_DIT=1`` runs the strict form: a 4.7 GiB DiT
in a cgroup of half its size, server, loopback slots and all (a few minutes; not in the suite).
The figures printed: the cgroup's peak, the server's anonymous RSS growth, the disk read rate.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch

from layerwise_offload.devtools.server import PromptFailed, prepare_base_dir

from .cgroups import BIG_WAN_NAME as MODEL_NAME, Cgroup, drop_page_cache, server_in, write_big_wan
from .server_support import anon_rss, one_step_prompt, saved_latent, settled_rss, unload_everything

# The whole cgroup is half the DiT (server included), instead of the server's own memory + half the DiT.
HALF_DIT = os.environ.get("LAYERWISE_OFFLOAD_CGROUP_HALF_DIT") == "1"
LOADER = "LayerwiseOffloadLoadDiffusionModel"
MiB = 2**20


@pytest.fixture(scope="module")
def big_server(tmp_path_factory, tiny_assets):
    cgroup = Cgroup()
    base = prepare_base_dir(tmp_path_factory.mktemp("loader_cgroup_base"))
    for kind, sub in (("wan21", "diffusion_models"), ("vae", "vae")):
        (base / "models" / sub / tiny_assets[kind].split("/")[-1]).symlink_to(tiny_assets[kind])
    from layerwise_offload.devtools import e2e_assets
    e2e_assets.copy_cond(tiny_assets, base)
    path = base / "models" / "diffusion_models" / MODEL_NAME
    figures = write_big_wan(path)
    assert path.stat().st_size >= 2 * 2**30
    with server_in(cgroup, base) as server:
        yield server, cgroup, path, figures


def loader_prompt(prefix, offload=None):
    prompt = one_step_prompt(offload=offload, unet=MODEL_NAME, prefix=prefix)
    prompt["1"] = {"class_type": LOADER, "inputs": {"unet_name": MODEL_NAME, "weight_dtype": "default"}}
    return prompt


def test_the_loader_is_registered_with_unetloaders_inputs(big_server):
    server = big_server[0]
    info = server.get_json("/api/object_info/" + LOADER)[LOADER]
    assert info["display_name"] == "Load Diffusion Model (Layerwise)" and info["output"] == ["MODEL"]
    assert list(info["input_order"]["required"]) == ["unet_name", "weight_dtype"]
    assert MODEL_NAME in json.dumps(info["input"]["required"]["unet_name"])
    assert all(d in json.dumps(info["input"]["required"]["weight_dtype"]) for d in ("default", "fp8_e4m3fn", "fp8_e5m2"))


def test_a_dit_twice_its_memory_allowance_runs_from_the_file_and_ram_is_refused(big_server):
    server, cgroup, path, figures = big_server
    before_file = (path.stat().st_size, path.stat().st_mtime_ns)
    offload = {"resident_layers": 0, "prefetch_size": 1, "host_store": "auto"}
    server.run_prompt(one_step_prompt(offload=offload, prefix="bigload/warm"))  # imports and caches, tiny model
    unload_everything(server)
    drop_page_cache(path)
    baseline, rss_before = cgroup.usage(), settled_rss(server.proc.pid)
    # Half the DiT on top of what the server held before it; + the loopback's two streaming slots ("VRAM").
    limit = baseline + path.stat().st_size // 2 + 2 * figures["block"]
    if HALF_DIT:
        limit = path.stat().st_size // 2
        needed = baseline + 6 * figures["block"] + (figures["weights"] - figures["blocks"])
        if limit < needed:
            pytest.skip(f"half the DiT ({limit / MiB:.0f} MiB) is less than the server ({baseline / MiB:.0f} MiB) "
                        f"+ ring, slots and non-block weights: set LAYERWISE_OFFLOAD_BIG_DIT_BLOCKS higher")
    cgroup.set_limit(limit)
    cgroup.reset_peak()
    started = time.perf_counter()
    try:
        entry = server.run_prompt(loader_prompt("bigload/disk", offload), timeout=600)
        rss = anon_rss(server.proc.pid)
    finally:
        peak = cgroup.peak()
    seconds = time.perf_counter() - started
    got = saved_latent(server, entry)
    log = server.log_text()
    allowance = "half the DiT" if HALF_DIT else "server + half the DiT + 2 slots"
    print(f"\n[layerwise-offload] {path.stat().st_size / MiB:.0f} MiB DiT, cgroup limit {limit / MiB:.0f} MiB = "
          f"{allowance} (server {baseline / MiB:.0f} MiB): peak {peak / MiB:.0f} MiB ({(peak - baseline) / MiB:.0f} "
          f"MiB above the server), server anonymous RSS {(rss - rss_before) / MiB:+.0f} MiB, prompt {seconds:.1f} s")
    for line in log.splitlines():
        if "[layerwise-offload]" in line and ("on disk" in line or "disk " in line or "left in the file" in line):
            print(line[line.index("[layerwise-offload]"):][:400])
    found = re.search(r"host store: (\d+) of (\d+) blocks on disk", log)
    assert found and peak <= limit, server.log_tail(30)
    ram_blocks = int(found.group(2)) - int(found.group(1))  # auto keeps what fits beside its 512 MiB margin
    # RSS growth: non-block weights, the staging ring (prefetch 1 + 2 blocks), the blocks auto kept in RAM, the
    # loopback's two slots ("VRAM"), 5 % and 64 MiB of slack.
    non_block = figures["weights"] - figures["blocks"]
    allowed = 1.05 * (non_block + (3 + ram_blocks) * figures["block"]) + 2 * figures["block"] + 64 * MiB
    assert rss - rss_before <= allowed, f"RSS grew {(rss - rss_before) / MiB:.0f} MiB, allowed {allowed / MiB:.0f}"

    # host_store = disk: every block read from the file, RAM grows by the non-block weights and the ring only.
    unload_everything(server)
    rss_before = settled_rss(server.proc.pid)
    entry = server.run_prompt(loader_prompt("bigload/alldisk", dict(offload, host_store="disk")), timeout=600)
    rss = anon_rss(server.proc.pid)
    assert torch.equal(saved_latent(server, entry), got)
    allowed = 1.05 * (non_block + 3 * figures["block"]) + 2 * figures["block"] + 64 * MiB
    print(f"[layerwise-offload] host_store = disk: server anonymous RSS {(rss - rss_before) / MiB:+.0f} MiB "
          f"(non-block weights {non_block / MiB:.0f} MiB + ring {3 * figures['block'] / MiB:.0f} MiB + "
          f"2 loopback slots {2 * figures['block'] / MiB:.0f} MiB)")
    assert rss - rss_before <= allowed, f"RSS grew {(rss - rss_before) / MiB:.0f} MiB, allowed {allowed / MiB:.0f}"

    # The node at its defaults (resident_layers auto, residency_policy auto, host_store auto): the loopback plans its
    # "VRAM" from what the cgroup leaves, as a GPU of that size would, so it never keeps more resident than fits.
    unload_everything(server)
    drop_page_cache(path)
    cgroup.reset_peak()
    try:
        defaults = {"resident_layers": -1, "prefetch_size": 1, "residency_policy": "auto", "host_store": "auto"}
        entry = server.run_prompt(loader_prompt("bigload/defaults", defaults), timeout=600)
    finally:
        peak = cgroup.peak()
    assert torch.equal(saved_latent(server, entry), got)
    log = server.log_text()
    plan = re.findall(r"auto plan: (\d+)/(\d+) blocks resident", log)
    print(f"[layerwise-offload] the node's defaults: peak {peak / MiB:.0f} MiB of {limit / MiB:.0f}; auto plan "
          f"{plan[-1][0] if plan else '?'} of {plan[-1][1] if plan else '?'} blocks resident")
    assert plan and peak <= limit, server.log_tail(30)

    # host_store = ram cannot fit: refused at the node with the message naming the fix, the server keeps serving.
    unload_everything(server)
    with pytest.raises(PromptFailed) as failed:
        server.run_prompt(loader_prompt("bigload/ram", dict(offload, host_store="ram")), timeout=600)
    message = str(failed.value.entry)
    assert "host memory is short" in message and "host_store = disk" in message, message[:2000]
    unload_everything(server)
    assert server.alive()

    # The reference: ComfyUI's own UNETLoader, full load, no limit (after the runs, so its RAM is not their baseline).
    cgroup.set_limit(None)
    reference = saved_latent(server, server.run_prompt(one_step_prompt(unet=MODEL_NAME, prefix="bigload/ref"),
                                                       timeout=600))
    assert torch.equal(got, reference), "not ComfyUI's full-load latent"
    unload_everything(server)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == before_file  # the checkpoint is never written
    folder = server.base_dir / "temp" / "layerwise-offload"
    assert not folder.exists() or not [n for n in os.listdir(folder) if n.endswith((".bin", ".partial"))]
