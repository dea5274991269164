"""Helpers the tests share: polling with a deadline (never a sleep as synchronisation),
which /dev/shm files a process's tensors live in, which /dev/shm segments this test
process's own Ray made, loading a benchmark script, stopping a process (SIGSTOP) until
every thread of it has stopped, killing a GRPO run's generation worker after its first
step, and making a policy rank die at a named point of a GRPO step."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as a module (the benchmarks are scripts, not a
    package), for tests that check what a benchmark compares. Its sibling imports
    (``_common``) come from ``benchmarks/``, also after a test of the GPU kit imported
    ``benchmarks/gpu/_common.py`` under the same name."""
    cached = sys.modules.pop("_common", None)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("_common", None)
        if cached is not None:
            sys.modules["_common"] = cached
    return mod


def until(pred: Callable[[], Any], timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` s pass; its last value, as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def thread_states(pid: int) -> dict[int, str]:
    """The scheduler state (``R``, ``S``, ``T``...) of every thread of process ``pid``."""
    states = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states[int(tid)] = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread exited meanwhile
            continue
    return states


def stop_process(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (state ``T``); if
    that does not happen within ``timeout`` s, resume it and fail.

    ``kill`` only queues the signal; a thread on another core or in an uninterruptible
    wait stops a moment later, so a test that needs a silent process waits for it.
    """

    def stopped() -> bool:
        if set(thread_states(pid).values()) <= {"T"}:
            return True
        os.kill(pid, signal.SIGSTOP)  # again: a tracer (py-spy, a debugger) may swallow one
        return False

    if not until(stopped, timeout):
        os.kill(pid, signal.SIGCONT)
        raise AssertionError(
            f"process {pid} did not stop within {timeout}s: threads {thread_states(pid)}"
        )


def kill_generation_after_step_1(run_dir: str, killed: list[float]) -> threading.Thread:
    """Kill this process's GRPO generation worker (rank 0) once step 1's metrics row is in
    ``run_dir``, from a thread; the kill's time is appended to ``killed``."""
    import ray

    def kill() -> None:
        metrics = os.path.join(run_dir, "metrics.jsonl")

        def step_1_done() -> bool:
            if not os.path.exists(metrics):
                return False
            with open(metrics) as f:
                return any("reward_mean" in line for line in f)

        if until(step_1_done, 300, interval=0.005):  # start-up takes minutes when loaded
            actor = ray.get_actor(f"grpo_generation_{os.getpid()}:0", namespace="phalanx")
            ray.kill(actor, no_restart=True)
            killed.append(time.monotonic())

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def die_in_next_train(worker: Any) -> None:
    """(On a policy rank) end this process at the next training micro-batch."""
    worker.add_microbatch_hook(lambda: os._exit(1))


def die_in_next_refit(worker: Any) -> None:
    """(On a policy rank) end this process when the next refit asks it for its weights."""
    worker.write_weights_to_shm = lambda *args, **kwargs: os._exit(1)


def kill_plan(plan: dict[int, tuple[Callable[[Any], None], int]]) -> Callable[[int, Any], None]:
    """A GRPO step hook (``train(on_training=...)``): after step ``s``'s training,
    ``plan[s] = (fn, rank)`` runs ``fn`` on that rank of the policy group."""

    def on_training(step: int, policy: Any) -> None:
        if step in plan:
            fn, rank = plan[step]
            policy.worker_group.apply(fn, [(rank, (), {})], label=fn.__name__).wait(timeout=60)

    return on_training


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


_CORE_WORKER_LOG = re.compile(r"^python-core-worker-[0-9a-f]+_(\d+)\.log$")


def ray_worker_pids() -> set[int]:
    """The pids of every worker process the connected Ray has started, alive or gone (from
    its session's log names). A check of something the whole machine shares (/dev/shm)
    uses it to ignore another Ray's processes: the suite runs in two pytest-xdist workers,
    each with its own Ray."""
    import ray

    pids: set[int] = set()
    for node in ray.nodes() if ray.is_initialized() else []:
        logs = Path(node["RayletSocketName"]).parents[1] / "logs"
        for folder in (logs, logs / "old"):
            names = os.listdir(folder) if folder.is_dir() else []
            pids.update(int(m.group(1)) for m in map(_CORE_WORKER_LOG.match, names) if m)
    return pids


def our_segments(names: Iterable[str]) -> dict[str, int]:
    """Those phalanx /dev/shm segment names (``px_<tag>_<pid>-...``) made by this process or
    by a worker of the connected Ray, each with the pid that made it."""
    from phalanx.comm.shm import owner_pid

    ours = ray_worker_pids() | {os.getpid()}
    owners = {n: owner_pid(n) for n in names}
    return {n: pid for n, pid in owners.items() if pid in ours}
