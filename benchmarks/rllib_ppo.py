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

``--settings phalanx`` (HalfCheetah-v5 only) gives RLlib phalanx's own hyperparameters
instead (``TUNED["HalfCheetah-v5"]``, CleanRL's MuJoCo PPO), so that the two runtimes train
the same algorithm: 2 runners x 4 envs x 256 steps = 2048-step batches, 64-step
minibatches, 10 epochs, lr 3e-4 annealed to 5% over 1M steps, clip 0.2, value weight 0.5
and no value clipping, gradient norm 0.5, separate tanh 64x64 policy and value nets, a
state-independent log-std, observations normalised and clipped to +-10 (RLlib's
``MeanStdFilter``), rewards scaled by 0.1 (a reward wrapper; the return it reports and
stops on is scaled back).

Changes on every env, so that it measures what phalanx measures:

* no evaluation runner: training stops on the mean return of the last ``--window``
  sampled episodes (``metrics_num_episodes_for_smoothing``), as phalanx stops;
* Ray starts the way phalanx starts it: a fresh local instance without the dashboard,
  16 logical CPUs (the driver's learner and two runners need 3 of them; a 2-core machine
  would otherwise leave one runner pending forever).

    python benchmarks/rllib_ppo.py --seed 1 [--env CartPole-v1] [--stop-return 450]
        [--settings rllib|phalanx]
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
PHALANX_SETTINGS = {
    "HalfCheetah-v5": {
        "env_runners": {"num_envs_per_env_runner": 4, "rollout_fragment_length": 256},
        "model": {"fcnet_hiddens": [64, 64], "fcnet_activation": "tanh", "vf_share_layers": False,
                  "free_log_std": True},
        "training": {"gamma": 0.99, "lambda_": 0.95, "lr": [[0, 3e-4], [1_000_000, 1.5e-5]],
                     "num_epochs": 10, "train_batch_size": 2048, "minibatch_size": 64,
                     "clip_param": 0.2, "vf_loss_coeff": 0.5, "vf_clip_param": float("inf"),
                     "entropy_coeff": 0.0, "grad_clip": 0.5, "grad_clip_by": "global_norm",
                     "use_kl_loss": False},
        "reward_scale": 0.1,
        "mean_std_filter": True,
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
    p.add_argument(
        "--settings",
        default="rllib",
        choices=("rllib", "phalanx"),
        help="RLlib's tuned example for the env, or phalanx's hyperparameters",
    )
    args = p.parse_args()
    table = SETTINGS if args.settings == "rllib" else PHALANX_SETTINGS
    if args.env not in table:
        p.error(f"--settings {args.settings} has no entry for {args.env} ({sorted(table)})")
    s = table[args.env]

    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    ray.init(address="local", num_cpus=16, num_gpus=0, include_dashboard=False)
    scale = s.get("reward_scale", 1.0)
    env = args.env
    if scale != 1.0:
        import gymnasium as gym
        from ray.tune.registry import register_env

        env = f"{args.env}-reward-x{scale:g}"
        register_env(
            env, lambda _: gym.wrappers.TransformReward(gym.make(args.env), lambda r: r * scale)
        )
    runner_options = dict(s["env_runners"])
    if s.get("mean_std_filter"):
        from ray.rllib.connectors.env_to_module import MeanStdFilter

        runner_options["env_to_module_connector"] = lambda *_: MeanStdFilter(clip_by_value=10.0)
    config = (
        PPOConfig()
        .api_stack(enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
        .environment(env)
        .env_runners(num_env_runners=args.env_runners, **runner_options)
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
        ret = float(runners.get("episode_return_mean", float("nan"))) / scale
        if ret >= args.stop_return:
            reached_at = process_age_s()
            break
    summary = {
        "seed": args.seed,
        "settings": args.settings,
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
