"""reuse_freed_memory: a large block freed and allocated again reuses the same pages
(no fresh page faults) instead of a new mmap the kernel has to zero."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt"),
]

# The child is a Ray worker process as phalanx's policy workers are (Ray's core library
# loaded): reuse depends on the heap's layout, and in a bare torch process torch's aligned
# 64 MiB blocks may still be served from new pages.
_CHILD = """
import resource, sys
import torch
import ray._raylet
from phalanx._base.heap import reuse_freed_memory
if sys.argv[1] == "reuse":
    assert reuse_freed_memory() is True
def touch():
    x = torch.empty(16 << 20, dtype=torch.float32)  # 64 MiB, over glibc's mmap threshold
    x.fill_(1.0)
    del x
for _ in range(3):  # warm-up: the heap grows to its working size
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(*modes: str) -> list[int]:
    """Page faults of each mode's child; the children run side by side (each counts its own)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for mode in modes
    ]
    try:
        outs = [proc.communicate(timeout=50) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    return [int(out.split()[-1]) for out, _ in outs]


def test_a_freed_large_block_is_reused_without_page_faults() -> None:
    pages = 5 * (64 << 20) // 4096
    default, reuse = _faults("default", "reuse")
    assert default >= pages  # a fresh mapping each time: every page faults in
    assert reuse < pages // 16
