"""Pendulum-v1 (continuous actions) with PPO and 2 env runners to a mean return >= -300.

Prints the time (start-up included), the timesteps used and the env steps/s, and the
same run with no remote runners (one process, no Ray) as the baseline of the same run.

    python benchmarks/bench_ppo_pendulum.py [--env-runners 2] [--target -300] [--no-baseline]
"""

from __future__ import annotations

import time

T_SCRIPT = time.perf_counter()

import argparse  # noqa: E402
import tempfile  # noqa: E402


def run(num_env_runners: int, target: float, seed: int, t0: float, budget: int) -> dict:
    from phalanx.algorithms.ppo import PPOConfig, train

    cfg = PPOConfig.for_env(
        "Pendulum-v1",
        num_env_runners=num_env_runners,
        stop_return=target,
        max_timesteps=budget,
        seed=seed,
        name=f"bench_pendulum_{num_env_runners}",
        runs_dir=tempfile.mkdtemp(prefix="phalanx_bench_"),
    )
    out = train(cfg, progress=False)
    out["wall_from_start_s"] = time.perf_counter() - t0
    return out


def _line(label: str, out: dict) -> str:
    return (
        f"{label}: mean return {out['return_mean_recent']:.1f} after {out['timesteps']:,} "
        f"timesteps, {out['wall_from_start_s']:.1f} s wall from start, "
        f"{out['steps_per_s']:,.0f} env steps/s, reached={out['reached_stop_return']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-runners", type=int, default=2)
    p.add_argument("--target", type=float, default=-300.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-timesteps", type=int, default=600_000)
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args()
    ours = run(args.env_runners, args.target, args.seed, T_SCRIPT, args.max_timesteps)
    print(_line(f"phalanx PPO, {args.env_runners} env runners", ours), flush=True)
    if args.no_baseline:
        return
    t0 = time.perf_counter()
    base = run(0, args.target, args.seed, t0, args.max_timesteps)
    print(_line("baseline, one process (no Ray)", base))
    print(
        f"ratio (phalanx wall / one-process wall): {ours['wall_from_start_s'] / base['wall_from_start_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
