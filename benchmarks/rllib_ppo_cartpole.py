"""RLlib 2.60 PPO on CartPole-v1 with 2 env runners: seconds from process start to a mean
return of 450. The baseline process of ``bench_ppo_cartpole.py --vs-rllib``.

Runs in the RLlib environment (``benchmarks/requirements-rllib.txt``; it cannot share the
phalanx one), never imports phalanx, and prints one JSON line as its last line of output.

Settings: RLlib's own tuned CartPole PPO (``rllib/tuned_examples/ppo/cartpole_ppo.py`` in
ray-project/ray): new API stack, one 32-unit linear layer shared by policy and value
function, gamma 0.99, lr 3e-4, 6 epochs, value loss weight 0.01, KL loss on; everything
else is RLlib's PPO default (4000-step batches, 128-step minibatches, lambda 1.0). Two
changes, both so that it measures what phalanx measures:

* no evaluation runner: the tuned example stops on a separate greedy evaluation; here,
  like phalanx, training stops on the mean return of the last 20 sampled episodes
  (``metrics_num_episodes_for_smoothing=20``; RLlib's default window is 100).
* Ray starts the way phalanx starts it: a fresh local instance without the dashboard,
  16 logical CPUs (the driver's learner and two runners need 3 of them; a 2-core machine
  would otherwise leave one runner pending forever).

    python benchmarks/rllib_ppo_cartpole.py --seed 1 [--stop-return 450]
"""

from __future__ import annotations

import argparse
import json
import os


def process_age_s() -> float:
    """Seconds since this process started (from /proc, no extra dependency)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stop-return", type=float, default=450.0)
    p.add_argument("--max-timesteps", type=int, default=500_000)
    p.add_argument("--env-runners", type=int, default=2)
    args = p.parse_args()

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False)
    config = (
        PPOConfig()
        .api_stack(enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
        .environment("CartPole-v1")
        .env_runners(num_env_runners=args.env_runners)
        .rl_module(
            model_config=DefaultModelConfig(
                fcnet_hiddens=[32], fcnet_activation="linear", vf_share_layers=True
            )
        )
        .training(gamma=0.99, lr=0.0003, num_epochs=6, vf_loss_coeff=0.01, use_kl_loss=True)
        .reporting(metrics_num_episodes_for_smoothing=20)
        .debugging(seed=args.seed)
    )
    algo = config.build_algo()
    started = process_age_s()
    reached_at = None
    timesteps = iterations = 0
    ret = float("nan")
    while timesteps < args.max_timesteps:
        result = algo.train()
        iterations += 1
        runners = result.get("env_runners", {})
        timesteps = int(runners.get("num_env_steps_sampled_lifetime", 0))
        ret = float(runners.get("episode_return_mean", float("nan")))
        if ret >= args.stop_return:
            reached_at = process_age_s()
            break
    summary = {
        "seed": args.seed,
        "reached": reached_at is not None,
        "t450": reached_at,
        "startup_s": started,
        "timesteps": timesteps,
        "iterations": iterations,
        "return_mean": ret,
    }
    print(json.dumps(summary), flush=True)
    algo.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
