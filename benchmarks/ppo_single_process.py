"""Single-process PPO (CleanRL style: no Ray, no runners): the overhead baseline.

The same hyperparameters (``PPOConfig.for_env``: TUNED plus overrides), network
(``ActorCritic``), advantage and update code (``phalanx.algorithms.ppo.gae``/
``ppo_update``), observation normaliser and seeds as ``phalanx train ppo``; the envs are one
vector env of ``max(num_env_runners, 1) * num_envs_per_env_runner`` envs stepped in this
process, ``rollout_fragment_length`` steps per update, so a batch has the same size and
layout as phalanx's. It is the vector env a runner steps (``SameStepVectorEnv``, sub-envs
without step infos) and the runners' forward, so the ratio compares runtimes only. Prints
the time from process start to ``stop_return`` (start-up included: interpreter, imports,
env construction) and its wall-time breakdown, and a JSON summary as its last line.
``bench_ppo.py --vs-single-process`` runs it per seed beside ``phalanx train ppo`` and
prints the ratio (goals: <= 1.3x on the continuous task, <= 2x on CartPole).

    python benchmarks/ppo_single_process.py --env HalfCheetah-v5 --seed 1 [--stop-return R]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from phalanx.algorithms.ppo import PPOConfig, build_policy, flatten_batches, ppo_update
from phalanx.envs.env_runner import NoStepInfo
from phalanx.envs.normalize import RunningMeanStd
from phalanx.envs.policy import act_on_numpy
from phalanx.envs.vector_env import SameStepVectorEnv
from phalanx.observe.breakdown import process_age_s


def rollout(
    env, policy, obs, norm, cfg: PPOConfig, ep: dict[str, Any], rng: np.random.Generator
) -> tuple[dict, Any]:
    """``rollout_fragment_length`` steps of every env: a batch as an env runner returns it."""
    T, N = cfg.rollout_fragment_length, env.num_envs
    space = env.single_action_space
    box = isinstance(space, gym.spaces.Box)
    keys = ("obs", "actions", "logp", "rewards", "terminateds", "truncateds", "values")
    buf: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    final = np.zeros((T, N), np.float32)
    returns: list[float] = []
    for t in range(T):
        nobs = _normalize(norm, obs, update=True)
        a, logp, v = act_on_numpy(policy, nobs, True, rng)  # the runners' forward
        act = np.minimum(np.maximum(a, space.low), space.high) if box else a  # the runners' clip
        obs, r, term, trunc, info = env.step(act)
        for k, x in zip(keys, (nobs, a, logp, r, term, trunc, v)):
            buf[k].append(x)
        ep["ret"] += r
        for i in np.flatnonzero(term | trunc):
            returns.append(float(ep["ret"][i]))
            ep["ret"][i] = 0.0
        cut = np.flatnonzero(trunc & ~term)
        if len(cut):  # bootstrap truncated episodes from V(final obs), as the runners do
            fin = _normalize(norm, np.stack([info["final_obs"][i] for i in cut]), update=False)
            final[t, cut] = policy.value(torch.from_numpy(fin)).numpy()
    batch = {k: np.stack(v).astype(np.float32 if k not in ("terminateds", "truncateds") else bool)
             for k, v in buf.items()}  # fmt: skip
    if not box:
        batch["actions"] = batch["actions"].astype(np.int64)
    batch["final_values"] = final
    batch["last_values"] = policy.value(torch.from_numpy(_normalize(norm, obs, False))).numpy()
    batch["episode_returns"] = np.asarray(returns)
    return batch, obs


def _normalize(norm: RunningMeanStd | None, obs: np.ndarray, update: bool) -> np.ndarray:
    if norm is None:
        return np.array(obs, np.float32)  # a copy: the vector env reuses its buffer
    if update:
        norm.update(obs)
    return norm.normalize(obs)


def train(cfg: PPOConfig, noise_seed: int | None = None) -> dict[str, Any]:
    """PPO in this process until ``stop_return`` or ``max_timesteps``; a summary dict.
    ``noise_seed`` seeds the exploration noise (default ``cfg.seed``; env runner ``i``
    uses ``cfg.seed + i``, which is how a test replays a one-runner phalanx run here)."""
    t0 = time.perf_counter()
    times = {"python start-up and imports": process_age_s()}
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed if noise_seed is None else noise_seed)
    n = max(cfg.num_env_runners, 1) * cfg.num_envs_per_env_runner
    env = SameStepVectorEnv(
        [lambda: NoStepInfo(gym.make(cfg.env, disable_env_checker=True, **cfg.env_config))] * n
    )
    policy = build_policy(cfg, env.single_observation_space, env.single_action_space)
    optimizer = torch.optim.Adam(
        policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, foreach=True
    )
    norm = (
        RunningMeanStd(env.single_observation_space.shape) if cfg.normalize_observations else None
    )
    obs, _ = env.reset(seed=[cfg.seed + 1000 + i for i in range(n)])
    ep = {"ret": np.zeros(n)}
    recent: deque[float] = deque(maxlen=cfg.stop_window)
    times["start-up"] = time.perf_counter() - t0
    times["sampling"] = times["learning"] = 0.0
    timesteps, reached_at = 0, None
    while timesteps < cfg.max_timesteps:
        t = time.perf_counter()
        with torch.inference_mode():
            batch, obs = rollout(env, policy, obs, norm, cfg, ep, rng)
        times["sampling"] += time.perf_counter() - t
        timesteps += batch["rewards"].size
        recent.extend(batch["episode_returns"])
        if (
            cfg.stop_return is not None
            and len(recent) >= min(cfg.stop_window, cfg.stop_min_episodes)
            and np.mean(recent) >= cfg.stop_return
        ):
            reached_at = process_age_s()
            break
        if cfg.anneal_lr:
            frac = max(1.0 - timesteps / cfg.max_timesteps, cfg.lr_floor)
            optimizer.param_groups[0]["lr"] = frac * cfg.learning_rate
        t = time.perf_counter()
        ppo_update(policy, optimizer, flatten_batches([batch], cfg), cfg)
        times["learning"] += time.perf_counter() - t
    env.close()
    return {
        "timesteps": timesteps,
        "return_mean_recent": float(np.mean(recent)) if recent else float("nan"),
        "time_to_stop_return_s": reached_at,
        "process_wall_s": process_age_s(),
        "breakdown": times,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-timesteps", type=int, default=None)
    p.add_argument("--stop-return", type=float, default=None)
    args = p.parse_args()
    over = {k: v for k, v in (("max_timesteps", args.max_timesteps),
                              ("stop_return", args.stop_return)) if v is not None}  # fmt: skip
    out = train(PPOConfig.for_env(args.env, seed=args.seed, **over))
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in out["breakdown"].items())
    print(f"single process seed {args.seed}: {out['timesteps']} steps, return "
          f"{out['return_mean_recent']:.1f}, to stop {out['time_to_stop_return_s']}, "
          f"wall {out['process_wall_s']:.1f}s ({parts})")  # fmt: skip
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
