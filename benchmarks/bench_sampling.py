"""Sampling throughput: EnvRunnerGroup vs one-process vector envs, same task and env count.

In one run, on ``--env`` (default HalfCheetah-v5, ``pip install "gymnasium[mujoco]"``)
with ``--envs`` environments in all, each stepped with the default policy's forward
(``ActorCritic.act_numpy``, 64x64 tanh, as the runners run it):

(a) one process stepping a ``gymnasium.vector.SyncVectorEnv`` (the limit of one core);
(a') the same with each sub-env's step infos dropped, as the runners drop them
     (``NoStepInfo``);
(a'') one process stepping what a runner steps: (a') in phalanx's ``SameStepVectorEnv``
     (the library's step without its per-space machinery). (a') and (a'') show how much
     of (d)'s lead over (a) is the runners' leaner step, not parallelism;
(b) one process stepping a ``gymnasium.vector.AsyncVectorEnv`` (one env process each);
(c) ``envpool`` where it is installed and has the task (its own C++ thread pool);
(d) ``EnvRunnerGroup`` with 1 runner x N envs and with 2 runners x N/2 envs;
(e) two bare processes (``multiprocessing``, no Ray), each stepping (a'') with N/2 envs:
    what this machine's two cores give two samplers with no runtime at all, the ceiling
    for (d) with 2 runners.

Every path is built once, then measured in ``--rounds`` interleaved rounds (the machine's
speed drifts within seconds). Prints the median env steps/s of each and the median of the
per-round ratios of (d) to the best single-process figure (goal: 2 runners
>= 1.6x SyncVectorEnv on 2 cores, >= 0.9x AsyncVectorEnv).

    python benchmarks/bench_sampling.py [--env HalfCheetah-v5] [--envs 8] [--steps 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch

from phalanx.envs.env_runner import NoStepInfo
from phalanx.envs.policy import ActorCritic, act_on_numpy
from phalanx.envs.vector_env import SameStepVectorEnv


def policy_for(env_id: str, seed: int = 0) -> ActorCritic:
    """The default policy network for ``env_id`` (what the runners build)."""
    env = gym.make(env_id, disable_env_checker=True)
    torch.manual_seed(seed)
    policy = ActorCritic(env.observation_space, env.action_space)
    env.close()
    return policy


def _stepper(env: gym.vector.VectorEnv, policy: ActorCritic, low, high) -> Callable[[], None]:
    obs, _ = env.reset(seed=0)
    state = {"obs": obs}
    rng = np.random.default_rng(0)

    def step() -> None:
        # The forward the runners run (act_on_numpy), so (a) and (d) differ
        # only in where the envs are stepped.
        a = act_on_numpy(policy, np.asarray(state["obs"], np.float32), True, rng)[0]
        state["obs"] = env.step(np.clip(a, low, high) if low is not None else a)[0]

    return step


class SingleProcess:
    """One process stepping ``num_envs`` envs with the policy: ``kind`` is ``sync``,
    ``sync-noinfo``, ``lean``, ``async`` or ``envpool``. Built once; :meth:`measure` times ``steps``
    vector steps."""

    def __init__(self, kind: str, env_id: str, num_envs: int):
        self.num_envs = num_envs
        policy = policy_for(env_id)
        if kind == "envpool":
            import envpool

            self.env = envpool.make_gymnasium(env_id, num_envs=num_envs, seed=0)
        else:
            wrap = NoStepInfo if kind in ("sync-noinfo", "lean") else (lambda e: e)
            fns = [lambda: wrap(gym.make(env_id, disable_env_checker=True))] * num_envs
            if kind == "lean":
                self.env = SameStepVectorEnv(fns)
            else:
                cls = gym.vector.AsyncVectorEnv if kind == "async" else gym.vector.SyncVectorEnv
                self.env = cls(fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        env = self.env
        space = getattr(env, "single_action_space", env.action_space)
        box = isinstance(space, gym.spaces.Box)
        self._step = _stepper(env, policy, space.low if box else None, space.high if box else None)
        self.measure(8)  # warm-up

    def measure(self, steps: int) -> tuple[int, float]:
        """(env steps taken, seconds) of ``steps`` vector steps."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(steps):
                self._step()
            return steps * self.num_envs, time.perf_counter() - t0

    def close(self) -> None:
        self.env.close()


def single_process(kind: str, env_id: str, num_envs: int, steps: int) -> tuple[int, float]:
    """``steps`` vector steps of ``num_envs`` envs with the policy in this process:
    (env steps taken, seconds). ``kind``: ``sync``, ``async`` or ``envpool``."""
    sp = SingleProcess(kind, env_id, num_envs)
    try:
        return sp.measure(steps)
    finally:
        sp.close()


def _bare_sampler(conn, env_id: str, num_envs: int) -> None:
    """(e)'s child: builds (a'') once, then measures ``steps`` on each request."""
    torch.set_num_threads(1)
    sp = SingleProcess("lean", env_id, num_envs)
    conn.send("ready")
    while (steps := conn.recv()) is not None:
        conn.send(sp.measure(steps))
    sp.close()


class BareProcesses:
    """(e): ``num_procs`` processes sharing ``num_envs`` envs, started together on each
    :meth:`measure`; the rate is their steps over the slower one's time."""

    def __init__(self, env_id: str, num_procs: int, num_envs: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(num_procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_bare_sampler, args=(child, env_id, num_envs // num_procs))
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(120):
                raise TimeoutError("a bare sampler process did not start within 120 s")
            conn.recv()

    def measure(self, steps: int) -> tuple[int, float]:
        for conn in self.conns:
            conn.send(steps)
        done = [conn.recv() for conn in self.conns]
        return sum(n for n, _ in done), max(secs for _, secs in done)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            conn.send(None)
            proc.join(timeout=30)


class PhalanxGroup:
    """``EnvRunnerGroup`` of ``num_runners`` runners sharing ``num_envs`` envs, built once;
    :meth:`measure` times ``sample`` calls until ``steps * num_envs`` env steps."""

    def __init__(self, env_id: str, num_runners: int, num_envs: int, cluster=None):
        from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig

        self.num_envs = num_envs
        self.per = num_envs // num_runners
        self.group = EnvRunnerGroup(
            config=EnvRunnerGroupConfig(env=env_id, num_envs_per_env_runner=self.per, seed=0),
            num_env_runners=num_runners,
            local_env_runner=False,
            cluster=cluster,
        )
        self.group.sample(num_timesteps=self.per * 8)  # warm-up

    def measure(self, steps: int) -> tuple[int, float]:
        chunk = min(steps, 256)
        taken, secs = 0, 0.0
        while taken < steps * self.num_envs:
            t0 = time.perf_counter()
            batches = self.group.sample(num_timesteps=self.per * chunk)
            secs += time.perf_counter() - t0
            taken += sum(b["timesteps"] for b in batches)
        return taken, secs

    def close(self) -> None:
        self.group.stop()


def phalanx_group(
    env_id: str, num_runners: int, num_envs: int, steps: int, cluster=None
) -> tuple[int, float]:
    """``EnvRunnerGroup.sample`` of ``num_runners`` runners sharing ``num_envs`` envs, until
    ``steps * num_envs`` env steps: (env steps taken, seconds of the sample calls)."""
    g = PhalanxGroup(env_id, num_runners, num_envs, cluster)
    try:
        return g.measure(steps)
    finally:
        g.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--envs", type=int, default=8, help="environments in all (even)")
    p.add_argument("--steps", type=int, default=256, help="vector steps of each env per round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    args = p.parse_args()
    if args.envs < 2 or args.envs % 2:
        p.error(f"--envs must be an even number >= 2, got {args.envs}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(1)
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    paths: dict[str, SingleProcess | PhalanxGroup | BareProcesses] = {}
    for kind in ("sync", "sync-noinfo", "lean", "async", "envpool"):
        try:
            paths[kind] = SingleProcess(kind, args.env, args.envs)
        except ImportError:
            print("(c) envpool: not installed (pip install envpool)")
        except Exception as e:  # noqa: BLE001 - envpool without this task: say so, go on
            if kind != "envpool":
                raise
            print(f"(c) envpool: cannot run {args.env}: {str(e).splitlines()[0]}")
    import phalanx as px
    from phalanx.resources.ray_start import start_ray

    start_ray()  # as `phalanx train ppo` starts it: workers at nice 0 (Ray's default is 15)
    cluster = px.Cluster()
    for runners in (1, 2):
        paths[f"phalanx x{runners}"] = PhalanxGroup(args.env, runners, args.envs, cluster)
    paths["bare x2"] = BareProcesses(args.env, 2, args.envs)
    # The machine's speed drifts within seconds: every round measures every path once,
    # so each ratio compares figures taken moments apart.
    rates: dict[str, list[float]] = {k: [] for k in paths}
    try:
        for r in range(args.rounds):
            for k, path in paths.items():
                n, secs = path.measure(args.steps)
                rates[k].append(n / secs)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()))
    finally:
        for path in paths.values():
            path.close()
    labels = {
        "sync": "(a) SyncVectorEnv, one process",
        "sync-noinfo": "(a') SyncVectorEnv, step infos dropped",
        "lean": "(a'') SameStepVectorEnv, step infos dropped",
        "async": "(b) AsyncVectorEnv, one process",
        "envpool": "(c) envpool, one process",
        "phalanx x1": f"(d) EnvRunnerGroup, 1 runner x {args.envs} envs",
        "phalanx x2": f"(d) EnvRunnerGroup, 2 runners x {args.envs // 2} envs",
        "bare x2": f"(e) 2 bare processes x {args.envs // 2} envs, no Ray",
    }
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{args.env}, {args.envs} envs in all, policy forward on every step, medians of "
        f"{args.rounds} rounds:"
    )
    for k, v in med.items():
        print(f"  {labels[k]:48s} {v:>10,.0f} env steps/s")
    single = [k for k in ("sync", "sync-noinfo", "lean", "async", "envpool") if k in med]
    best = max(single, key=med.get)

    def per_round(k: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[k], rates[base]))

    for k in ("phalanx x1", "phalanx x2"):
        print(
            f"RATIO {labels[k][4:]} / best single process ({best}): {per_round(k, best):.2f}x; "
            f"/ SyncVectorEnv: {per_round(k, 'sync'):.2f}x; "
            f"/ SyncVectorEnv without infos: {per_round(k, 'sync-noinfo'):.2f}x; "
            f"/ SameStepVectorEnv: {per_round(k, 'lean'):.2f}x; "
            f"/ AsyncVectorEnv: {per_round(k, 'async'):.2f}x (medians of per-round ratios)"
        )
    print(
        f"CEILING {labels['bare x2'][4:]} / SyncVectorEnv: {per_round('bare x2', 'sync'):.2f}x; "
        f"/ SyncVectorEnv without infos: {per_round('bare x2', 'sync-noinfo'):.2f}x; "
        f"/ SameStepVectorEnv: {per_round('bare x2', 'lean'):.2f}x; "
        f"2 runners / 2 bare processes: {per_round('phalanx x2', 'bare x2'):.2f}x"
    )


if __name__ == "__main__":
    main()
