"""Exits that must always be clean, tried many times: a script that ends with
``ray.shutdown()`` after using a group, and Ctrl-C at a random moment of
``phalanx train ppo``'s start-up.

``shutdown``: runs the script of ``tests/group/test_ray_shutdown.py`` (a group, a channel,
then ``ray.shutdown()``) ``--runs`` times; every run must exit 0 (a crash shows as a
negative status or 134/139; a run that does not exit within ``4 x --exit-within``
seconds is killed and counted as a hang).

``ctrl-c``: starts the README's PPO command ``--runs`` times and sends SIGINT to it at a
random moment in its first ``--window`` seconds; every run must exit 130 (or 0 if it had
finished) within ``--exit-within`` seconds of the signal, leaving none of its processes.

Prints one line per run (a run that does not exit is preceded by the Python stacks of
its process, from ``py-spy dump`` where py-spy is installed), then a ``RESULT`` record
with the counts of exit statuses, the campaign's seconds and the load averages at its
start and end.

    python benchmarks/exit_campaign.py shutdown --runs 100
    python benchmarks/exit_campaign.py ctrl-c --runs 30 --window 10
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.group.test_ray_shutdown import SCRIPT  # noqa: E402

PPO = ["train", "ppo", "--env", "CartPole-v1", "--env-runners", "2", "--stop-return", "450"]


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


def ctrl_c_once(workdir: str, at_s: float, exit_within_s: float) -> tuple[int, str]:
    """Start the PPO command, SIGINT it ``at_s`` seconds later; (exit status, what was
    wrong: a late exit or processes left behind, else empty). A failed run's last stderr
    lines are printed."""
    errfile = open(os.path.join(workdir, "stderr.txt"), "w+")  # noqa: SIM115 - read below
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", *PPO, "--runs-dir", workdir, "--no-progress"],
        cwd=workdir, env=_env(), stdout=subprocess.DEVNULL, stderr=errfile,
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
    if left:
        problem += f" {len(left)} processes left"
        for p in left:
            os.kill(p, signal.SIGKILL)
    if problem or code not in (0, 130):
        errfile.seek(0)
        print("".join(errfile.readlines()[-30:]), flush=True)
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
    args = parser.parse_args()
    # A campaign started in the background inherits an ignored SIGINT (shells do that);
    # its commands must not, or the signal would be lost before they install a handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(args.seed)
    t0, load0 = time.monotonic(), os.getloadavg()
    codes: collections.Counter[int | None] = collections.Counter()
    bad = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="exit_campaign_") as workdir:
            if args.mode == "shutdown":
                code, note = shutdown_once(workdir, args.exit_within * 4)
                ok = code == 0
                note = "" if ok else note
            else:
                at = rng.uniform(0.0, args.window) if args.at is None else args.at
                code, note = ctrl_c_once(workdir, at, args.exit_within)
                note = f"SIGINT at {at:.1f} s" + (f": {note}" if note else "")
                ok = code in (0, 130) and ":" not in note
        codes[code] += 1  # None: no exit within the limit (a hang)
        bad += not ok
        print(f"run {i + 1}/{args.runs}: exit {code} {'ok' if ok else 'FAILED'} {note}", flush=True)
    print("RESULT " + json.dumps({"mode": args.mode, "runs": args.runs, "failed": bad,
                                  "exit_codes": {str(k): v for k, v in codes.items()},
                                  "seconds": round(time.monotonic() - t0),
                                  "load_start": [round(x, 1) for x in load0],
                                  "load_end": [round(x, 1) for x in os.getloadavg()]}))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
