"""RLlib 2.60 PPO with 2 env runners: seconds from process start to a mean return.

The baseline process of ``bench_ppo.py --vs-rllib``. Runs in the RLlib environment
(``benchmarks/requirements-rllib.txt``; it cannot share the phalanx one), never imports
phalanx, and prints one JSON line as its last line of output.

Settings are RLlib's own, per env (ray-project/ray ``rllib/tuned_examples/ppo/``), new API
stack:

* CartPole-v1, ``cartpole_ppo.py``: one 32-unit linear layer shared by policy and value
  function, gamma 0.99, lr 3e-4, 6 epochs, value loss weight 0.01, KL loss on; the rest
  RLlib's PPO defaults (4000-step batches, 128-step minibatches, lambda 1.0).
* HalfCheetah-v5, ``benchmark_ppo_mujoco.py`` (RLlib's MuJoCo benchmark, written for
  HalfCheetah-v4 with 32 runners and a GPU learner; its target is a return of 2000 within
  1M steps): gamma 0.99, lambda 0.95, lr 3e-4, 15 epochs, 16384-step batches, 4096-step
  minibatches, value loss weight 0.01, tanh 64x64 shared by policy and value function.
  Here 2 runners of 4 envs each (phalanx's layout) instead of 32 runners of one, and the
  learner on the CPU.

Changes on every env, so that it measures what phalanx measures:

* no evaluation runner: training stops on the mean return of the last ``--window``
  sampled episodes (``metrics_num_episodes_for_smoothing``), as phalanx stops;
* Ray starts the way phalanx starts it: a fresh local instance without the dashboard,
  16 logical CPUs (the driver's learner and two runners need 3 of them; a 2-core machine
  would otherwise leave one runner pending forever).

    python benchmarks/rllib_ppo.py --seed 1 [--env CartPole-v1] [--stop-return 450]
"""

from __future__ import annotations

import argparse
import json
import os

SETTINGS = {
    "CartPole-v1": {
        "env_runners": {},
        "model": {"fcnet_hiddens": [32], "fcnet_activation": "linear", "vf_share_layers": True},
        "training": {"gamma": 0.99, "lr": 3e-4, "num_epochs": 6, "vf_loss_coeff": 0.01,
                     "use_kl_loss": True},
    },
    "HalfCheetah-v5": {
        "env_runners": {"num_envs_per_env_runner": 4},
        "model": {"fcnet_hiddens": [64, 64], "fcnet_activation": "tanh", "vf_share_layers": True},
        "training": {"gamma": 0.99, "lambda_": 0.95, "lr": 3e-4, "num_epochs": 15,
                     "train_batch_size": 32 * 512, "minibatch_size": 4096,
                     "vf_loss_coeff": 0.01},
    },
}  # fmt: skip


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
    p.add_argument("--env", default="CartPole-v1", choices=sorted(SETTINGS))
    p.add_argument("--stop-return", type=float, default=450.0)
    p.add_argument("--window", type=int, default=20, help="episodes in the mean return")
    p.add_argument("--max-timesteps", type=int, default=500_000)
    p.add_argument("--env-runners", type=int, default=2)
    args = p.parse_args()

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False)
    s = SETTINGS[args.env]
    config = (
        PPOConfig()
        .api_stack(enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
        .environment(args.env)
        .env_runners(num_env_runners=args.env_runners, **s["env_runners"])
        .rl_module(model_config=DefaultModelConfig(**s["model"]))
        .training(**s["training"])
        .reporting(metrics_num_episodes_for_smoothing=args.window)
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
        "t_stop": reached_at,
        "startup_s": started,
        "timesteps": timesteps,
        "iterations": iterations,
        "return_mean": ret,
        "process_wall_s": process_age_s(),
    }
    print(json.dumps(summary), flush=True)
    algo.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
