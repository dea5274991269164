"""Helpers the tests share: polling with a deadline (never a sleep as synchronisation),
which /dev/shm files a process's tensors live in, and loading a benchmark script."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as a module (the benchmarks are scripts, not a
    package), for tests that check what a benchmark compares."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def until(pred: Callable[[], Any], timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` s pass; its last value, as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def shm_files(tensors: Iterable[Any]) -> tuple[set[str], int]:
    """(the /dev/shm files these tensors' data lie in, how many lie in none: private)."""
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi, parts[5]))
    files: set[str] = set()
    private = 0
    for t in tensors:
        hit = {p for lo, hi, p in maps if lo <= t.data_ptr() < hi}
        files |= hit
        private += not hit
    return files, private
