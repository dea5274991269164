"""Timing and process helpers shared by the benchmark scripts (not a benchmark itself)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


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


def titled_descendants(driver: Any) -> list[tuple[Any, str]]:
    """The processes below ``driver`` (a ``psutil.Process``) with their command lines, which
    Ray sets to what a worker runs (``ray::Host[<class>].<method>``, ``ray::Host_<class>``)."""
    import psutil

    try:
        children = driver.children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for proc in children:
        try:
            out.append((proc, " ".join(proc.cmdline())))
        except psutil.Error:
            continue
    return out


def run_with_killer(
    argv: list[str], timeout_s: float, killer: Callable[[Any, Any], None] | None
) -> tuple[int, str, str]:
    """Run ``argv`` (killed after ``timeout_s``); with ``killer``, ``killer(process, stop)``
    runs on a thread beside it (``process`` a ``psutil.Process``, ``stop`` a
    ``threading.Event`` set when the run ended). Returns the exit status, stdout, stderr."""
    import subprocess
    import threading

    import psutil

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    thread = None
    if killer is not None:
        thread = threading.Thread(target=killer, args=(psutil.Process(proc.pid), stop), daemon=True)
        thread.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    return proc.returncode, out, err
