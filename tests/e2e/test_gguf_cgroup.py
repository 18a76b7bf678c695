"""GGUF on a host short of RAM: ComfyUI-GGUF's loader (unmodified, from shared/peers) -> the node, in a fresh server
inside a memory cgroup that holds the server and half the .gguf file, runs to the end wherever ComfyUI-GGUF alone
does there, bitwise equal, and reads the blocks that do not fit in RAM straight from the .gguf (ComfyUI-GGUF maps
the file read-only and its weights are views of it): no cache file is written, the file is never changed.

The model is a real ComfyUI Wan 2.1 of tiny activations and 16 F16 blocks of 32 MiB (0.5 GiB); a second one of
the same shape is the low-noise expert when two take turns, as in Wan 2.2. On the CPU loopback
the manager's "VRAM" (two streaming slots) is host memory too, so the limit has room for them, as a GPU would hold
them in VRAM. Skipped where no memory cgroup can be made, or where shared/peers or gguf is missing.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from layerwise_offload.devtools import e2e_assets, peers, tiny_dits
from layerwise_offload.devtools.quantized_models import save_gguf, save_tiny_wan21_gguf
from layerwise_offload.devtools.server import prepare_base_dir

from .cgroups import Cgroup, drop_page_cache, server_in
from .server_support import anon_rss, one_step_prompt, saved_latent, settled_rss, unload_everything

pytest.importorskip("gguf", reason="the gguf package (a dev package of scripts/setup_env.sh) is not installed")
if peers.peer_tarball() is None:
    pytest.skip(f"no shared/peers/{peers.GGUF_TARBALL} beside the repository (set LAYERWISE_OFFLOAD_SHARED)",
                allow_module_level=True)

MODEL_NAME = "layerwise_offload_big_wan21_F16.gguf"
LOW_NOISE_NAME = "layerwise_offload_big_wan21_low_noise_F16.gguf"  # the second expert of a Wan 2.2-style graph
WARM_NAME = "layerwise_offload_tiny_wan21_F16.gguf"
CONFIG = dict(tiny_dits.WAN21_TINY_CONFIG, dim=1024, num_heads=8, ffn_dim=4096, num_layers=16)
MiB = 2**20


@pytest.fixture(scope="module")
def gguf_cgroup_server(tmp_path_factory, tiny_assets):
    cgroup = Cgroup()
    base = prepare_base_dir(tmp_path_factory.mktemp("gguf_cgroup_base"))
    peers.unpack_peer(base / "custom_nodes")
    (base / "models" / "vae" / tiny_assets["vae"].split("/")[-1]).symlink_to(tiny_assets["vae"])
    e2e_assets.copy_cond(tiny_assets, base)
    models = base / "models" / "diffusion_models"
    save_tiny_wan21_gguf(models / WARM_NAME, "F16", seed=0)
    for name, seed in ((MODEL_NAME, 11), (LOW_NOISE_NAME, 12)):
        patcher = tiny_dits._build("WAN21_T2V", CONFIG, seed, torch.float32)
        state = {k: v.detach().contiguous() for k, v in patcher.model.diffusion_model.state_dict().items()}
        del patcher
        save_gguf(state, models / name, "F16")
    path = models / MODEL_NAME
    block = sum(t.nbytes for k, t in state.items() if k.startswith("blocks.0.") and t.ndim == 2) // 2 + sum(
        t.nbytes for k, t in state.items() if k.startswith("blocks.0.") and t.ndim != 2)
    non_block = sum(t.nbytes for k, t in state.items() if not k.startswith("blocks."))
    del state
    with server_in(cgroup, base) as server:
        yield server, cgroup, path, block, non_block


def gguf_prompt(name, prefix, offload=None):
    prompt = one_step_prompt(offload=offload, prefix=prefix)
    prompt["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}}
    return prompt


def two_expert_prompt(prefix, offload=None):
    """Wan 2.2's graph: the high-noise expert samples step 1 of 2 and hands its noisy latent to the low-noise one
    (KSamplerAdvanced, as ComfyUI's Wan 2.2 template), each through its own offload node."""
    prompt = gguf_prompt(MODEL_NAME, prefix, offload)
    prompt["21"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": LOW_NOISE_NAME}}
    prompt["25"] = {"class_type": "ModelSamplingSD3", "inputs": {"model": ["21", 0], "shift": 8.0}}
    if offload is not None:
        prompt["30"] = dict(prompt["10"], inputs=dict(prompt["10"]["inputs"], model=["21", 0]))
        prompt["25"]["inputs"]["model"] = ["30", 0]
    common = {"positive": ["2", 1], "negative": ["3", 0], "noise_seed": 42, "steps": 2, "cfg": 2.0,
              "sampler_name": "euler", "scheduler": "simple"}
    prompt["6"] = {"class_type": "KSamplerAdvanced", "inputs": dict(
        common, model=["5", 0], latent_image=["4", 0], add_noise="enable", start_at_step=0, end_at_step=1,
        return_with_leftover_noise="enable")}
    prompt["26"] = {"class_type": "KSamplerAdvanced", "inputs": dict(
        common, model=["25", 0], latent_image=["6", 0], add_noise="disable", start_at_step=1, end_at_step=2,
        return_with_leftover_noise="disable")}
    prompt["7"]["inputs"]["samples"] = ["26", 0]
    return prompt


def run(server, cgroup, limit, prefix, offload=None, prompt=None):
    for name in (MODEL_NAME, LOW_NOISE_NAME):
        drop_page_cache(server.base_dir / "models" / "diffusion_models" / name)
    unload_everything(server)
    rss_before = settled_rss(server.proc.pid)
    cgroup.set_limit(limit)
    cgroup.reset_peak()
    started = time.perf_counter()
    try:
        entry = server.run_prompt(prompt or gguf_prompt(MODEL_NAME, prefix, offload), timeout=600)
        rss = anon_rss(server.proc.pid)
    finally:
        peak = cgroup.peak()
        cgroup.set_limit(None)
    print(f"\n[layerwise-offload] {prefix}: limit {limit / MiB:.0f} MiB, cgroup peak {peak / MiB:.0f} MiB, server "
          f"anonymous RSS {(rss - rss_before) / MiB:+.0f} MiB, prompt {time.perf_counter() - started:.1f} s")
    return saved_latent(server, entry), rss - rss_before


def test_gguf_in_half_its_size_runs_from_the_gguf_file_wherever_comfyui_gguf_alone_does(gguf_cgroup_server):
    server, cgroup, path, block, non_block = gguf_cgroup_server
    before_file = (path.stat().st_size, path.stat().st_mtime_ns)
    offload = {"resident_layers": 0, "prefetch_size": 1, "host_store": "auto"}
    server.run_prompt(gguf_prompt(WARM_NAME, "ggufcg/warm", offload))  # imports, caches: the tiny GGUF
    unload_everything(server)
    # The server as it is, half the .gguf on top, and the loopback's two streaming slots ("VRAM" on a GPU).
    limit = cgroup.usage() + path.stat().st_size // 2 + 2 * block
    alone, _ = run(server, cgroup, limit, "ggufcg/alone")
    log_start = len(server.log_text())
    got, grown = run(server, cgroup, limit, "ggufcg/auto", offload)
    assert torch.equal(got, alone), "not ComfyUI-GGUF's latent"
    log = server.log_text()[log_start:]
    for line in log.splitlines():
        if "[layerwise-offload]" in line and ("on disk" in line or "from the checkpoint" in line):
            print(line[line.index("[layerwise-offload]"):][:300])
    on_disk = re.search(r"host store: (\d+) of (\d+) blocks on disk", log)
    from_file = re.search(r"(\d+) disk blocks read straight from the checkpoint \(nothing written for them\), "
                          r"(\d+) from the cache file", log)
    assert on_disk and from_file, server.log_tail(30)
    assert int(from_file.group(1)) == int(on_disk.group(1)) > 0 and from_file.group(2) == "0", (
        on_disk.group(0), from_file.group(0))
    # Anonymous RAM: the blocks auto kept in RAM, the staging ring (prefetch 1 + 2 blocks), the loopback's two
    # slots, the non-block weights, 5 % and 64 MiB of slack; never the blocks read from the file.
    in_ram = int(on_disk.group(2)) - int(on_disk.group(1))
    allowed = 1.05 * (non_block + (3 + in_ram) * block) + 2 * block + 64 * MiB
    assert grown <= allowed, f"RSS grew {grown / MiB:.0f} MiB, allowed {allowed / MiB:.0f}"

    unload_everything(server)
    assert server.alive()
    assert (path.stat().st_size, path.stat().st_mtime_ns) == before_file  # the .gguf is never written
    folder = server.base_dir / "temp" / "layerwise-offload"
    assert not folder.exists() or not [n for n in os.listdir(folder) if n.startswith("layerwise-offload-")]


def test_two_gguf_experts_alternate_reading_their_blocks_from_their_files(gguf_cgroup_server):
    """The Wan 2.2 GGUF template's state: two experts take turns in one prompt; neither one's blocks are copied into
    RAM, each is read from its own .gguf, bitwise ComfyUI-GGUF alone in the same cgroup."""
    server, cgroup, path, block, non_block = gguf_cgroup_server
    offload = {"resident_layers": 0, "prefetch_size": 1, "host_store": "auto"}
    unload_everything(server)
    # The server, half of one expert's .gguf, and per expert the loopback's two slots and the staging ring (3
    # blocks: what host_store = disk holds in RAM), which ComfyUI-GGUF alone does not need.
    limit = cgroup.usage() + path.stat().st_size // 2 + 2 * 5 * block
    alone, _ = run(server, cgroup, limit, "ggufcg/experts_alone", prompt=two_expert_prompt("ggufcg/experts_alone"))
    log_start = len(server.log_text())
    got, grown = run(server, cgroup, limit, "ggufcg/experts",
                     prompt=two_expert_prompt("ggufcg/experts", offload))
    assert torch.equal(got, alone), "two experts: not ComfyUI-GGUF's latent"
    log = server.log_text()[log_start:]
    on_disk = re.findall(r"host store: (\d+) of (\d+) blocks on disk", log)
    from_file = re.findall(r"(\d+) disk blocks read straight from the checkpoint \(nothing written for them\), "
                           r"(\d+) from the cache file", log)
    assert len(on_disk) == len(from_file) == 2, server.log_tail(40)  # one host store per expert
    assert all(int(f[0]) == int(d[0]) > 0 and f[1] == "0" for d, f in zip(on_disk, from_file)), (on_disk, from_file)
    in_ram = sum(int(d[1]) - int(d[0]) for d in on_disk)
    allowed = 1.05 * (2 * non_block + (2 * 3 + in_ram) * block) + 2 * 2 * block + 64 * MiB
    assert grown <= allowed, f"two experts: RSS grew {grown / MiB:.0f} MiB, allowed {allowed / MiB:.0f}"
    unload_everything(server)
    assert server.alive()
