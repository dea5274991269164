"""Exits that must always be clean, tried many times: a script that ends with
``ray.shutdown()`` after using a group, and Ctrl-C at a random moment of
``phalanx train ppo``'s start-up.

``shutdown``: runs the script of ``tests/group/test_ray_shutdown.py`` (a group, a channel,
then ``ray.shutdown()``) ``--runs`` times; every run must exit 0 (a crash shows as a
negative status or 134/139; a run that does not exit within ``4 x --exit-within``
seconds is killed and counted as a hang).

``ctrl-c``: starts the README's PPO command ``--runs`` times and sends SIGINT to it at a
random moment in its first ``--window`` seconds; every run must exit 130 (or 0 if it had
finished) within ``--exit-within`` seconds of the signal, print no traceback, and leave
none of its processes (those that carry the run's mark in their environment: Ray's too).
``--entry script`` starts it as the installed ``phalanx`` command does (its entry point
from ``pyproject.toml``), ``--entry module`` as ``python -m phalanx.cli``.

Prints one line per run (a run that does not exit is preceded by the Python stacks of
its process, from ``py-spy dump`` where py-spy is installed), then a ``RESULT`` record
with the counts of exit statuses, the campaign's seconds and the load averages at its
start and end.

    python benchmarks/exit_campaign.py shutdown --runs 100
    python benchmarks/exit_campaign.py ctrl-c --runs 30 --window 10
    python benchmarks/exit_campaign.py ctrl-c --runs 30 --window 3 --entry script
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.group.test_ray_shutdown import SCRIPT  # noqa: E402

PPO = ["train", "ppo", "--env", "CartPole-v1", "--env-runners", "2", "--stop-return", "450"]
MARK = "PHALANX_EXIT_CAMPAIGN_RUN"  # environment variable that every process of a run inherits


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def print_stacks(pid: int) -> None:
    """Print the Python stacks of process ``pid`` (py-spy), or why they are missing."""
    try:
        dump = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
        print(dump.stdout or dump.stderr, flush=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"no stacks of process {pid}: {e}", flush=True)


def shutdown_once(workdir: str, limit_s: float) -> tuple[int | None, str]:
    """One run of the script; (exit status, or None when it did not exit within
    ``limit_s``; the last stage it printed and the last line of its stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], cwd=workdir, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        print_stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    stages = [ln.split()[0] for ln in out.splitlines() if ln.startswith(("before", "after"))]
    tail = (err.strip().splitlines() or [""])[-1][:200]
    return code, f"stages {stages}; {tail}"


def entry_command(entry: str) -> list[str]:
    """How to start the ``phalanx`` command: ``module`` (``python -m phalanx.cli``) or
    ``script`` (what the installed console script runs: its entry point, then ``sys.exit``)."""
    if entry == "module":
        return [sys.executable, "-m", "phalanx.cli"]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        scripts = f.read().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    path, function = scripts.split('phalanx = "', 1)[1].split('"', 1)[0].split(":")
    return [
        sys.executable,
        "-c",
        f"import sys; from {path} import {function}; sys.exit({function}())",
    ]


def marked_processes(mark: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``MARK=mark`` (not zombies)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
    return found


def ctrl_c_once(workdir: str, at_s: float, exit_within_s: float, entry: str) -> tuple[int, str]:
    """Start the PPO command, SIGINT it ``at_s`` seconds later; (exit status, what was
    wrong: a late exit, a traceback or processes left behind, else empty). A failed run's
    last stderr lines are printed."""
    errfile = open(os.path.join(workdir, "stderr.txt"), "w+")  # noqa: SIM115 - read below
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [*entry_command(entry), *PPO, "--runs-dir", workdir, "--no-progress"],
        cwd=workdir, env={**_env(), MARK: mark}, stdout=subprocess.DEVNULL, stderr=errfile,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        proc.wait(timeout=at_s)
    except subprocess.TimeoutExpired:
        pass
    family = set()
    if proc.poll() is None:
        family = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        proc.send_signal(signal.SIGINT)
    problem = ""
    try:
        code = proc.wait(timeout=exit_within_s)
    except subprocess.TimeoutExpired:
        problem = f"no exit within {exit_within_s:g} s of SIGINT"
        print_stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    left = [p for p in family if psutil.pid_exists(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in family if psutil.pid_exists(p)]
    left = [p for p in left if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    marked = marked_processes(mark)
    while marked and time.monotonic() < deadline:
        time.sleep(0.2)
        marked = marked_processes(mark)
    left = sorted(set(left) | {p.pid for p in marked})
    if left:
        problem += f" {len(left)} processes left"
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    errfile.seek(0)
    err = errfile.read()
    if "Traceback" in err:
        problem += " traceback"
    if problem or code not in (0, 130):
        print("\n".join(err.splitlines()[-30:]), flush=True)
    errfile.close()
    return code, problem.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["shutdown", "ctrl-c"])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--window", type=float, default=10.0, help="ctrl-c: latest signal (s)")
    parser.add_argument("--exit-within", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--at", type=float, default=None, help="ctrl-c: signal at this second")
    parser.add_argument("--entry", choices=["module", "script"], default="module")
    args = parser.parse_args()
    # A campaign started in the background inherits an ignored SIGINT (shells do that);
    # its commands must not, or the signal would be lost before they install a handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(args.seed)
    t0, load0 = time.monotonic(), os.getloadavg()
    codes: collections.Counter[int | None] = collections.Counter()
    bad = 0
    problems: collections.Counter[str] = collections.Counter()
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="exit_campaign_") as workdir:
            if args.mode == "shutdown":
                code, note = shutdown_once(workdir, args.exit_within * 4)
                ok = code == 0
                note = "" if ok else note
            else:
                at = rng.uniform(0.0, args.window) if args.at is None else args.at
                code, note = ctrl_c_once(workdir, at, args.exit_within, args.entry)
                note = f"SIGINT at {at:.1f} s" + (f": {note}" if note else "")
                ok = code in (0, 130) and ":" not in note
        codes[code] += 1  # None: no exit within the limit (a hang)
        bad += not ok
        problems.update(k for k in ("traceback", "processes left", "no exit") if k in note)
        print(f"run {i + 1}/{args.runs}: exit {code} {'ok' if ok else 'FAILED'} {note}", flush=True)
    print("RESULT " + json.dumps({"mode": args.mode, "runs": args.runs, "failed": bad,
                                  "problems": dict(problems),
                                  "exit_codes": {str(k): v for k, v in codes.items()},
                                  "seconds": round(time.monotonic() - t0),
                                  "load_start": [round(x, 1) for x in load0],
                                  "load_end": [round(x, 1) for x in os.getloadavg()]}))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
