"""The README's PPO command, clean and with an env runner killed every few seconds.

Runs ``phalanx train ppo --env CartPole-v1 --env-runners 2 --stop-return 450`` as a
subprocess, ``--runs`` times clean and ``--runs`` times while a killer sends SIGKILL to one
of its env runner processes every ``--every`` seconds, from the moment the first runner
process exists: the first ``--startup-kills`` land while the runners are still starting
(in ``__init__``), later ones hit a runner that finished starting. Only
processes that descend from the run's own driver and carry its group name are killed.

Reports, per run: exit status, whether the stop return was reached, the time to reach it
(since the process started), restarts counted by the run, kills sent; then the slowdown
(median time to 450 under kills / median clean). Every run must complete.

    python benchmarks/chaos_ppo.py [--runs 3] [--every 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _common import run_with_killer, titled_descendants

README_COMMAND = [
    "train",
    "ppo",
    "--env",
    "CartPole-v1",
    "--env-runners",
    "2",
    "--stop-return",
    "450",
]


def _runner_processes(driver: psutil.Process, group_prefix: str) -> list[psutil.Process]:
    """The run's env runner processes: descendants of its driver (whose Ray it started)
    titled as env runners (``ray::<group>:<rank>:Host[EnvRunner].__init__`` while starting,
    ``ray::Host[EnvRunner].<method>`` in a call, ``ray::Host_EnvRunner`` between calls)."""
    return [
        proc
        for proc, title in titled_descendants(driver)
        if "Host_EnvRunner" in title
        or (
            "Host[EnvRunner]" in title
            and (group_prefix in title or not title.rstrip().endswith("__init__"))
        )
    ]


def _started(proc: psutil.Process) -> bool:
    """Has the runner finished ``__init__``? (Ray titles a worker with its current call.)"""
    try:
        return not " ".join(proc.cmdline()).rstrip().endswith("__init__")
    except psutil.Error:
        return False


def _killer(driver: psutil.Process, group_prefix: str, every_s: float, startup_kills: int,
            stop: threading.Event, kills: list[tuple[float, int, str]], t0: float) -> None:  # fmt: skip
    """SIGKILL one runner process every ``every_s`` s, starting when the first one exists.

    The first ``startup_kills`` kills take any runner, so they land in ``__init__``; later
    ones take a runner that finished starting (a period shorter than a restart would
    otherwise keep every runner in ``__init__`` for ever on a slow machine).
    """
    turn = 0
    next_at = None
    while not stop.is_set():
        procs = _runner_processes(driver, group_prefix)
        if len(kills) >= startup_kills:
            procs = [p for p in procs if _started(p)]
        now = time.perf_counter()
        if procs and (next_at is None or now >= next_at):
            victim = procs[turn % len(procs)]
            turn += 1
            try:
                title = " ".join(victim.cmdline())
                os.kill(victim.pid, signal.SIGKILL)
                kills.append((now - t0, victim.pid, title.split(".")[-1].strip()[:40]))
            except (psutil.Error, ProcessLookupError):
                continue
            next_at = now + every_s
        stop.wait(0.05)


def run_once(chaos: bool, seed: int, every_s: float, startup_kills: int, timeout_s: float) -> dict:
    runs_dir = tempfile.mkdtemp(prefix="phalanx_chaos_")
    name = f"chaos{int(chaos)}_{seed}_{os.getpid()}"
    argv = [sys.executable, "-m", "phalanx.cli", *README_COMMAND, "--seed", str(seed),
            "--name", name, "--runs-dir", runs_dir, "--no-progress"]  # fmt: skip
    t0 = time.perf_counter()
    kills: list[tuple[float, int, str]] = []
    killer = None
    if chaos:

        def killer(driver: psutil.Process, stop: threading.Event) -> None:
            # the group is named ppo_<name>_<driver pid> (phalanx.algorithms.ppo.train)
            group = f"ppo_{name}_{driver.pid}"
            _killer(driver, group, every_s, startup_kills, stop, kills, t0)

    returncode, out, err = run_with_killer(argv, timeout_s, killer)
    wall = time.perf_counter() - t0
    load = os.getloadavg()[0]
    summary = _summary(out)
    return {
        "chaos": chaos,
        "seed": seed,
        "rc": returncode,
        "wall_s": wall,
        "reached": bool(summary.get("reached_stop_return")),
        "time_to_450_s": summary.get("time_to_stop_return_s"),
        "timesteps": summary.get("timesteps"),
        "restarts": summary.get("restarts"),
        "kills": kills,
        "load_at_end": load,
        "stderr_tail": "" if returncode == 0 else err[-2000:],
        "run_dir": str(Path(runs_dir) / name),
    }


def _summary(stdout: str) -> dict:
    """The JSON summary the command prints (the first ``{ ... }`` block)."""
    start = stdout.find("{\n")
    end = stdout.find("\n}", start)
    if start < 0 or end < 0:
        return {}
    try:
        return json.loads(stdout[start : end + 2])
    except json.JSONDecodeError:
        return {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    p.add_argument("--every", type=float, default=3.0, help="seconds between kills (default 3)")
    p.add_argument("--seed", type=int, default=1, help="seed of the first run (then +1, ...)")
    p.add_argument("--startup-kills", type=int, default=2,
                   help="kills that may hit a runner still in __init__ (default 2)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    args = p.parse_args()
    results = []
    for i in range(args.runs):  # clean and chaos alternate, so load drifts hit both alike
        for chaos in (False, True):
            load_before = os.getloadavg()[0]
            r = run_once(chaos, args.seed + i, args.every, args.startup_kills, args.timeout)
            r["load_before"] = load_before
            results.append(r)
            first_kill = (
                f", first kill at {r['kills'][0][0]:.1f} s ({r['kills'][0][2]})"
                if r["kills"]
                else ""
            )
            t450 = r["time_to_450_s"]
            print(
                f"{'chaos' if chaos else 'clean'} seed {r['seed']}: exit {r['rc']}, reached 450 "
                f"{r['reached']}"
                + (f" at {t450:.1f} s" if t450 is not None else "")
                + f", process wall {r['wall_s']:.1f} s, {r['timesteps']} timesteps, "
                f"restarts {r['restarts']}, kills {len(r['kills'])} "
                f"({sum(k[2].endswith('__init__') for k in r['kills'])} in __init__)"
                f"{first_kill}, "
                f"load average {r['load_before']:.1f} -> {r['load_at_end']:.1f}",
                flush=True,
            )
            if r["rc"] != 0:
                print(r["stderr_tail"], flush=True)
    clean = [r for r in results if not r["chaos"]]
    chaos = [r for r in results if r["chaos"]]
    ok = all(r["rc"] == 0 and r["reached"] for r in results)
    print(f"all {len(results)} runs completed and reached 450: {ok}")
    if ok:
        c = statistics.median(r["time_to_450_s"] for r in clean)
        k = statistics.median(r["time_to_450_s"] for r in chaos)
        print(
            f"median time to 450: clean {c:.1f} s, under kills {k:.1f} s -> slowdown {k / c:.2f}x; "
            f"kills per run {[len(r['kills']) for r in chaos]}, restarts per run "
            f"{[r['restarts'] for r in chaos]}"
        )
        print(f"RATIO time to 450 under a kill every {args.every:g} s / clean: {k / c:.2f}x")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
