"""The stats' words: stalls ask for more residents with their cause, hidden copies name what could be freed, and no
figure contradicts another (a speed only with the bytes it moved, the CPU's limits said once)."""

import re

from torch import nn

from layerwise_offload.offload import HostEnvironment, LayerwiseOffloadManager, choose_resident_blocks
from layerwise_offload.nodes.advice import RunReport, block_tiers, recommend

MiB = 2**20


def report(**changes):
    fields = dict(forwards=10, resident_blocks=4, num_blocks=10, resident_bytes=4 * 100 * MiB,
                  bytes_per_forward=6 * 100 * MiB, run_bytes=60 * 100 * MiB, copy_seconds=1.0,
                  stall_seconds=0.0, run_seconds=10.0, peak_device_bytes=0, pinned_host_bytes=0)
    fields.update(changes)
    return RunReport(**fields)


def test_a_stalled_run_asks_for_more_residents():
    text = recommend(report(stall_seconds=4.0), [100 * MiB] * 4)
    assert text.startswith("waiting took 40% of the run") and "raise resident_layers" in text


def test_hidden_copies_name_the_count_and_the_memory_freed():
    # 10 forwards of 1 s with 0.1 s of copies each: 0.9 s spare per forward at 6.3 GB/s hides ~5.4 GB,
    # more than the four resident blocks hold, so all four could be streamed.
    text = recommend(report(), [100 * MiB] * 4)
    assert text == "copies fully hidden: lowering resident_layers to 0 would free 0.4 GiB of VRAM at no cost"
    # 26 ms spare per forward at 6.3 GB/s hides ~160 MB: only the last resident block fits in it.
    tight = report(run_seconds=1.26, copy_seconds=1.0)
    assert recommend(tight, [100 * MiB] * 4).startswith("copies fully hidden: lowering resident_layers to 3")
    none_spare = report(run_seconds=1.0, copy_seconds=1.0)
    assert recommend(none_spare, [100 * MiB] * 4).endswith("keep these settings")


def test_synchronous_copies_are_never_called_hidden():
    text = recommend(report(stall_seconds=0.1, asynchronous=False), [100 * MiB] * 4)
    assert text.startswith("copies took 1% of the run") and "hidden" not in text


def test_figures_per_step_with_the_bytes_behind_the_speed():
    line = report(stall_seconds=0.05, steps=5).figures()  # 10 forwards in 5 steps: cond and uncond apart
    assert line.startswith("5 steps, 4 of 10 blocks in VRAM, 6 streamed")
    assert "1.2 GiB copied per step in 0.20 s (6.29 GB/s), behind 1.99 s of compute" in line
    assert "waited" not in line  # 0.5 % of the run: no wait worth a word
    per_forward = report().figures()  # a sampler that did not say its steps: per forward, not a wrong "step"
    assert per_forward.startswith("10 forwards") and "copied per forward" in per_forward


def test_nothing_copied_gives_no_speed_and_says_what_the_first_step_did():
    # Everything resident: the run copied the blocks once, at the first step.
    everything = report(resident_blocks=10, bytes_per_forward=0, run_bytes=1000 * MiB, stall_seconds=0.5, steps=10)
    line = everything.figures()
    assert "GB/s" not in line and "waited" not in line and "stalled" not in line
    assert "all 10 blocks in VRAM; nothing copied per step (the first step brought the blocks in: 1.0 GiB)" in line
    assert recommend(everything, [100 * MiB] * 10) == "nothing streamed: the model runs as if fully loaded"


def test_a_wait_always_comes_with_its_cause():
    late = report(stall_seconds=2.0, demand_copies=3, steps=10).copy_line()
    assert re.search(r"waited 0\.20 s per step for copies not prefetched in time \(3 blocks copied only when "
                     r"needed\)", late), late
    slow = report(stall_seconds=6.0, copy_seconds=8.0, steps=10).copy_line()
    assert "waited 0.60 s per step for copies: they take longer than the compute they hide behind" in slow


def test_the_cpu_loopback_says_pinning_and_overlap_cannot_happen_instead_of_pin_figures():
    cpu = report(asynchronous=False, device_type="cpu", stall_seconds=1.0, steps=10, pinned_host_bytes=0)
    line = cpu.figures()
    assert "no pinning and no copy/compute overlap on the CPU" in line
    assert "pinned" not in cpu.memory_line() and "pin_memory" not in line
    assert "on top of 0.90 s of compute" in line  # copies add to compute here, they do not hide behind it
    gpu = report(pinned_host_bytes=60 * MiB, host_ram_bytes=100 * MiB, peak_device_bytes=90 * MiB,
                 other_device_bytes=10 * MiB)
    assert gpu.memory_line(24 * 2**30, 64 * 2**30) == ("VRAM 100.0 MiB of 24.0 GiB for this model's weights, "
                                                       "RAM 100.0 MiB of 64.0 GiB held, 60.0 MiB pinned")


def test_prefetch_beyond_the_streamed_blocks_gets_a_word():
    # The slots hold every streamed block: nothing copied after the first step, and the advice says so.
    held = report(resident_blocks=6, bytes_per_forward=0, prefetch_size=64, slot_count=4, steps=10)
    assert "the 4 streaming slots (prefetch_size 64) hold all 4 streamed blocks" in held.figures()
    assert recommend(held, [100 * MiB] * 6) == ("the streaming slots hold every streamed block: "
                                                "resident_layers = 10 runs the same for no more VRAM")
    ahead = report(resident_blocks=6, prefetch_size=8, slot_count=4, steps=10)
    assert "prefetch_size 8 is more than the 4 streamed blocks: at most 4 can be copied ahead" in ahead.figures()
    assert not report(prefetch_size=1).notes()


def test_block_map_in_call_order_with_room_for_a_disk_tier():
    blocks = [nn.Linear(8, 8) for _ in range(5)]
    manager = LayerwiseOffloadManager(blocks, "cpu", resident_layers=2, prefetch_size=1, policy="strided")
    manager.prepare()
    manager.engine.arm()
    stats = manager.stats()
    resident = {i for i, tier in enumerate(stats.block_tiers) if tier == "resident"}
    assert resident == {i for i, kept in enumerate(choose_resident_blocks(5, 2, "strided")) if kept}
    assert block_tiers(stats) == "".join("R" if i in resident else "S" for i in range(5))
    assert stats.slot_count == 2


def test_block_map_shows_blocks_on_disk(tmp_path):
    blocks = [nn.Linear(8, 8) for _ in range(5)]
    manager = LayerwiseOffloadManager(blocks, "cpu", resident_layers=2, prefetch_size=1, policy="strided",
                                      host_store="disk", environment=HostEnvironment(disk_folder=str(tmp_path)))
    manager.prepare()
    manager.engine.arm()
    stats = manager.stats()
    resident = {i for i, tier in enumerate(stats.block_tiers) if tier == "resident"}
    assert len(resident) == 2
    assert block_tiers(stats) == "".join("R" if i in resident else "D" for i in range(5))
    manager.detach()


def test_weight_units_fold_into_one_letter_per_block():
    from layerwise_offload.nodes.advice import tiers_by_block
    # block 0: all in VRAM; 1: part resident, part streamed; 2: all streamed; 3: from disk; 4: no units at all
    assert tiers_by_block("RRRSSSDD", (0, 1, 0, 1, 2, 2, 3, 3), 5) == "RPSDR"
