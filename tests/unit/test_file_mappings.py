"""MappedFiles: a tensor over another loader's read-only file mapping is found at its file offset; memory that may
differ from the file (private, writable, anonymous, a deleted or replaced file) never is."""

import os
import warnings

import numpy as np
import pytest
import torch

from layerwise_offload.offload.disk.mappings import MappedFiles

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")


def _file(tmp_path, name="weights.bin", nbytes=3 * 4096 + 100):
    path = tmp_path / name
    path.write_bytes(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    return path


def _mapped(path, mode):
    """A tensor over a numpy.memmap of ``path``, as ComfyUI-GGUF makes its weights."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode=mode))


def test_a_view_of_a_read_only_memmap_is_found_at_its_file_offset(tmp_path):
    path = _file(tmp_path)
    whole = _mapped(path, "r")
    part = whole[5000:9000]
    where = MappedFiles().locate(part)
    assert where == (os.path.realpath(path), 5000, 4000)
    with open(where[0], "rb") as file:
        file.seek(where[1])
        assert file.read(where[2]) == part.numpy().tobytes()
    as_floats = whole[4096:4096 + 64].view(torch.float32)
    assert MappedFiles().locate(as_floats) == (os.path.realpath(path), 4096, 64)


@pytest.mark.parametrize("mode", ["c", "r+"])
def test_memory_the_process_may_have_written_is_not_the_files(tmp_path, mode):
    # "c": a private copy-on-write mapping; "r+": a shared writable one (its bytes are the file's now, but a
    # write in place would change the file itself under the disk tier).
    assert MappedFiles().locate(_mapped(_file(tmp_path), mode)[100:200]) is None


def test_a_private_read_only_mapping_is_the_files(tmp_path):
    """ComfyUI 0.33+'s dynamic VRAM maps safetensors private and read-only (comfy-aimdo's ModelMMAP): a write there
    faults, so its bytes are the file's."""
    import mmap
    path = _file(tmp_path)
    with open(path, "rb") as file:
        area = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(area, dtype=torch.uint8)
    assert MappedFiles().locate(whole[5000:9000]) == (os.path.realpath(path), 5000, 4000)


def test_anonymous_and_strided_tensors_are_not_located(tmp_path):
    assert MappedFiles().locate(torch.arange(1000, dtype=torch.uint8)) is None
    grid = _mapped(_file(tmp_path), "r")[:4096].view(64, 64)
    assert MappedFiles().locate(grid.t()) is None
    assert MappedFiles().locate(grid[:, :0]) is None


def test_a_deleted_or_replaced_file_is_not_named(tmp_path):
    deleted = _mapped(_file(tmp_path, "deleted.bin"), "r")
    os.unlink(tmp_path / "deleted.bin")
    assert MappedFiles().locate(deleted[:100]) is None
    replaced = _mapped(_file(tmp_path, "replaced.bin"), "r")
    _file(tmp_path, "new.bin")
    os.replace(tmp_path / "new.bin", tmp_path / "replaced.bin")
    assert MappedFiles().locate(replaced[:100]) is None


def test_a_mapping_the_kernel_split_in_two_is_one_span(tmp_path):
    path = _file(tmp_path)
    inode = os.stat(path).st_ino
    real = os.path.realpath(path)
    maps = tmp_path / "maps"
    maps.write_text(f"10000-12000 r--s 00000000 fe:00 {inode}  {real}\n"
                    f"12000-14000 r--s 00002000 fe:00 {inode}  {real}\n"
                    f"14000-15000 rw-p 00004000 fe:00 {inode}  {real}\n"
                    f"20000-21000 rw-p 00000000 00:00 0  [heap]\n")
    spans = MappedFiles(str(maps))
    assert spans.spans == [(0x10000, 0x14000, real, 0)]
    assert MappedFiles(str(tmp_path / "no-such-file")).spans == []


def test_a_weight_over_a_read_only_mapping_frees_no_ram_when_packed(tmp_path):
    from layerwise_offload.offload.disk.budget import freed_by_packing

    weight = torch.nn.Parameter(_mapped(_file(tmp_path), "r")[:8192].view(torch.float16), requires_grad=False)
    mapped = MappedFiles()
    assert mapped.holds_storage(weight) and not mapped.holds_storage(torch.ones(10))
    # ComfyUI-GGUF's weights: their bytes are page cache, and packing them into RAM adds their whole size.
    assert freed_by_packing([weight], mapped) == 0
    assert freed_by_packing([torch.nn.Parameter(torch.ones(2048), requires_grad=False)], mapped) == 8192


def _resident_kib(address: int) -> int:
    """Rss of the mapping holding ``address`` in /proc/self/smaps, in KiB."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_packing_gives_back_the_pages_it_read_through_the_mapping(tmp_path):
    path = _file(tmp_path, nbytes=64 * 4096)
    block = _mapped(path, "r")[4096:60 * 4096]
    copy = block.clone()  # read once, as packing copies it
    assert _resident_kib(block.data_ptr()) >= 56 * 4
    MappedFiles().drop_pages([block])
    assert _resident_kib(block.data_ptr()) <= 8 * 4  # at most the 8 pages around the block (fault-around)
    assert block.numpy().tobytes() == copy.numpy().tobytes() == path.read_bytes()[4096:60 * 4096]  # refaulted


def test_without_proc_self_maps_nothing_is_located_and_nothing_is_called(tmp_path, monkeypatch):
    """Windows and macOS: no /proc/self/maps. The snapshot is empty, packing's page hand-back returns at once
    (it would otherwise load libc, which ctypes cannot do by that name there)."""
    import layerwise_offload.offload.disk.mappings as file_mappings

    snapshot = MappedFiles(str(tmp_path / "no-maps"))
    weight = _mapped(_file(tmp_path), "r")[:4096]
    assert snapshot.locate(weight) is None and not snapshot.holds_storage(weight)
    monkeypatch.setattr(file_mappings, "_madvise", lambda: pytest.fail("libc looked up with nothing to give back"))
    snapshot.drop_pages([weight, torch.ones(3)])
