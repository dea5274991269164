"""PPO with 2 env runners: wall time to the env's stop return, start-up included, vs RLlib.

Runs the README command (CartPole-v1: ``phalanx train ppo --env CartPole-v1
--stop-return 450``; another ``--env``: ``phalanx train ppo --env ENV`` with its TUNED stop
return and step budget, e.g. HalfCheetah-v5: 1500 over 10 episodes within 1M steps) once
per seed as a fresh process, and takes the time from that process's start (interpreter,
imports, Ray start, runner start-up all included) to the iteration whose recent mean
return reached the stop return.

Goals: CartPole-v1 median over 5 seeds <= 0.3x RLlib 2.60 PPO with 2 env runners;
HalfCheetah-v5 <= 0.5x.

``--vs-rllib`` measures that baseline in the same run: for each seed, right after the
phalanx run, ``benchmarks/rllib_ppo.py`` (RLlib's own tuned PPO for the env, 2 env
runners, the same stop rule: mean return of the last episodes, as many as phalanx
averages, time from its process start, the same step budget) runs in a separate
environment, because ray[rllib] pins a gymnasium that phalanx's environment does not
have. ``--setup-rllib`` creates that environment (``python -m venv
--system-site-packages`` plus ``benchmarks/requirements-rllib.txt``) at ``--rllib-venv``.
The last lines are the per-seed times, both medians and the RATIO. A run that spends its
step budget without reaching the stop return is reported with its return and wall time;
the ratio then compares the times to the budget where both spent it.

Without ``--vs-rllib`` the baseline is the same command with ``--env-runners 0``
(sampling and learning in one process, no Ray), which shows what Ray and the remote
runners cost, and (CartPole) the RLlib figure is the anchor measured earlier here.

    python benchmarks/bench_ppo.py --vs-rllib [--setup-rllib] [--seeds 1,2,3,4,5]
    python benchmarks/bench_ppo.py [--seeds 1,2,3,4,5] [--baseline-seeds 1,2,3]
    python benchmarks/bench_ppo.py --env HalfCheetah-v5 --vs-rllib --seeds 1
    python benchmarks/bench_ppo.py --env HalfCheetah-v5 --vs-rllib --rllib-settings phalanx

``--vs-learner-worker`` runs, right after each phalanx run, the same command with
``--num-learners 1`` (the learner in a restartable worker process instead of the driver)
and prints the RATIO of its median time to the local learner's.

``--rllib-settings phalanx`` gives RLlib phalanx's hyperparameters instead of its own
tuned example (``rllib_ppo.py`` says which): the same algorithm on both runtimes.

``TUNED["CartPole-v1"]`` (``phalanx/algorithms/ppo_config.py``) was chosen by env steps to a
20-episode mean of 450 over seeds 1-5, with 512-step batches: value clipping off, gamma
.98, lambda .9 and 6 epochs needed the fewest. Other epochs and minibatch sizes, learning
rates, lambda, entropy, clip, value-loss weight, width, activation, fragment length and RL
Zoo's settings needed more, and ``--async`` (sampling one weights version behind) needed
more as well, so the README command samples synchronously.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RLLIB_ANCHOR_S = {"CartPole-v1": (31.0, 47.0)}  # RLlib 2.60 PPO, 2 env runners, measured here
GOAL = {"CartPole-v1": 0.3, "HalfCheetah-v5": 0.5}  # ratio to RLlib's time
GOAL_VS_SINGLE = {"CartPole-v1": 2.0, "HalfCheetah-v5": 1.3}  # to one process
README_FLAGS = {"CartPole-v1": ["--stop-return", "450"]}  # the README command's own flags
RLLIB_DRIVER = HERE / "rllib_ppo.py"
SINGLE_PROCESS = HERE / "ppo_single_process.py"
RLLIB_REQUIREMENTS = HERE / "requirements-rllib.txt"
DEFAULT_RLLIB_VENV = os.environ.get(
    "PHALANX_RLLIB_VENV", str(Path.home() / ".cache" / "phalanx" / "venv-rllib")
)


@dataclass(frozen=True)
class Task:
    """The env and the stop rule both frameworks run under (phalanx's TUNED values)."""

    env: str
    stop_return: float
    window: int
    max_timesteps: int
    timeout_s: float  # per process: generous, RLlib's runs take minutes on 2 cores

    @classmethod
    def of(cls, env: str) -> Task:
        from phalanx.algorithms.ppo import PPOConfig

        flags = README_FLAGS.get(env, [])
        cfg = PPOConfig.for_env(env)
        stop = float(flags[1]) if flags else cfg.stop_return
        if stop is None:
            sys.exit(f"--env {env}: no stop return in TUNED; add one or use another env")
        timeout = 1500.0 if cfg.max_timesteps <= 500_000 else 3600.0
        return cls(env, stop, cfg.stop_window, cfg.max_timesteps, timeout)


def run(task: Task, seed: int, env_runners: int, extra: list[str]) -> dict:
    runs_dir = tempfile.mkdtemp(prefix="phalanx_bench_")
    argv = [sys.executable, "-m", "phalanx.cli", "train", "ppo", "--env", task.env,
            *README_FLAGS.get(task.env, []), "--env-runners", str(env_runners), "--seed",
            str(seed), "--name", "bench", "--runs-dir", runs_dir, "--no-progress", *extra]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=task.timeout_s)
    wall = time.perf_counter() - t0
    out = proc.stdout
    start, end = out.find("{\n"), out.find("\n}")
    summary = json.loads(out[start : end + 2]) if start >= 0 and end >= 0 else {}
    if not summary or not summary.get("reached_stop_return"):
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return {
        "seed": seed,
        "ok": bool(summary),  # reached the stop return or spent the step budget
        "reached": bool(summary.get("reached_stop_return")),
        "t_stop": summary.get("time_to_stop_return_s") or float("nan"),
        "wall": summary.get("process_wall_s") or wall,
        "timesteps": summary.get("timesteps"),
        "return": summary.get("return_mean_recent", float("nan")),
        "breakdown": summary.get("breakdown", {}),
    }


def rllib_python(venv: str) -> Path:
    return Path(venv) / "bin" / "python"


def setup_rllib(venv: str) -> None:
    """Create the RLlib environment from requirements-rllib.txt (reusing installed wheels)."""
    print(f"creating the RLlib environment at {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    subprocess.run([str(rllib_python(venv)), "-m", "pip", "install", "-q", "-r",
                    str(RLLIB_REQUIREMENTS)], check=True)  # fmt: skip


def last_json(label: str, argv: list[str], timeout_s: float) -> tuple[bool, dict]:
    """Run a baseline process; (exit status 0, its last JSON line). Its output is printed
    when it failed or did not reach the stop return."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    summary = json.loads(lines[-1]) if lines else {}
    if rc != 0 or not summary.get("reached", summary.get("time_to_stop_return_s")):
        print(f"{label}: exit {rc}", out[-2000:], err[-3000:], sep="\n")
    return rc == 0 and bool(summary), summary


def run_rllib(task: Task, seed: int, venv: str, settings: str = "rllib") -> dict:
    argv = [str(rllib_python(venv)), str(RLLIB_DRIVER), "--seed", str(seed), "--env", task.env,
            "--stop-return", str(task.stop_return), "--window", str(task.window),
            "--max-timesteps", str(task.max_timesteps), "--settings", settings]  # fmt: skip
    ok, summary = last_json(f"RLlib seed {seed}", argv, task.timeout_s)
    return {
        "seed": seed,
        "ok": ok,
        "reached": bool(summary.get("reached")),
        "t_stop": summary.get("t_stop") or float("nan"),
        "wall": summary.get("process_wall_s", float("nan")),
        "timesteps": summary.get("timesteps"),
        "return": summary.get("return_mean", float("nan")),
        "startup": summary.get("startup_s") or float("nan"),
    }


def run_single(task: Task, seed: int) -> dict:
    """The CleanRL-style loop (``ppo_single_process.py``): same config, no Ray, no runners."""
    argv = [sys.executable, str(SINGLE_PROCESS), "--env", task.env, "--seed", str(seed),
            "--stop-return", str(task.stop_return)]  # fmt: skip
    ok, summary = last_json(f"single process seed {seed}", argv, task.timeout_s)
    return {
        "seed": seed,
        "ok": ok,
        "reached": summary.get("time_to_stop_return_s") is not None,
        "t_stop": summary.get("time_to_stop_return_s") or float("nan"),
        "wall": summary.get("process_wall_s", float("nan")),
        "timesteps": summary.get("timesteps"),
        "return": summary.get("return_mean_recent", float("nan")),
        "parts": summary.get("breakdown", {}),
    }


def show(label: str, task: Task, r: dict) -> None:
    extra = ""
    if "breakdown" in r:
        top = sorted(r["breakdown"].items(), key=lambda kv: -kv[1])[:6]
        extra = ", ".join(f"{k} {v:.1f}" for k, v in top if v >= 0.05)
    elif "startup" in r:
        extra = f"start-up to the first iteration {r['startup']:.1f} s"
    elif "parts" in r:
        extra = ", ".join(f"{k} {v:.1f}" for k, v in r["parts"].items())
    print(
        f"{label} seed {r['seed']}: reached {task.stop_return:g} {r['reached']} at "
        f"{r['t_stop']:.1f} s after process start, {r['timesteps']} timesteps, last mean "
        f"return {r['return']:.1f}, process wall {r['wall']:.1f} s [{extra}]",
        flush=True,
    )


def median_t(rs: list[dict]) -> float:
    done = [r["t_stop"] for r in rs if r["reached"]]
    return statistics.median(done) if done else math.nan


def compare_rllib(task: Task, ours: list[dict], rllib: list[dict], ok: bool) -> None:
    """The RATIO lines: time to the stop return (or, where neither reached it, to the step
    budget), median over seeds and per back-to-back pair."""
    med, rmed = median_t(ours), median_t(rllib)
    r_failed = [r["seed"] for r in rllib if not r["reached"]]
    print(f"RLlib 2.60: every seed reached {task.stop_return:g}: {not r_failed}"
          + (f" (not: seeds {r_failed})" if r_failed else "")
          + f"; median time {rmed:.1f} s; median start-up to the first iteration "
          f"{statistics.median(r['startup'] for r in rllib):.1f} s")  # fmt: skip
    print("per seed (s):  " + ",  ".join(
        f"seed {a['seed']}: phalanx {a['t_stop']:.1f} / RLlib {b['t_stop']:.1f} (returns "
        f"{a['return']:.0f} / {b['return']:.0f})" for a, b in zip(ours, rllib)))  # fmt: skip
    goal = GOAL.get(task.env)
    if not math.isnan(med) and not math.isnan(rmed):
        ratio = med / rmed
        verdict = (
            ""
            if goal is None
            else f"goal <= {goal}x: {'met' if ratio <= goal and ok else 'missed'}; "
        )
        print(f"RATIO phalanx / RLlib 2.60 PPO, median time to mean return {task.stop_return:g} "
              f"with 2 env runners (start-up included): {med:.1f} s / {rmed:.1f} s = "
              f"{ratio:.3f}x ({verdict}load average at the end {os.getloadavg()[0]:.1f})")  # fmt: skip
    elif not math.isnan(med):
        print(f"RATIO phalanx / RLlib 2.60 PPO: RLlib reached {task.stop_return:g} in no seed "
              f"within {task.max_timesteps:,} steps; phalanx's median {med:.1f} s against RLlib's "
              f"median wall {statistics.median(r['wall'] for r in rllib):.1f} s for the budget: "
              f"< {med / statistics.median(r['wall'] for r in rllib):.3f}x")  # fmt: skip
    paired = [
        a["t_stop"] / b["t_stop"] for a, b in zip(ours, rllib) if a["reached"] and b["reached"]
    ]
    budget = [
        a["wall"] / b["wall"] for a, b in zip(ours, rllib) if not (a["reached"] or b["reached"])
    ]
    if paired:  # each seed's pair ran back to back: less exposed to load drifting
        print(f"RATIO per seed (phalanx / RLlib, back to back): "
              f"{', '.join(f'{x:.3f}' for x in paired)}; median {statistics.median(paired):.3f}x")  # fmt: skip
    if budget:
        print(f"RATIO per seed where neither reached it, wall time for {task.max_timesteps:,} "
              f"steps: {', '.join(f'{x:.3f}' for x in budget)}x")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="CartPole-v1", help="an env with a TUNED stop return")
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--baseline-seeds", default=None,
                   help="seeds of the one-process baseline ('' to skip; default 1,2,3, "
                   "none with --vs-rllib)")  # fmt: skip
    p.add_argument("--async", dest="async_sampling", action="store_true")
    p.add_argument("--vs-rllib", action="store_true",
                   help="run RLlib 2.60 PPO after each phalanx run and print the RATIO")  # fmt: skip
    p.add_argument("--vs-single-process", action="store_true",
                   help="run the CleanRL-style one-process PPO after each phalanx run")  # fmt: skip
    p.add_argument("--vs-learner-worker", action="store_true",
                   help="run the same command with --num-learners 1 after each phalanx run")  # fmt: skip
    p.add_argument("--rllib-settings", default="rllib", choices=("rllib", "phalanx"),
                   help="RLlib's tuned example, or phalanx's hyperparameters (rllib_ppo.py)")  # fmt: skip
    p.add_argument("--rllib-venv", default=DEFAULT_RLLIB_VENV,
                   help="the RLlib environment (env var PHALANX_RLLIB_VENV)")  # fmt: skip
    p.add_argument("--setup-rllib", action="store_true",
                   help="create --rllib-venv from requirements-rllib.txt first")  # fmt: skip
    args = p.parse_args()
    task = Task.of(args.env)
    extra = ["--async"] if args.async_sampling else []
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.baseline_seeds is None:
        args.baseline_seeds = "" if args.vs_rllib else "1,2,3"
    base_seeds = [int(s) for s in args.baseline_seeds.split(",") if s]
    if args.setup_rllib:
        setup_rllib(args.rllib_venv)
    if args.vs_rllib and not rllib_python(args.rllib_venv).exists():
        sys.exit(f"--vs-rllib: no RLlib environment at {args.rllib_venv}; pass --setup-rllib "
                 "to create it (or --rllib-venv / PHALANX_RLLIB_VENV to point at one)")  # fmt: skip
    ours, base, rllib, single, worker = [], [], [], [], []
    for i, seed in enumerate(seeds):  # baselines run interleaved: load drifts hit both
        ours.append(run(task, seed, 2, extra))
        show("phalanx, 2 env runners", task, ours[-1])
        if args.vs_rllib:
            rllib.append(run_rllib(task, seed, args.rllib_venv, args.rllib_settings))
            show("RLlib 2.60, 2 env runners", task, rllib[-1])
        if args.vs_single_process:
            single.append(run_single(task, seed))
            show("single process (CleanRL-style)", task, single[-1])
        if args.vs_learner_worker:
            worker.append(run(task, seed, 2, [*extra, "--num-learners", "1"]))
            show("phalanx, learner in a worker", task, worker[-1])
        if i < len(base_seeds):
            base.append(run(task, base_seeds[i], 0, extra))
            show("baseline, one process", task, base[-1])
    ok = all(r["ok"] and r["reached"] for r in ours)
    done = [r for r in ours if r["reached"]]
    failed = [r["seed"] for r in ours if not r["reached"]]
    med = median_t(ours)
    print(f"phalanx: every seed reached {task.stop_return:g}: {ok}"
          + (f" (not: seeds {failed})" if failed else "")
          + (f"; median time (start-up included): {med:.1f} s over seeds "
             f"{[r['seed'] for r in done]}" if done else ""))  # fmt: skip
    if rllib:
        compare_rllib(task, ours, rllib, ok)
    elif done and task.env in RLLIB_ANCHOR_S:
        lo, hi = RLLIB_ANCHOR_S[task.env]
        goal = GOAL[task.env]
        print(f"RATIO vs the RLlib 2.60 anchor {lo:.0f}-{hi:.0f} s (not measured in this run; "
              f"--vs-rllib measures it): {med / hi:.2f}x-{med / lo:.2f}x (goal <= {goal}x: "
              f"{'met' if med <= goal * lo else 'met against the slow end only' if med <= goal * hi else 'missed'})")  # fmt: skip
    if single and done:
        smed = median_t(single)
        goal = GOAL_VS_SINGLE.get(task.env)
        print(f"RATIO phalanx / single-process PPO (same config, no Ray), median time to "
              f"{task.stop_return:g} (start-up included): {med:.1f} s / {smed:.1f} s = "
              f"{med / smed:.2f}x (goal <= {goal}x); per seed "
              + ", ".join(f"{a['t_stop'] / b['t_stop']:.2f}" for a, b in zip(ours, single)))  # fmt: skip
    worker_done = [r for r in worker if r["reached"]]
    if worker_done and done:
        wmed = median_t(worker_done)
        print(f"RATIO learner in a worker (--num-learners 1) / in the driver, median time to "
              f"{task.stop_return:g} (start-up included): {wmed:.1f} s / {med:.1f} s = "
              f"{wmed / med:.2f}x; per seed "
              + ", ".join(f"{a['t_stop'] / b['t_stop']:.2f}" for a, b in zip(worker, ours)))  # fmt: skip
    base = [r for r in base if r["reached"]]
    if base and done:
        bmed = median_t(base)
        print(f"baseline, one process without Ray: median {bmed:.1f} s; "
              f"RATIO phalanx / one process: {med / bmed:.2f}x")  # fmt: skip
    runs = done or ours
    keys = sorted({k for r in runs for k in r["breakdown"]})
    print("median breakdown over the phalanx runs (s):")
    for k in sorted(keys, key=lambda k: -statistics.median(r["breakdown"].get(k, 0) for r in runs)):
        print(f"  {k:<32} {statistics.median(r['breakdown'].get(k, 0.0) for r in runs):6.2f}")
    sys.exit(0 if ok and all(r["ok"] for r in rllib + single + worker) else 1)


if __name__ == "__main__":
    main()
