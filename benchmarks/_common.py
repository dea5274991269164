"""Timing helpers shared by the benchmark scripts (not a benchmark itself)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each function, run round-robin so noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(title: str, ours: float, baseline: float, goal: str = "") -> None:
    ratio = ours / baseline
    print(
        f"{title}: phalanx {ours * 1e3:.3f} ms, baseline {baseline * 1e3:.3f} ms, ratio {ratio:.3f}x {goal}"
    )
