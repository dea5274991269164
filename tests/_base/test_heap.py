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

_CHILD = """
import resource, sys
import torch
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


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_a_freed_large_block_is_reused_without_page_faults() -> None:
    pages = 5 * (64 << 20) // 4096
    assert _faults("default") >= pages  # a fresh mapping each time: every page faults in
    assert _faults("reuse") < pages // 16
