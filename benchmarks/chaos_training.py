"""The README's tiny GRPO command (or, with ``--algo ppo``, its PPO command), clean and
with a process of the run killed every few minutes (PPO: seconds).

Runs ``phalanx train grpo --model tiny`` as a subprocess twice with the same seed: once
undisturbed, once while a killer sends SIGKILL to one of the run's processes every
``--every-min`` to ``--every-max`` seconds, from the end of the first GRPO step on. Only
processes that descend from the run's own driver are killed. ``--victim any`` (the
default) kills a policy rank or a generation worker in turn, whatever they are doing;
``--victim policy-rank`` kills policy rank ``--rank`` mid-step: the killer waits (with a
deadline) until that rank's process is inside ``train``. The rank's process is known from
its title while it starts (Ray titles it ``ray::<group>:<rank>:...__init__``), at the
run's start and at every relaunch; it is inside ``train`` while its title ends in
``.train``. ``--victim policy-idle`` kills policy rank ``--rank`` while the policy is idle:
while a generation worker is inside ``generate``. ``--policy-ranks`` sets the size of the
FSDP policy group.

Reports, per run: exit status (the job is never restarted: a run that does not finish by
itself is a failure), kills sent, the recoveries the run logged (``recovery/*`` rows of
``metrics.jsonl``), generation-worker restarts, steps redone, the time per step, and the
final held-out accuracy; per kill of a policy rank, the seconds from the kill to the step's
restart (the recovery row's time), split into worker start-up, state load, refit and the
rest (noticing the death, shutting the old group down); per kill of an idle policy rank,
the seconds from the kill to the death being seen and to the relaunched group being ready,
and how long the next policy call waited for it; then the ratio of the killed run's
final accuracy to the clean run's (goal: within 10%).

``--algo ppo`` runs ``phalanx train ppo --env CartPole-v1 --env-runners 2 --stop-return
450`` (with ``--num-learners 1`` unless that is the default) clean and with the learner and
an env runner killed in turn every ``--every-min`` to ``--every-max`` seconds (default 4-8)
from the end of the first iteration on, same seed; it reports the exit status, kills,
recoveries, iterations redone (at most one per kill), per kill the seconds from the kill
to the learner going on (a learner killed inside an update: to the update's new start;
killed between updates, or a runner: the recovery's own seconds, a restart that ran
beside the sampling) split into worker start-up, state load and the rest, and the ratio
of the times to return 450 killed / clean (goal: within 10%).

    python benchmarks/chaos_training.py [--steps 40] [--every-min 120] [--every-max 240]
        [--seed 1] [--extra "--warmup-steps 50"]
    python benchmarks/chaos_training.py --model smollm2-135m-instruct --steps 15 \
        --extra "--max-restarts 5"       # the README's GRPO command, about 20 minutes a run
    python benchmarks/chaos_training.py --policy-ranks 2 --victim policy-rank --rank 1 \
        --max-kills 3 --steps 200 --every-min 40 --every-max 60 \
        --extra "--warmup-steps 60 --eval-every 50 --eval-size 50"
    python benchmarks/chaos_training.py --algo ppo [--every-min 4] [--every-max 8]
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
from collections.abc import Callable
from pathlib import Path

import psutil
from _common import run_with_killer, titled_descendants

ROLES = {"Host_DTensorPolicyWorker": "policy", "Host_HFGenerationWorker": "generation"}
PPO_ROLES = {"Host_PPOLearnerWorker": "learner", "Host_EnvRunner": "env_runner"}
PPO_COMMAND = ["train", "ppo", "--env", "CartPole-v1", "--env-runners", "2",
               "--stop-return", "450"]  # fmt: skip


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


def _sigkill(pid: int) -> bool:
    """SIGKILL ``pid``; False when it had already ended by itself."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _kill_in_turn(driver: psutil.Process, started: Callable[[], bool],
                  roles: dict[str, str], every: tuple[float, float], seed: int,
                  max_kills: int | None, stop: threading.Event,
                  kills: list[tuple[float, str, int]], t0: float,
                  wall: list[tuple[float, str]]) -> None:  # fmt: skip
    """SIGKILL a random started worker of each role in turn (``roles``: process title ->
    its label), whatever it is doing, every ``every`` seconds (uniform) once
    ``started()``; at most ``max_kills`` kills. Each kill goes into ``kills`` (seconds
    since ``t0``, label, pid) and ``wall`` (wall time, label)."""
    rng = random.Random(seed)
    while not stop.is_set() and not started():
        stop.wait(0.1)
    next_at = time.perf_counter() + rng.uniform(*every)
    turn = 0
    titles = list(roles)
    while not stop.is_set() and (max_kills is None or len(kills) < max_kills):
        if time.perf_counter() >= next_at:
            title = titles[turn % len(titles)]
            procs = _role_processes(driver, title)
            if procs:
                victim = rng.choice(procs)
                if _sigkill(victim.pid):
                    wall.append((time.time(), roles[title]))
                    kills.append((time.perf_counter() - t0, roles[title], victim.pid))
                    turn += 1
                    next_at = time.perf_counter() + rng.uniform(*every)
        stop.wait(0.1)


def _rank_pid(driver: psutil.Process, rank: int, known: dict[int, int]) -> int | None:
    """The pid of policy rank ``rank`` of the run: the newest started process whose title
    named it (``known`` keeps pid -> rank from earlier looks), if it is still alive."""
    prefix = f"ray::grpo_policy_{driver.pid}:"
    for proc, title in titled_descendants(driver):
        if title.startswith(prefix):
            known[proc.pid] = int(title[len(prefix) :].split(":", 1)[0])
    started = []
    for pid, r in known.items():
        try:
            if r == rank:
                started.append((psutil.Process(pid).create_time(), pid))
        except psutil.Error:  # gone: a killed rank, or a group shut down
            continue
    return max(started)[1] if started else None


def _in_call(pid: int, method: str) -> bool:
    """Whether the worker ``pid`` is inside ``method`` (Ray titles it ``...].<method>``)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).rstrip().endswith(f".{method}")
    except psutil.Error:
        return False


def _generating(driver: psutil.Process) -> bool:
    """Whether a generation worker of the run is inside ``generate``."""
    return any(
        _in_call(proc.pid, "generate")
        for proc in _role_processes(driver, "Host_HFGenerationWorker")
    )


def _rank_killer(driver: psutil.Process, metrics: Path, args: argparse.Namespace,
                 stop: threading.Event, kills: list[tuple[float, str, int]], t0: float,
                 wall: list[tuple[float, str]]) -> None:  # fmt: skip
    """SIGKILL policy rank ``args.rank`` while it is inside ``train`` (``--victim
    policy-idle``: while a generation worker is inside ``generate``), every ``--every-min``
    to ``--every-max`` seconds from the end of the first step on; a rank not found so within
    ``--mid-step-deadline`` seconds is tried again at the next turn. At most ``--max-kills``
    kills (a run's restart budget, ``--max-restarts``, is 3 by default)."""
    idle = args.victim == "policy-idle"
    where = "idle, during generation" if idle else "in train"

    def ready(pid: int) -> bool:
        return _generating(driver) if idle else _in_call(pid, "train")

    rng = random.Random(args.seed)
    known: dict[int, int] = {}
    while not stop.is_set() and not _first_step_done(metrics):
        _rank_pid(driver, args.rank, known)  # its start-up title passes only once
        stop.wait(0.05)
    next_at = time.perf_counter() + rng.uniform(args.every_min, args.every_max)
    while not stop.is_set() and (args.max_kills is None or len(kills) < args.max_kills):
        pid = _rank_pid(driver, args.rank, known)
        if pid is None or time.perf_counter() < next_at:
            stop.wait(0.05)
            continue
        deadline = time.perf_counter() + args.mid_step_deadline
        while not stop.is_set() and time.perf_counter() < deadline and not ready(pid):
            time.sleep(0.001)  # polling a title, not waiting for an effect
        if ready(pid) and _sigkill(pid):
            wall.append((time.time(), "policy"))
            kills.append((time.perf_counter() - t0, f"policy rank {args.rank} {where}", pid))
        next_at = time.perf_counter() + rng.uniform(args.every_min, args.every_max)


def per_kill(kills_wall: list[float], recoveries: list[dict]) -> list[dict]:
    """Each policy kill with the recovery that followed it: seconds from the kill to the
    recovery row (the step goes on from there), split into worker start-up, state load,
    refit and the rest; and from the kill to the death being seen (``seen_s``) and to the
    relaunched group being ready (``relaunched_s``), and how long the policy call that
    took it waited (``wait_s``)."""
    out = []
    for at, rec in zip(kills_wall, recoveries, strict=False):
        total = rec["wall_time"] - at
        start, load = rec["start_seconds"], rec.get("load_seconds", 0.0)
        seen = total - rec["seconds"]
        relaunched = seen + rec.get("noticed_seconds", 0.0) + rec["shutdown_seconds"] + start + load
        out.append({
            "step": rec["step"], "repeated": rec["repeated"], "kill_to_resume_s": total,
            "startup_s": start, "load_s": load, "refit_s": rec["refit_seconds"],
            "rest_s": total - start - load - rec["refit_seconds"], "seen_s": seen,
            "relaunched_s": relaunched, "wait_s": rec.get("wait_seconds", 0.0),
        })  # fmt: skip
    return out


def recovery_rows(rows: list[dict]) -> list[dict]:
    """The ``recovery/*`` rows of a run's metrics, keys without the prefix, with their
    ``wall_time``."""
    return [
        {"wall_time": r["wall_time"],
         **{k.removeprefix("recovery/"): v for k, v in r.items() if k.startswith("recovery/")}}
        for r in rows
        if "recovery/seconds" in r
    ]  # fmt: skip


def run_once(chaos: bool, args: argparse.Namespace) -> dict:
    runs_dir = tempfile.mkdtemp(prefix="phalanx_chaos_grpo_")
    name = f"chaos{int(chaos)}_{args.seed}_{os.getpid()}"
    argv = [sys.executable, "-m", "phalanx.cli", "train", "grpo", "--model", args.model,
            "--steps", str(args.steps), "--seed", str(args.seed), "--name", name,
            "--runs-dir", runs_dir, "--no-progress", *shlex.split(args.extra)]  # fmt: skip
    if args.policy_ranks is not None:
        argv += ["--num-policy-workers", str(args.policy_ranks)]
    run_dir = Path(runs_dir) / name
    t0 = time.perf_counter()
    kills: list[tuple[float, str, int]] = []
    kills_wall: list[tuple[float, str]] = []
    killer = None
    if chaos and args.victim in ("policy-rank", "policy-idle"):

        def killer(driver: psutil.Process, stop: threading.Event) -> None:
            _rank_killer(driver, run_dir / "metrics.jsonl", args, stop, kills, t0, kills_wall)

    elif chaos:

        def killer(driver: psutil.Process, stop: threading.Event) -> None:
            _kill_in_turn(
                driver, lambda: _first_step_done(run_dir / "metrics.jsonl"), ROLES,
                (args.every_min, args.every_max), args.seed, args.max_kills, stop, kills, t0,
                kills_wall,
            )  # fmt: skip

    returncode, out, err = run_with_killer(argv, args.timeout, killer)
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r["eval/accuracy"] for r in steps if "eval/accuracy" in r]
    every_recovery = recovery_rows(rows)
    recoveries = [r for r in every_recovery if r["group"] == "policy"]
    step_ids = [r["step"] for r in steps]
    return {
        "chaos": chaos,
        "rc": returncode,
        "wall_s": time.perf_counter() - t0,
        "kills": kills,
        "recoveries": recoveries,
        "per_kill": per_kill([at for at, g in kills_wall if g == "policy"], recoveries),
        "steps_in_order": step_ids == list(range(1, len(step_ids) + 1)),
        "generation_restarts": max((r.get("generation_restarts", 0) for r in steps), default=0),
        "generation_recoveries": [r for r in every_recovery if r["group"] == "generation"],
        "steps": len(steps),
        "median_step_s": statistics.median(r["time/step"] for r in steps) if steps else None,
        "final_accuracy": evals[-1] if evals else None,
        "stderr_tail": "" if returncode == 0 else err[-2000:],
        "stdout_tail": out[-500:],
    }


# ---------------------------------------------------------------------------- PPO
def _first_iteration_done(metrics: Path) -> bool:
    try:
        return any('"return_mean"' in line for line in metrics.read_text().splitlines())
    except OSError:
        return False


def per_kill_ppo(kills_wall: list[tuple[float, str]], recoveries: list[dict]) -> list[dict]:
    """Each kill with the recovery of its group that followed it: seconds from the kill
    to the learner going on, split into worker start-up, state load and the rest. A
    learner killed inside an update: to the update's new start (``resumed_at``); killed
    between updates, or an env runner: the restart's own seconds (from the death being
    seen to the worker being back), which ran beside the sampling."""
    out = []
    for group in ("learner", "env_runner"):
        kills = [at for at, g in kills_wall if g == group]
        recs = [r for r in recoveries if r["group"] == group]
        for at, rec in zip(kills, recs, strict=False):
            redone = rec.get("repeated") == "update"
            total = rec["resumed_at"] - at if redone else rec["seconds"]
            load = rec.get("load_seconds", 0.0)
            out.append({
                "group": group, "iteration": rec.get("iteration"), "redone": redone,
                "kill_to_resume_s": total, "startup_s": rec["start_seconds"], "load_s": load,
                "rest_s": total - rec["start_seconds"] - load,
            })  # fmt: skip
    return out


def _summary(stdout: str) -> dict:
    """The run's summary: the JSON object ``phalanx train ppo`` prints (empty if none)."""
    try:
        return json.loads(stdout[stdout.index("{\n") : stdout.index("\n}") + 2])
    except ValueError:
        return {}


def run_once_ppo(chaos: bool, args: argparse.Namespace) -> dict:
    from phalanx.algorithms.ppo_config import PPOConfig

    runs_dir = tempfile.mkdtemp(prefix="phalanx_chaos_ppo_")
    name = f"chaos{int(chaos)}_{args.seed}_{os.getpid()}"
    argv = [sys.executable, "-m", "phalanx.cli", *PPO_COMMAND, "--seed", str(args.seed),
            "--name", name, "--runs-dir", runs_dir, "--no-progress",
            *shlex.split(args.extra)]  # fmt: skip
    if PPOConfig.num_learners != 1 and "--num-learners" not in args.extra:
        argv += ["--num-learners", "1"]
    run_dir = Path(runs_dir) / name
    t0 = time.perf_counter()
    kills: list[tuple[float, str, int]] = []
    kills_wall: list[tuple[float, str]] = []
    killer = None
    if chaos:

        def killer(driver: psutil.Process, stop: threading.Event) -> None:
            _kill_in_turn(
                driver, lambda: _first_iteration_done(run_dir / "metrics.jsonl"), PPO_ROLES,
                (args.every_min, args.every_max), args.seed, args.max_kills, stop, kills, t0,
                kills_wall,
            )  # fmt: skip

    returncode, out, err = run_with_killer(argv, args.timeout, killer)
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    iterations = [r["iteration"] for r in rows if "return_mean" in r]
    recoveries = recovery_rows(rows)
    summary = _summary(out)
    return {
        "chaos": chaos,
        "rc": returncode,
        "wall_s": time.perf_counter() - t0,
        "kills": kills,
        "recoveries": recoveries,
        "per_kill": per_kill_ppo(kills_wall, recoveries),
        "iterations": len(iterations),
        "iterations_in_order": iterations == list(range(1, len(iterations) + 1)),
        "redone": sum(1 for r in recoveries if r.get("repeated") == "update"),
        "time_to_450_s": summary.get("time_to_stop_return_s"),
        "stderr_tail": "" if returncode == 0 else err[-2000:],
    }


def report_ppo(results: list[dict]) -> None:
    for r in results:
        label = "killed" if r["chaos"] else "clean "
        t450 = r["time_to_450_s"]
        print(f"{label} rc {r['rc']}  iterations {r['iterations']}  wall {r['wall_s']:.1f} s  "
              f"time to 450 {'-' if t450 is None else f'{t450:.1f} s'}")  # fmt: skip
        for at, role, pid in r["kills"]:
            print(f"  kill at {at:.1f} s: {role} pid {pid}")
        for rec in r["recoveries"]:
            print(f"  recovery at iteration {rec.get('iteration')} ({rec['reason']}; redone: "
                  f"{rec.get('repeated', 'nothing')}): {rec['seconds']:.2f} s, its new process "
                  f"{rec['start_seconds']:.2f} s, state load {rec.get('load_seconds', 0.0):.3f} s")  # fmt: skip
        for k in r["per_kill"]:
            redone = "update redone" if k["redone"] else "nothing redone"
            print(f"  {k['group']} kill -> going on ({redone}): "
                  f"{k['kill_to_resume_s']:.2f} s = worker start-up "
                  f"{k['startup_s']:.2f} + state load {k['load_s']:.3f} + rest {k['rest_s']:.2f}")  # fmt: skip
        if r["chaos"]:
            print(f"  kills {len(r['kills'])}, recoveries {len(r['recoveries'])}, iterations "
                  f"redone {r['redone']}; iteration rows 1..N once each: "
                  f"{r['iterations_in_order']}")  # fmt: skip
        if r["rc"] != 0:
            print(f"  stderr: {r['stderr_tail']}")
    clean, killed = results
    if killed["rc"] == 0 and clean["time_to_450_s"] and killed["time_to_450_s"]:
        ratio = killed["time_to_450_s"] / clean["time_to_450_s"]
        print(f"RATIO time to 450 killed / clean: {ratio:.3f} (goal within 10%); job restarts: "
              f"0; every kill recovered: {len(killed['recoveries']) >= len(killed['kills'])}")  # fmt: skip
    else:
        print(f"no ratio: killed rc {killed['rc']}, times {clean['time_to_450_s']} / "
              f"{killed['time_to_450_s']}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=("grpo", "ppo"), default="grpo",
                   help="grpo: the tiny GRPO command; ppo: the README's PPO command")  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default="tiny",
                   help="the model of phalanx train grpo (the README's: smollm2-135m-instruct)")  # fmt: skip
    p.add_argument("--every-min", type=float, default=None,
                   help="seconds between kills, least (default: GRPO 120, PPO 4)")  # fmt: skip
    p.add_argument("--every-max", type=float, default=None,
                   help="seconds between kills, most (default: GRPO 240, PPO 8)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--extra", default="", help="more flags for phalanx train grpo|ppo")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--policy-ranks", type=int, default=None,
                   help="policy ranks (FSDP); default: the command's (tiny: 2)")  # fmt: skip
    p.add_argument("--victim", choices=("any", "policy-rank", "policy-idle"), default="any",
                   help="any: a policy rank or a generation worker in turn, whatever it does; "
                   "policy-rank: policy rank --rank, inside train; policy-idle: policy rank "
                   "--rank while a generation worker is inside generate")  # fmt: skip
    p.add_argument("--rank", type=int, default=1, help="the policy rank --victim policy-rank kills")
    p.add_argument("--max-kills", type=int, default=None,
                   help="kills at most (default: no bound)")  # fmt: skip
    p.add_argument("--mid-step-deadline", type=float, default=30.0,
                   help="seconds to wait for the rank to be inside train before trying later")  # fmt: skip
    args = p.parse_args()
    ppo = args.algo == "ppo"
    if args.every_min is None:
        args.every_min = 4.0 if ppo else 120.0
    if args.every_max is None:
        args.every_max = max(8.0 if ppo else 240.0, args.every_min)
    if not 0 < args.every_min <= args.every_max:
        p.error(f"--every-min {args.every_min} must be > 0 and <= --every-max {args.every_max}")
    if args.policy_ranks is not None and args.policy_ranks < 1:
        p.error(f"--policy-ranks must be >= 1, got {args.policy_ranks}")
    if args.rank < 0 or (args.policy_ranks is not None and args.rank >= args.policy_ranks):
        p.error(f"--rank {args.rank} is not a rank of a {args.policy_ranks}-rank policy")
    if args.max_kills is not None and args.max_kills < 1:
        p.error(f"--max-kills must be >= 1, got {args.max_kills}")
    if args.mid_step_deadline <= 0:
        p.error(f"--mid-step-deadline must be > 0, got {args.mid_step_deadline}")
    if ppo:
        report_ppo([run_once_ppo(False, args), run_once_ppo(True, args)])
        return
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
                  f"{rec['seconds']:.1f} s = shutdown {rec['shutdown_seconds']:.1f} + start "
                  f"{rec['start_seconds']:.1f} + load {rec.get('load_seconds', 0.0):.2f} + "
                  f"refit {rec['refit_seconds']:.2f}")  # fmt: skip
        for k in r["per_kill"]:
            print(f"  kill -> death seen {k['seen_s']:.2f} s -> relaunched group ready "
                  f"{k['relaunched_s']:.1f} s; the policy call of step {k['step']} waited "
                  f"{k['wait_s']:.1f} s for it, then refit {k['refit_s']:.2f} s")  # fmt: skip
            if k["repeated"] == "none":
                continue
            print(f"  kill -> step {k['step']} going on ({k['repeated']} redone): "
                  f"{k['kill_to_resume_s']:.1f} s = worker start-up {k['startup_s']:.1f} + "
                  f"state load {k['load_s']:.2f} + refit {k['refit_s']:.2f} + "
                  f"rest {k['rest_s']:.1f}")  # fmt: skip
        for rec in r["generation_recoveries"]:
            print(f"  generation worker restarted at step {rec['step']} ({rec['reason']}): "
                  f"{rec['seconds']:.1f} s, its new process {rec['start_seconds']:.1f} s")  # fmt: skip
        if r["chaos"]:
            redone = sum(1 for rec in r["recoveries"] if rec["repeated"] != "none")
            print(f"  generation restarts {r['generation_restarts']}; policy recoveries "
                  f"{len(r['recoveries'])} (a step part redone in {redone}) for "
                  f"{len(r['kills'])} kill(s); step rows 1..N "
                  f"once each: {r['steps_in_order']}")  # fmt: skip
        if r["rc"] != 0:
            print(f"  stderr: {r['stderr_tail']}")
    clean, killed = results
    if killed["rc"] != 0 or killed["steps"] != clean["steps"]:
        print(f"the killed run did not finish (rc {killed['rc']}, {killed['steps']} of "
              f"{clean['steps']} steps): no accuracy ratio")  # fmt: skip
    elif clean["final_accuracy"] and killed["final_accuracy"] is not None:
        ratio = killed["final_accuracy"] / clean["final_accuracy"]
        print(f"RATIO final held-out accuracy killed / clean: {ratio:.3f} (goal within 10%); "
              f"job restarts: 0; every kill recovered: {killed['rc'] == 0}")  # fmt: skip


if __name__ == "__main__":
    main()
