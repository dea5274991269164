"""Chaos: PPO on CartPole-v1 with 2 env runners while runners fail, against a clean run.

Three runs of ``phalanx train ppo --env CartPole-v1 --env-runners 2 --stop-return 450``
(through its Python entry, ``phalanx.algorithms.ppo.train``), same seed, same script:

1. clean: nothing fails (the baseline);
2. kill: a thread SIGKILLs one remote runner's process every 3 s (the runners in turn);
3. raise: every env raises ``ValueError`` on every 2,000th of its own steps (counted
   per env instance; a runner's sub-envs step together, so the runner fails once every
   2,000 vector steps, then again 2,000 steps after each restart). (Counting the steps
   of a whole runner process instead would cut every episode below 250 steps with 8
   sub-envs, and 450 could never be reached.)

Each run must reach the stop return; the script prints wall time, timesteps, the
restarts the EnvRunnerGroup counted (RLlib's count: runners brought back into service)
and the slowdown against the clean run. ``--mode sample`` instead times a fixed number of
sample rounds (no learning) under the same faults.

    python benchmarks/chaos_env_runners.py [--mode ppo|sample] [--target 450] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import gymnasium as gym

HERE = os.path.dirname(os.path.abspath(__file__))
# The runners import this module to build the raising env ("chaos_env_runners:...").
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)

RAISE_EVERY = 2000
RAISING_ENV = "chaos_env_runners:RaisingCartPole-v1"


class RaisingCartPole(gym.Wrapper):
    """CartPole that raises on every ``RAISE_EVERY``-th of its own steps."""

    def __init__(self, **kwargs: Any):
        super().__init__(gym.make("CartPole-v1", **kwargs))
        self.steps = 0

    def step(self, action: Any):
        self.steps += 1
        if self.steps % RAISE_EVERY == 0:
            raise ValueError(f"chaos: env step {self.steps} in pid {os.getpid()}")
        return self.env.step(action)


# "module:Env" makes the runners import this module; the driver's id check (gym.spec)
# looks the full id up, so it is registered under both names.
for _env_id in ("RaisingCartPole-v1", RAISING_ENV):
    if _env_id not in gym.registry:
        gym.register(_env_id, entry_point=RaisingCartPole, max_episode_steps=500)


class Killer:
    """Kills one runner process every ``period_s`` (runners in turn) from a thread.

    The training loop refreshes the pids after each iteration (``on_iteration``), so a
    restarted runner's new process is the next one killed.
    """

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.pids: dict[int, int] = {}
        self.kills = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def update(self, runners: Any) -> None:
        pids = runners.foreach_env_runner(
            lambda w: (w.worker_index, os.getpid()), local_env_runner=False
        )
        with self._lock:
            self.pids.update({wid: pid for wid, pid in pids if wid > 0 and pid != os.getpid()})

    def _run(self) -> None:
        turn = 0
        while not self._stop.wait(self.period_s):
            with self._lock:
                ids = sorted(self.pids)
                if not ids:
                    continue
                wid = ids[turn % len(ids)]
                pid = self.pids.pop(wid)
            turn += 1
            try:
                os.kill(pid, signal.SIGKILL)
                self.kills += 1
            except ProcessLookupError:
                pass

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def run_ppo(kind: str, target: float, seed: int, cluster: Any) -> dict[str, Any]:
    from phalanx.algorithms.ppo import PPOConfig, train

    # CartPole-v1's tuned values are the defaults, so the raising env gets the same ones.
    cfg = PPOConfig.for_env(
        RAISING_ENV if kind == "raise" else "CartPole-v1",
        num_env_runners=2,
        stop_return=target,
        max_timesteps=400_000,
        seed=seed,
        name=f"chaos_{kind}",
        runs_dir=tempfile.mkdtemp(prefix="phalanx_chaos_"),
    )
    killer = Killer(3.0) if kind == "kill" else None
    t0 = time.perf_counter()
    if killer is None:
        out = train(cfg, cluster=cluster, progress=False)
    else:
        with killer:
            out = train(
                cfg,
                cluster=cluster,
                progress=False,
                on_iteration=lambda metrics, runners: killer.update(runners),
            )
    out["wall_s"] = time.perf_counter() - t0
    out["kills"] = killer.kills if killer else 0
    return out


def run_sample(kind: str, rounds: int, cluster: Any) -> dict[str, Any]:
    from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig

    g = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(
            env=RAISING_ENV if kind == "raise" else "CartPole-v1",
            num_envs_per_env_runner=8,
            rollout_fragment_length=32,
        ),
        num_env_runners=2,
        local_env_runner=False,
        cluster=cluster,
        name=f"chaos_sample_{kind}",
    )
    killer = Killer(3.0) if kind == "kill" else None
    steps = 0
    t0 = time.perf_counter()
    try:
        if killer is not None:
            killer.update(g)
            killer.__enter__()
        for _ in range(rounds):
            batches = g.sample()
            steps += sum(b["timesteps"] for b in batches)
            if killer is not None:
                killer.update(g)
    finally:
        if killer is not None:
            killer.__exit__()
        wall = time.perf_counter() - t0
        restarts = g.num_remote_env_runner_restarts()
        g.stop()
    return {
        "wall_s": wall,
        "timesteps": steps,
        "restarts": restarts,
        "kills": killer.kills if killer else 0,
        "reached_stop_return": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("ppo", "sample"), default="ppo")
    ap.add_argument("--target", type=float, default=450.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=300, help="sample rounds (--mode sample)")
    ap.add_argument("--runs", default="clean,kill,raise")
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    import phalanx as px

    cluster = px.Cluster(num_cpus=4)
    results: dict[str, dict[str, Any]] = {}
    for kind in args.runs.split(","):
        if args.mode == "ppo":
            out = run_ppo(kind, args.target, args.seed, cluster)
        else:
            out = run_sample(kind, args.rounds, cluster)
        results[kind] = out
        print(
            f"{kind:>5}: wall {out['wall_s']:.1f} s, {out['timesteps']} timesteps, "
            f"{out['timesteps'] / out['wall_s']:.0f} steps/s, restarts {out['restarts']}, "
            f"kills {out['kills']}, reached target: {out['reached_stop_return']}",
            flush=True,
        )
    base = results.get("clean")
    for kind, out in results.items():
        if base is None or kind == "clean":
            continue
        print(
            f"{kind} vs clean: wall ratio {out['wall_s'] / base['wall_s']:.2f}x, "
            f"throughput ratio {(out['timesteps'] / out['wall_s']) / (base['timesteps'] / base['wall_s']):.2f}x"
        )


if __name__ == "__main__":
    main()
