"""Sampling throughput: an EnvRunnerGroup vs the same envs in one process.

phalanx: ``--env-runners`` remote runners x ``--envs`` CartPole-v1 envs each, every
runner stepping its vector env with the default policy (``EnvRunnerGroup.sample``).
Baseline (same run): one ``gymnasium`` ``SyncVectorEnv`` with all ``runners * envs``
envs in this process, stepped with the same policy network; and the bare vector env
with random actions (no policy) as a ceiling for env stepping alone.

    python benchmarks/bench_sampling.py [--env-runners 2] [--envs 8] [--steps 256]
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
import torch

import phalanx as px
from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig
from phalanx.envs.policy import ActorCritic


def _plain(n_envs: int, steps: int, with_policy: bool) -> float:
    env = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", disable_env_checker=True) for _ in range(n_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    policy = ActorCritic(env.single_observation_space, env.single_action_space)
    obs, _ = env.reset(seed=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(steps):
            if with_policy:
                a = policy.act(torch.from_numpy(obs.astype(np.float32)))[0].numpy()
            else:
                a = env.action_space.sample()
            obs, *_ = env.step(a)
    dt = time.perf_counter() - t0
    env.close()
    return n_envs * steps / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-runners", type=int, default=2)
    p.add_argument("--envs", type=int, default=8, help="envs per runner")
    p.add_argument("--steps", type=int, default=256, help="vector steps per sample call")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    px.Cluster()
    group = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(env="CartPole-v1", num_envs_per_env_runner=args.envs, seed=0),
        num_env_runners=args.env_runners,
        local_env_runner=False,
    )
    try:
        group.sample(num_timesteps=args.envs * 16)  # warm-up
        rates = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            batches = group.sample(num_timesteps=args.envs * args.steps)
            rates.append(sum(b["timesteps"] for b in batches) / (time.perf_counter() - t0))
        ours = float(np.median(rates))
    finally:
        group.stop()
    total = args.env_runners * args.envs
    n = args.steps * args.env_runners
    base_policy = float(np.median([_plain(total, n, True) for _ in range(3)]))
    base_bare = float(np.median([_plain(total, n, False) for _ in range(3)]))
    print(
        f"EnvRunnerGroup ({args.env_runners} runners x {args.envs} envs, policy on runners): "
        f"{ours:,.0f} env steps/s"
    )
    print(f"one-process SyncVectorEnv ({total} envs) + same policy: {base_policy:,.0f} env steps/s")
    print(f"one-process SyncVectorEnv ({total} envs), random actions: {base_bare:,.0f} env steps/s")
    print(
        f"ratio phalanx / one process with policy: {ours / base_policy:.2f}x; "
        f"vs bare env stepping: {ours / base_bare:.2f}x"
    )


if __name__ == "__main__":
    main()
