"""Hard-link torch (and the CUDA libraries its wheel pulls in) from one venv of this checkout into another.

Usage: python link_torch.py SOURCE_SITE_PACKAGES TARGET_SITE_PACKAGES TORCH_VERSION TORCHVISION_VERSION

torch's CUDA build is about 5.3 GB of files per venv, and the two test venvs (.venv for ComfyUI 0.3.75,
.venv-0.14.1) hold the same wheels. Linking costs no disk space and pip, seeing the distributions installed,
leaves them alone. Only what lies inside site-packages is linked (console scripts such as torchrun carry the
source venv's interpreter in their first line, so they are left out). pip never rewrites an installed file in
place, so an upgrade in one venv cannot change the other's.

Exit status 0 with "linked N distributions" when done; 1 (after removing whatever it had linked) when the source
does not hold the wanted versions or the two folders are not on one file system: the caller then installs as usual.
"""
import csv
import os
import shutil
import sys
from pathlib import Path

LINKED_NAME_PREFIXES = ("torch-", "torchvision-", "triton-", "nvidia_", "cuda_")


def distributions_to_link(source: Path, torch_version: str, torchvision_version: str) -> list[Path]:
    dist_infos = [p for p in source.glob("*.dist-info") if p.name.startswith(LINKED_NAME_PREFIXES)]
    names = {p.name for p in dist_infos}
    if f"torch-{torch_version}.dist-info" not in names or f"torchvision-{torchvision_version}.dist-info" not in names:
        raise LookupError(f"{source} does not hold torch {torch_version} and torchvision {torchvision_version}")
    return sorted(dist_infos)


def link_tree(source: Path, target: Path, dist_infos: list[Path], made_tops: set[Path]) -> int:
    """Links every recorded file; `made_tops` collects the top-level entries this call created, for undoing."""
    linked = 0
    for dist_info in dist_infos:
        with open(dist_info / "RECORD", newline="") as f:
            recorded = [row[0] for row in csv.reader(f) if row]
        for rel in (p for p in recorded if not p.startswith("..") and not os.path.isabs(p)):
            src, dst = source / rel, target / rel
            if not src.is_file() or dst.exists():
                continue
            top = target / Path(rel).parts[0]
            if not top.exists():
                made_tops.add(top)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
            linked += 1
    return linked


def main() -> int:
    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    torch_version, torchvision_version = sys.argv[3], sys.argv[4]
    made_tops: set[Path] = set()
    try:
        dist_infos = distributions_to_link(source, torch_version, torchvision_version)
        linked = link_tree(source, target, dist_infos, made_tops)
    except (LookupError, OSError) as exc:
        for top in made_tops:
            if top.is_dir():
                shutil.rmtree(top, ignore_errors=True)
            else:
                top.unlink(missing_ok=True)
        print(f"not linked: {exc}", file=sys.stderr)
        return 1
    print(f"linked {len(dist_infos)} distributions ({linked} files) from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
