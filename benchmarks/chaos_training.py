"""The README's tiny GRPO command, clean and with a process of the run killed every few
minutes.

Runs ``phalanx train grpo --model tiny`` as a subprocess twice with the same seed: once
undisturbed, once while a killer sends SIGKILL to one of the run's policy ranks or
generation workers (in turn) every ``--every-min`` to ``--every-max`` seconds, from the end
of the first GRPO step on. Only processes that descend from the run's own driver are
killed.

Reports, per run: exit status (the job is never restarted: a run that does not finish by
itself is a failure), kills sent, the recoveries the run logged (``recovery/*`` rows of
``metrics.jsonl``: seconds from the error to a refitted group, split into shutdown, start
with the state's load, and refit), generation-worker restarts, steps redone, the time per
step, and the final held-out accuracy; then the ratio of the killed run's final accuracy
to the clean run's (goal: within 10%).

    python benchmarks/chaos_training.py [--steps 40] [--every-min 120] [--every-max 240]
        [--seed 1] [--extra "--warmup-steps 50"]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _common import run_with_killer, titled_descendants

ROLES = ("Host_DTensorPolicyWorker", "Host_HFGenerationWorker")


def _role_processes(driver: psutil.Process, role: str) -> list[psutil.Process]:
    """The run's started workers of ``role`` (Ray titles an idle worker ``ray::<role>``
    and a busy one ``ray::<role with [class]>.<method>``)."""
    busy = f"Host[{role.removeprefix('Host_')}]"
    return [
        proc
        for proc, title in titled_descendants(driver)
        if (role in title or busy in title) and not title.rstrip().endswith("__init__")
    ]


def _first_step_done(metrics: Path) -> bool:
    try:
        return any('"reward_mean"' in line for line in metrics.read_text().splitlines())
    except OSError:
        return False


def _killer(driver: psutil.Process, metrics: Path, every: tuple[float, float], seed: int,
            stop: threading.Event, kills: list[tuple[float, str, int]], t0: float) -> None:  # fmt: skip
    """SIGKILL a policy rank or a generation worker (in turn, a random one of the role)
    every ``every`` seconds (uniform), from the end of the first step on."""
    rng = random.Random(seed)
    while not stop.is_set() and not _first_step_done(metrics):
        stop.wait(0.2)
    next_at = time.perf_counter() + rng.uniform(*every)
    turn = 0
    while not stop.is_set():
        if time.perf_counter() >= next_at:
            role = ROLES[turn % len(ROLES)]
            procs = _role_processes(driver, role)
            if procs:
                victim = rng.choice(procs)
                try:
                    os.kill(victim.pid, signal.SIGKILL)
                    kills.append((time.perf_counter() - t0, role, victim.pid))
                    turn += 1
                    next_at = time.perf_counter() + rng.uniform(*every)
                except ProcessLookupError:
                    pass
        stop.wait(0.2)


def run_once(chaos: bool, args: argparse.Namespace) -> dict:
    runs_dir = tempfile.mkdtemp(prefix="phalanx_chaos_grpo_")
    name = f"chaos{int(chaos)}_{args.seed}_{os.getpid()}"
    argv = [sys.executable, "-m", "phalanx.cli", "train", "grpo", "--model", "tiny",
            "--steps", str(args.steps), "--seed", str(args.seed), "--name", name,
            "--runs-dir", runs_dir, "--no-progress", *shlex.split(args.extra)]  # fmt: skip
    run_dir = Path(runs_dir) / name
    t0 = time.perf_counter()
    kills: list[tuple[float, str, int]] = []
    killer = None
    if chaos:

        def killer(driver: psutil.Process, stop: threading.Event) -> None:
            every = (args.every_min, args.every_max)
            _killer(driver, run_dir / "metrics.jsonl", every, args.seed, stop, kills, t0)

    returncode, out, err = run_with_killer(argv, args.timeout, killer)
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r["eval/accuracy"] for r in steps if "eval/accuracy" in r]
    return {
        "chaos": chaos,
        "rc": returncode,
        "wall_s": time.perf_counter() - t0,
        "kills": kills,
        "recoveries": [
            {k.removeprefix("recovery/"): v for k, v in r.items() if k.startswith("recovery/")}
            for r in rows
            if "recovery/seconds" in r
        ],
        "generation_restarts": max((r.get("generation_restarts", 0) for r in steps), default=0),
        "steps": len(steps),
        "median_step_s": statistics.median(r["time/step"] for r in steps) if steps else None,
        "final_accuracy": evals[-1] if evals else None,
        "stderr_tail": "" if returncode == 0 else err[-2000:],
        "stdout_tail": out[-500:],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every-min", type=float, default=120.0, help="seconds between kills, least")
    p.add_argument("--every-max", type=float, default=240.0, help="seconds between kills, most")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--extra", default="", help="more flags for phalanx train grpo")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    args = p.parse_args()
    if not 0 < args.every_min <= args.every_max:
        p.error(f"--every-min {args.every_min} must be > 0 and <= --every-max {args.every_max}")
    results = [run_once(False, args), run_once(True, args)]
    for r in results:
        label = "killed" if r["chaos"] else "clean "
        print(f"{label} rc {r['rc']}  steps {r['steps']}  wall {r['wall_s']:.0f} s  "
              f"median step {r['median_step_s'] or 0:.2f} s  "
              f"final held-out accuracy {r['final_accuracy']}")  # fmt: skip
        for at, role, pid in r["kills"]:
            print(f"  kill at {at:.0f} s: {role} pid {pid}")
        for rec in r["recoveries"]:
            print(f"  recovery at step {rec['step']} ({rec['reason']}; redone: {rec['repeated']}): "
                  f"{rec['seconds']:.1f} s = shutdown {rec['shutdown_seconds']:.1f} + start and "
                  f"load {rec['start_seconds']:.1f} + refit {rec['refit_seconds']:.2f}")  # fmt: skip
        if r["chaos"]:
            print(f"  generation restarts {r['generation_restarts']}; steps redone "
                  f"{len(r['recoveries'])}")  # fmt: skip
        if r["rc"] != 0:
            print(f"  stderr: {r['stderr_tail']}")
    clean, killed = results
    if clean["final_accuracy"] and killed["final_accuracy"] is not None:
        ratio = killed["final_accuracy"] / clean["final_accuracy"]
        print(f"RATIO final held-out accuracy killed / clean: {ratio:.3f} (goal within 10%); "
              f"job restarts: 0; every kill recovered: {killed['rc'] == 0}")  # fmt: skip


if __name__ == "__main__":
    main()
