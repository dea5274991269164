"""Wheels for the lent GPU machine, carried in batches below one command's 64 MiB.

The GPU machine has torch, transformers, peft and numpy on Python 3.12 but no Ray and no
network, and each command there carries at most 64 MiB (the working tree included). So,
on a CPU machine, ``prepare_wheels.py`` downloads the wheels phalanx needs there, splits
files above a part size and packs the parts into batch folders; on the GPU machine
``install.sh`` (this module's ``install`` command) gathers each batch into a staging
folder and, once every part of every wheel is there, reassembles and installs them.

Pure functions here (``split_file``, ``plan_batches``, ``reassemble``) are tested on CPU
in ``tests/gpu/test_kit_cpu.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

MIB = 1 << 20
MANIFEST = "manifest.json"
# The GPU machine's interpreter and platforms (pip matches manylinux_2_N exactly).
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# Missing there, from ray's and phalanx's requirements (the rest ships with that machine's
# image: click, filelock, msgpack, packaging, protobuf, pyyaml, requests, attrs, cloudpickle,
# numpy, typing-extensions, psutil, rich, tqdm, accelerate, pytest, pytest-timeout):
#   ray -> jsonschema -> jsonschema-specifications, referencing, rpds-py
#   gymnasium (each Ray worker preloads it) -> farama-notifications
#   tyro (the command line) -> docstring-parser, typeguard
PACKAGES = (
    "ray",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "gymnasium",
    "farama-notifications",
    "tyro",
    "docstring-parser",
    "typeguard",
)
PART_SUFFIX = ".part"


def sha256(path: str) -> str:
    """Hex SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split_file(path: str, part_bytes: int, out_dir: str) -> list[str]:
    """Cut ``path`` into files of at most ``part_bytes`` in ``out_dir``, named
    ``<name>.partNNN``; returns their paths in order (one part for a small file)."""
    if isinstance(part_bytes, bool) or not isinstance(part_bytes, int) or part_bytes < 1:
        raise ValueError(f"part_bytes must be a positive int, got {part_bytes!r}")
    os.makedirs(out_dir, exist_ok=True)
    name = os.path.basename(path)
    parts = []
    with open(path, "rb") as f:
        while True:
            chunk = f.read(part_bytes)
            if not chunk and parts:
                break
            part = os.path.join(out_dir, f"{name}{PART_SUFFIX}{len(parts):03d}")
            with open(part, "wb") as out:
                out.write(chunk)
            parts.append(part)
            if len(chunk) < part_bytes:
                break
    return parts


def plan_batches(sizes: Mapping[str, int], budget_bytes: int) -> list[list[str]]:
    """Group files (name -> size) into batches of at most ``budget_bytes`` each, largest
    first into the first batch with room (first-fit decreasing); a file larger than the
    budget is an error naming it (split it first)."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    too_big = sorted(n for n, s in sizes.items() if s > budget_bytes)
    if too_big:
        raise ValueError(
            f"files larger than the batch budget of {budget_bytes} bytes: {too_big} (split them)"
        )
    batches: list[list[str]] = []
    room: list[int] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        for i, free in enumerate(room):
            if sizes[name] <= free:
                batches[i].append(name)
                room[i] -= sizes[name]
                break
        else:
            batches.append([name])
            room.append(budget_bytes - sizes[name])
    return [sorted(b) for b in batches]


def reassemble(
    stage_dir: str, manifest: Mapping[str, Mapping[str, object]], out_dir: str
) -> list[str]:
    """Join each wheel's parts from ``stage_dir`` into ``out_dir`` and check its SHA-256;
    returns the wheel paths. A missing part or a wrong digest is an error naming it."""
    os.makedirs(out_dir, exist_ok=True)
    wheels = []
    for name, entry in sorted(manifest.items()):
        parts = [os.path.join(stage_dir, p) for p in entry["parts"]]  # type: ignore[union-attr]
        missing = [os.path.basename(p) for p in parts if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"{name}: parts not carried yet: {missing}")
        path = os.path.join(out_dir, name)
        with open(path, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out)
        if sha256(path) != entry["sha256"]:
            raise ValueError(f"{name}: SHA-256 of the reassembled file does not match the manifest")
        wheels.append(path)
    return wheels


def download_command(packages: Sequence[str], dest: str) -> list[str]:
    """The ``pip download`` command line for cp312 manylinux x86_64 wheels of ``packages``."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", dest,
    ]  # fmt: skip
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + list(packages)


def pinned(packages: Sequence[str]) -> list[str]:
    """``name==version`` with this machine's installed version of each, else the bare name."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in packages:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def install(batch_dir: str, stage: str, target: str, repo: str) -> str | None:
    """Stage ``batch_dir``'s parts; when all are there, install every wheel and phalanx
    into ``target`` and return the PYTHONPATH to use, else None (more batches to carry)."""
    os.makedirs(stage, exist_ok=True)
    for name in os.listdir(batch_dir):
        shutil.copy2(os.path.join(batch_dir, name), os.path.join(stage, name))
    with open(os.path.join(stage, MANIFEST)) as f:
        manifest = json.load(f)
    missing = sorted(
        p
        for e in manifest.values()
        for p in e["parts"]
        if not os.path.exists(os.path.join(stage, p))
    )
    if missing:
        print(f"staged {batch_dir}; still to carry: {len(missing)} parts ({missing[0]} ...)")
        return None
    wheels = reassemble(stage, manifest, os.path.join(stage, "wheels"))
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-cache-dir",
    ]
    subprocess.run([*pip, "--upgrade", "--target", target, *wheels], check=True)
    subprocess.run(
        [*pip, "--upgrade", "--no-build-isolation", "--target", target, repo], check=True
    )
    return target


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("install", help="stage one carried batch; install once all are there")
    ins.add_argument("batch_dir")
    ins.add_argument("--stage", default="/tmp/phalanx_wheels")
    ins.add_argument("--target", default="/tmp/phalanx_site")
    ins.add_argument("--repo", default=".")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.batch_dir):
        ap.error(f"batch_dir {args.batch_dir!r} is not a directory")
    target = install(args.batch_dir, args.stage, args.target, args.repo)
    if target is not None:
        print(f"PYTHONPATH={target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
