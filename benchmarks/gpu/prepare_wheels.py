"""Download the wheels the GPU machine lacks and pack them into carry batches (CPU side).

    python benchmarks/gpu/prepare_wheels.py              # into .gpu_wheels/ (git-ignored)
    python benchmarks/gpu/prepare_wheels.py --dry-run    # print the pip command only

Writes ``<dest>/batchN/`` folders, each below ``--budget-mib`` (64 MiB per command, less
the working tree that travels too), each holding parts of wheels and ``manifest.json``;
prints one ``carry`` list per batch for the device tool's ``run``. Versions are pinned to
this machine's installed ones (the versions phalanx is tested with).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wheelkit import (  # noqa: E402
    MANIFEST,
    MIB,
    PACKAGES,
    download_command,
    pinned,
    plan_batches,
    sha256,
    split_file,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=os.path.join(ROOT, ".gpu_wheels"), help="output folder")
    ap.add_argument("--packages", nargs="+", default=None, help="override the package list")
    ap.add_argument("--part-mib", type=int, default=27, help="largest part of a split file")
    ap.add_argument("--budget-mib", type=int, default=56, help="most MiB carried per batch")
    ap.add_argument("--dry-run", action="store_true", help="print the pip command, do nothing")
    args = ap.parse_args(argv)
    for name in ("part_mib", "budget_mib"):
        v = getattr(args, name)
        if v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.budget_mib >= 64:
        ap.error(f"--budget-mib must be < 64 (the working tree travels too), got {args.budget_mib}")
    if args.part_mib > args.budget_mib:
        ap.error(f"--part-mib {args.part_mib} must not exceed --budget-mib {args.budget_mib}")
    return args


def pack(wheel_dir: str, dest: str, part_bytes: int, budget_bytes: int) -> list[str]:
    """Split the wheels of ``wheel_dir`` into parts, plan batches and write ``dest/batchN``
    folders (each with the manifest); returns the batch folders."""
    parts_dir = os.path.join(dest, "parts")
    shutil.rmtree(parts_dir, ignore_errors=True)
    manifest = {}
    for name in sorted(os.listdir(wheel_dir)):
        if not name.endswith(".whl"):
            continue
        path = os.path.join(wheel_dir, name)
        parts = split_file(path, part_bytes, parts_dir)
        manifest[name] = {"sha256": sha256(path), "parts": [os.path.basename(p) for p in parts]}
    if not manifest:
        raise FileNotFoundError(f"no .whl files in {wheel_dir}")
    manifest_text = json.dumps(manifest, indent=1, sort_keys=True)
    sizes = {p: os.path.getsize(os.path.join(parts_dir, p)) for p in os.listdir(parts_dir)}
    batches = plan_batches(sizes, budget_bytes - len(manifest_text) - 4096)
    out = []
    for i, batch in enumerate(batches, 1):
        folder = os.path.join(dest, f"batch{i}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        for p in batch:
            os.replace(os.path.join(parts_dir, p), os.path.join(folder, p))
        with open(os.path.join(folder, MANIFEST), "w") as f:
            f.write(manifest_text)
        out.append(folder)
    shutil.rmtree(parts_dir)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    packages = pinned(args.packages or PACKAGES)
    wheel_dir = os.path.join(args.dest, "wheels")
    cmd = download_command(packages, wheel_dir)
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    shutil.rmtree(wheel_dir, ignore_errors=True)
    os.makedirs(wheel_dir)
    subprocess.run(cmd, check=True)
    batches = pack(wheel_dir, args.dest, args.part_mib * MIB, args.budget_mib * MIB)
    for folder in batches:
        rel = os.path.relpath(folder, ROOT)
        mib = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / MIB
        print(f"carry {json.dumps([rel])}  # {mib:.1f} MiB")
    print(f"{len(batches)} batches: run benchmarks/gpu/install.sh <batch> once per batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
