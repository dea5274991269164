"""``phalanx eval runs/<name>``: run a saved PPO policy and print its mean return.

The checkpoint carries the policy, the observation normaliser and the config, so the
evaluation sees observations exactly as the policy did in training. Episodes run in this
process on one local env runner (greedy actions unless ``--stochastic``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from phalanx._base.checks import check_int


def evaluate(
    run_dir: str | Path, episodes: int = 10, *, seed: int = 12345, stochastic: bool = False
) -> dict[str, Any]:
    """Mean and std of the returns of ``episodes`` episodes of the run's saved policy."""
    import torch

    from phalanx.algorithms.ppo_config import PPOConfig
    from phalanx.algorithms.ppo_run import build_policy, load_checkpoint
    from phalanx.envs import DEFAULT_POLICY_ID, EnvRunner

    check_int(episodes, "episodes", minimum=1)
    ckpt = load_checkpoint(run_dir)
    cfg = PPOConfig.from_dict(ckpt["config"])
    torch.manual_seed(seed)
    rc = cfg.env_runner_config()
    rc.num_env_runners = 0
    rc.num_envs_per_env_runner = min(episodes, 8)
    rc.seed = seed
    runner = EnvRunner(rc, worker_index=0)
    try:
        runner.set_connector_state(ckpt["connector"])
        policy = build_policy(cfg, ckpt["observation_space"], ckpt["action_space"])
        policy.load_state_dict(ckpt["policy"])
        runner.add_policy(DEFAULT_POLICY_ID, policy=policy)
        # evaluation sees observations through the training normaliser, frozen
        batch = runner.sample(num_episodes=episodes, explore=stochastic, update_connectors=False)
    finally:
        runner.stop()
    returns = batch["episode_returns"]
    return {
        "env": cfg.env,
        "episodes": int(len(returns)),
        "return_mean": float(np.mean(returns)),
        "return_std": float(np.std(returns)),
        "episode_len_mean": float(np.mean(batch["episode_lengths"])),
        "trained_timesteps": int(ckpt["timesteps"]),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir",
        help="the run folder (runs/<name>: its newest checkpoint) or one checkpoints/step_N folder",
    )
    parser.add_argument("--episodes", type=int, default=10, help="episodes to run (default 10)")
    parser.add_argument("--seed", type=int, default=12345, help="env seed (default 12345)")
    parser.add_argument(
        "--stochastic", action="store_true", help="sample actions instead of the greedy ones"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        out = evaluate(args.run_dir, args.episodes, seed=args.seed, stochastic=args.stochastic)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"phalanx eval: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{out['env']}: mean return {out['return_mean']:.2f} ± {out['return_std']:.2f} over "
            f"{out['episodes']} episodes (policy trained for {out['trained_timesteps']:,} timesteps)"
        )
    return 0
