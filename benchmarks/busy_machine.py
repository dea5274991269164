"""Start-up on a busy machine: a command run K times under N CPU-bound processes.

Starts ``--busy`` (default 30) processes that spin on the CPU, each stopping by itself
after ``--busy-seconds`` and killed when the script ends, then runs a command ``--tries``
(default 5) times under that load, one after the other. The default command is the
README's PPO command; ``--tests`` runs the README's test command instead (with pytest's
``--capture=tee-sys``, so that the cluster fixture's retry lines are seen); any other
command goes after ``--``. Per try it prints the exit status, the wall time, the Ray
start retries seen (phalanx prints ``phalanx: Ray start try N failed: ...; retrying in
S s`` on stderr per retry) and the time lost to them, then a SUMMARY line. Goal: 0
start-up failures in 5 tries for both commands.

Time lost to retries is measured from the command's start to the end of the wait after
its last retry line: an upper bound, since it includes the process's own imports.

    python benchmarks/busy_machine.py                  # PPO, 30 busy processes, 5 tries
    python benchmarks/busy_machine.py --tests          # the test suite instead
    python benchmarks/busy_machine.py --busy 2 --tries 1 -- phalanx demo
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

PPO_COMMAND = shlex.split("phalanx train ppo --env CartPole-v1 --env-runners 2 --stop-return 450")
TEST_COMMAND = [sys.executable, "-m", "pytest", "-q", "-x", "--capture=tee-sys"]
RETRY_LINE = re.compile(r"phalanx: Ray start try (\d+) failed: .*; retrying in ([\d.]+) s")
# What a start-up that finally failed says (phalanx's RayStartError, or Ray's own error).
START_FAILED = ("Ray did not start", "timed out during startup")
PYTEST_SUMMARY = re.compile(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s")
SPIN = "import time\nend = time.monotonic() + float({seconds})\nwhile time.monotonic() < end:\n    pass\n"


@dataclass
class Try:
    """One run of the command under load."""

    exit_status: int
    wall_s: float
    retries: int = 0
    lost_s: float = 0.0
    start_failed: bool = False
    summary: str = ""
    log: str = ""
    timed_out: bool = False
    left_behind: bool = False
    lines: list[str] = field(default_factory=list, repr=False)


def start_busy(n: int, seconds: float) -> list[subprocess.Popen]:
    """``n`` processes spinning on the CPU, each stopping by itself after ``seconds``."""
    code = SPIN.format(seconds=seconds)
    return [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL) for _ in range(n)
    ]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    """Kill the busy processes this script started (by their own pids) and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run_once(command: list[str], timeout_s: float, log_path: str) -> Try:
    """Run ``command`` once in its own process group, timestamping its output lines."""
    start = time.monotonic()
    stamped: list[tuple[float, str]] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                stamped.append((time.monotonic() - start, line.rstrip("\n")))
                log.write(line)
                if RETRY_LINE.search(line):
                    print(f"    {line.rstrip()}", file=sys.stderr, flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = left_behind = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:  # the command's own process group: whatever it left running, Ray's included
                os.killpg(proc.pid, signal.SIGKILL)
                left_behind = not timed_out
            except ProcessLookupError:
                pass
            proc.wait()
        reader.join(timeout=30)
    result = Try(exit_status=proc.returncode, wall_s=time.monotonic() - start, log=log_path)
    result.timed_out, result.left_behind = timed_out, left_behind
    result.lines = [line for _, line in stamped]
    for at, line in stamped:
        m = RETRY_LINE.search(line)
        if m:
            result.retries += 1
            result.lost_s = at + float(m.group(2))
    result.start_failed = result.exit_status != 0 and any(
        marker in line
        for line in result.lines
        if not RETRY_LINE.search(line)
        for marker in START_FAILED
    )
    summaries = [line.strip("= ") for line in result.lines if PYTEST_SUMMARY.search(line)]
    result.summary = summaries[-1] if summaries else ""
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=30, help="CPU-bound busy processes (default 30)")
    ap.add_argument("--tries", type=int, default=5, help="runs of the command (default 5)")
    ap.add_argument("--tests", action="store_true", help="run the README's test command")
    ap.add_argument(
        "--busy-seconds",
        type=float,
        default=None,
        help="each busy process stops by itself after this (default: tries x try-timeout)",
    )
    ap.add_argument("--try-timeout", type=float, default=1800.0, help="seconds per try")
    ap.add_argument("--log-dir", default=None, help="where each try's output goes (temp dir)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ... to run instead")
    args = ap.parse_args()
    if args.busy < 0:
        ap.error(f"--busy must be >= 0, got {args.busy}")
    if args.tries < 1:
        ap.error(f"--tries must be >= 1, got {args.tries}")
    if args.try_timeout <= 0:
        ap.error(f"--try-timeout must be > 0, got {args.try_timeout:g}")
    if args.busy_seconds is not None and args.busy_seconds <= 0:
        ap.error(f"--busy-seconds must be > 0, got {args.busy_seconds:g}")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command and args.tests:
        ap.error("--tests and a command after -- exclude each other")
    command = command or (TEST_COMMAND if args.tests else PPO_COMMAND)
    busy_seconds = args.busy_seconds or args.tries * args.try_timeout
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="busy_machine_")
    os.makedirs(log_dir, exist_ok=True)

    print(f"command: {' '.join(command)}")
    print(f"load: {args.busy} busy processes on {os.cpu_count()} cores; logs in {log_dir}")
    busy = start_busy(args.busy, busy_seconds)
    tries: list[Try] = []
    try:
        for i in range(1, args.tries + 1):
            t = run_once(command, args.try_timeout, os.path.join(log_dir, f"try{i}.log"))
            tries.append(t)
            load = os.getloadavg()[0]
            status = "timed out" if t.timed_out else f"exit {t.exit_status}"
            print(
                f"try {i}/{args.tries}: {status}, {t.wall_s:.1f} s, {t.retries} Ray start "
                f"retries, {t.lost_s:.1f} s lost to them"
                + (", START-UP FAILED" if t.start_failed else "")
                + (", left processes behind (killed)" if t.left_behind else "")
                + (f", pytest: {t.summary}" if t.summary else "")
                + f", load {load:.1f}",
                flush=True,
            )
    finally:
        stop_busy(busy)
    failures = sum(t.start_failed for t in tries)
    print(
        f"SUMMARY: {failures} start-up failures in {len(tries)} tries, "
        f"{sum(t.exit_status == 0 for t in tries)} exited 0, "
        f"{sum(t.retries for t in tries)} Ray start retries, "
        f"{sum(t.lost_s for t in tries):.1f} s lost to them, "
        f"median wall {sorted(t.wall_s for t in tries)[len(tries) // 2]:.1f} s "
        f"(busy={args.busy}; goal: 0 start-up failures)"
    )
    return 0 if failures == 0 and all(t.exit_status == 0 for t in tries) else 1


if __name__ == "__main__":
    sys.exit(main())
