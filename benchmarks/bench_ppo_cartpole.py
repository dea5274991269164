"""Time to a mean return of 450 on CartPole-v1 with 2 env runners, start-up included.

Goal: <= 20 s wall time on a 2-core machine, counted from the start of this script's
phalanx imports (Ray start-up and worker launch included). Baseline, same run: the same
PPO with no remote runners (``num_env_runners=0``: sampling and learning in this one
process, no Ray). The issue quotes RLlib 2.60's PPO at over 40 s on this machine; it is
not re-measured here (RLlib needs ``dm-tree``, which is not installed).

    python benchmarks/bench_ppo_cartpole.py [--env-runners 2] [--async] [--target 450]
"""

from __future__ import annotations

import time

T_SCRIPT = time.perf_counter()

import argparse  # noqa: E402
import tempfile  # noqa: E402


def run(num_env_runners: int, target: float, async_sampling: bool, seed: int, t0: float) -> dict:
    from phalanx.algorithms.ppo import PPOConfig, train

    cfg = PPOConfig.for_env(
        "CartPole-v1",
        num_env_runners=num_env_runners,
        stop_return=target,
        max_timesteps=300_000,
        seed=seed,
        async_sampling=async_sampling,
        name=f"bench_{num_env_runners}",
        runs_dir=tempfile.mkdtemp(prefix="phalanx_bench_"),
    )
    out = train(cfg, progress=False)
    out["wall_from_start_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-runners", type=int, default=2)
    p.add_argument("--target", type=float, default=450.0)
    p.add_argument("--async", dest="async_sampling", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args()
    ours = run(args.env_runners, args.target, args.async_sampling, args.seed, T_SCRIPT)
    line = (
        f"phalanx PPO, {args.env_runners} env runners{' (async)' if args.async_sampling else ''}: "
        f"mean return {ours['return_mean_recent']:.1f} after {ours['timesteps']:,} timesteps, "
        f"{ours['wall_from_start_s']:.1f} s wall from start (training loop "
        f"{ours['train_loop_s']:.1f} s), {ours['steps_per_s']:,.0f} env steps/s, "
        f"reached={ours['reached_stop_return']}"
    )
    print(line, flush=True)
    print(f"goal <= 20 s: {'met' if ours['wall_from_start_s'] <= 20 else 'missed'}")
    if args.no_baseline:
        return
    t0 = time.perf_counter()
    base = run(0, args.target, False, args.seed, t0)
    print(
        f"baseline, one process (no Ray): mean return {base['return_mean_recent']:.1f} after "
        f"{base['timesteps']:,} timesteps, {base['wall_from_start_s']:.1f} s, "
        f"{base['steps_per_s']:,.0f} env steps/s"
    )
    print(
        f"ratio (phalanx wall incl. start-up / one-process wall): "
        f"{ours['wall_from_start_s'] / base['wall_from_start_s']:.2f}x; "
        f"training loop only: {ours['train_loop_s'] / base['train_loop_s']:.2f}x; "
        f"env steps/s: {ours['steps_per_s'] / base['steps_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
