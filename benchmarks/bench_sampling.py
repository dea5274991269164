"""Sampling throughput: EnvRunnerGroup vs one-process vector envs, same task and env count.

In one run, on ``--env`` (default HalfCheetah-v5, ``pip install "gymnasium[mujoco]"``)
with ``--envs`` environments in all, each stepped with the default policy's forward
(``ActorCritic.act``, 64x64 tanh, one torch thread):

(a) one process stepping a ``gymnasium.vector.SyncVectorEnv`` (the limit of one core);
(b) one process stepping a ``gymnasium.vector.AsyncVectorEnv`` (one env process each);
(c) ``envpool`` where it is installed and has the task (its own C++ thread pool);
(d) ``EnvRunnerGroup`` with 1 runner x N envs and with 2 runners x N/2 envs.

Prints env steps/s of each and the ratio of (d) to the best single-process figure
(issue 25's goal: 2 runners >= 1.6x SyncVectorEnv on 2 cores, >= 0.9x AsyncVectorEnv).

    python benchmarks/bench_sampling.py [--env HalfCheetah-v5] [--envs 8] [--steps 256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch

from phalanx.envs.policy import ActorCritic


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

    def step() -> None:
        a = policy.act(torch.from_numpy(np.asarray(state["obs"], np.float32)))[0].numpy()
        state["obs"] = env.step(np.clip(a, low, high) if low is not None else a)[0]

    return step


def single_process(kind: str, env_id: str, num_envs: int, steps: int) -> tuple[int, float]:
    """``steps`` vector steps of ``num_envs`` envs with the policy in this process:
    (env steps taken, seconds). ``kind``: ``sync``, ``async`` or ``envpool``."""
    policy = policy_for(env_id)
    if kind == "envpool":
        import envpool

        env = envpool.make_gymnasium(env_id, num_envs=num_envs, seed=0)
    else:
        fns = [lambda: gym.make(env_id, disable_env_checker=True) for _ in range(num_envs)]
        cls = gym.vector.SyncVectorEnv if kind == "sync" else gym.vector.AsyncVectorEnv
        env = cls(fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    space = env.single_action_space if hasattr(env, "single_action_space") else env.action_space
    box = isinstance(space, gym.spaces.Box)
    step = _stepper(env, policy, space.low if box else None, space.high if box else None)
    try:
        with torch.inference_mode():
            for _ in range(8):  # warm-up
                step()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            return steps * num_envs, time.perf_counter() - t0
    finally:
        env.close()


def phalanx_group(
    env_id: str, num_runners: int, num_envs: int, steps: int, cluster=None
) -> tuple[int, float]:
    """``EnvRunnerGroup.sample`` of ``num_runners`` runners sharing ``num_envs`` envs, until
    ``steps * num_envs`` env steps: (env steps taken, seconds of the sample calls)."""
    from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig

    per = num_envs // num_runners
    group = EnvRunnerGroup(
        config=EnvRunnerGroupConfig(env=env_id, num_envs_per_env_runner=per, seed=0),
        num_env_runners=num_runners,
        local_env_runner=False,
        cluster=cluster,
    )
    try:
        group.sample(num_timesteps=per * 8)  # warm-up
        chunk = min(steps, 256)
        taken, secs = 0, 0.0
        while taken < steps * num_envs:
            t0 = time.perf_counter()
            batches = group.sample(num_timesteps=per * chunk)
            secs += time.perf_counter() - t0
            taken += sum(b["timesteps"] for b in batches)
        return taken, secs
    finally:
        group.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--envs", type=int, default=8, help="environments in all (even)")
    p.add_argument("--steps", type=int, default=256, help="vector steps of each env")
    args = p.parse_args()
    if args.envs < 2 or args.envs % 2:
        p.error(f"--envs must be an even number >= 2, got {args.envs}")
    torch.set_num_threads(1)
    rates: dict[str, float] = {}
    for kind in ("sync", "async", "envpool"):
        try:
            n, s = single_process(kind, args.env, args.envs, args.steps)
        except ImportError:
            print("(c) envpool: not installed (pip install envpool)")
            continue
        except Exception as e:  # noqa: BLE001 - envpool without this task: say so, go on
            if kind != "envpool":
                raise
            print(f"(c) envpool: cannot run {args.env}: {str(e).splitlines()[0]}")
            continue
        rates[kind] = n / s
    import phalanx as px

    cluster = px.Cluster()
    for runners in (1, 2):
        n, s = phalanx_group(args.env, runners, args.envs, args.steps, cluster)
        rates[f"phalanx x{runners}"] = n / s
    labels = {
        "sync": "(a) SyncVectorEnv, one process",
        "async": "(b) AsyncVectorEnv, one process",
        "envpool": "(c) envpool, one process",
        "phalanx x1": f"(d) EnvRunnerGroup, 1 runner x {args.envs} envs",
        "phalanx x2": f"(d) EnvRunnerGroup, 2 runners x {args.envs // 2} envs",
    }
    print(f"{args.env}, {args.envs} envs in all, policy forward on every step:")
    for k, v in rates.items():
        print(f"  {labels[k]:48s} {v:>10,.0f} env steps/s")
    single = {k: rates[k] for k in ("sync", "async", "envpool") if k in rates}
    best = max(single, key=single.get)
    for k in ("phalanx x1", "phalanx x2"):
        print(
            f"ratio {labels[k][4:]} / best single process ({best}): "
            f"{rates[k] / single[best]:.2f}x; / SyncVectorEnv: {rates[k] / rates['sync']:.2f}x; "
            f"/ AsyncVectorEnv: {rates[k] / rates['async']:.2f}x"
        )


if __name__ == "__main__":
    main()
