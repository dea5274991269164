"""Synchronous vs asynchronous GRPO, in two placements, in one script.

Four runs of the same wall-time budget each: {sync, async} x {shared, disaggregated}.
Shared: every worker may use every core (sync's phases each take all of them; async's
two sides take half each). Disaggregated: the policy workers are pinned to the first half
of the cores, the generation workers to the rest (NeMo-RL's non-colocated setup on one
machine). Printed per run: steps/hour (after the first step), mean wait of each side
(``time/training_wait``: the trainer waiting for rollouts or for a batch in flight before
its refit; ``time/generation_wait``: the collector idle), mean trajectory age, held-out
accuracy at the end; then RATIO async/sync steps/hour per placement (goals: >= 1.4x
disaggregated, >= 0.95x shared), and for disaggregated the most overlap can give there,
from the synchronous run's phase times. One PNG: held-out accuracy and training reward against
wall time for the four runs, and steps/hour bars. Last, the tiny model with 4 generation
workers on 8 logical CPUs shows the pipeline's scheduling without the 2-core ceiling.

    python benchmarks/bench_grpo_async.py --minutes 20              # the real measurement
    python benchmarks/bench_grpo_async.py --tiny --minutes 0.5      # a quick check
    python benchmarks/bench_grpo_async.py --lora-rank 8             # the README's LoRA command
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

RUNS = [("sync", "shared"), ("async", "shared"), ("sync", "disaggregated"),
        ("async", "disaggregated")]  # fmt: skip


def _config(args: argparse.Namespace, mode: str, placement: str, run_dir: str, **extra: Any):
    from phalanx.algorithms.grpo import GRPOConfig

    common = dict(
        run_dir=run_dir,
        async_grpo=mode == "async",
        placement=placement,
        time_limit_s=args.minutes * 60,
        checkpoint_every=10**6,
        progress=False,
        **extra,
    )
    if args.tiny:
        return GRPOConfig.tiny(steps=10**6, warmup_steps=20, eval_every=5, **common)
    lora = {"lora_rank": args.lora_rank, "lr": args.lr} if args.lora_rank else {}
    return GRPOConfig(model=args.model, task="addition", steps=10**6, eval_at_start=True,
                      **lora, **common)  # fmt: skip


def _summary(hist: list[dict[str, Any]], evals: list[tuple[int, float]]) -> dict[str, float]:
    span = hist[-1]["elapsed_s"] - hist[0]["elapsed_s"] if len(hist) > 1 else float("nan")

    def mean(key: str) -> float:
        values = [h[key] for h in hist if key in h]
        return statistics.fmean(values) if values else float("nan")

    return {
        "steps": len(hist),
        "steps_per_hour": (len(hist) - 1) / span * 3600 if len(hist) > 1 else float("nan"),
        "training_wait_s": mean("time/training_wait"),
        "generation_wait_s": mean("time/generation_wait"),
        "generation_s": mean("time/generation"),
        "training_s": mean("time/training"),
        # tokens trained per step and their rate: a longer training phase from more tokens
        # (older batches' longer answers) against one from slower tokens (contention)
        "train_tokens": mean("train/tokens"),
        "train_tokens_per_s": mean("throughput/train_tokens_per_s"),
        "trajectory_age": mean("async/trajectory_age_mean"),
        "eval_accuracy": evals[-1][1] if evals else float("nan"),
    }


def _plot(results: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_rew, ax_bar) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, r in results.items():
        hist = r["history"]
        t0 = hist[0]["elapsed_s"] - hist[0]["time/step"] if hist else 0.0
        at = {h["step"]: (h["elapsed_s"] - t0) / 60 for h in hist}
        at.setdefault(0, 0.0)
        ax_acc.plot([at[s] for s, _ in r["evals"]], [a for _, a in r["evals"]], "o-", label=name)
        ax_rew.plot([at[h["step"]] for h in hist], [h["reward_mean"] for h in hist], label=name)
    ax_acc.set(xlabel="minutes of training", ylabel="held-out greedy accuracy")
    ax_rew.set(xlabel="minutes of training", ylabel="training reward (mean of the step)")
    names = list(results)
    ax_bar.bar(names, [results[n]["summary"]["steps_per_hour"] for n in names])
    ax_bar.set(ylabel="steps / hour")
    ax_bar.tick_params(axis="x", labelrotation=20)
    for ax in (ax_acc, ax_rew):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-time budget per run")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (a quick check)")
    parser.add_argument("--png", default="grpo_async.png")
    parser.add_argument(
        "--placements",
        nargs="+",
        default=["shared", "disaggregated"],
        choices=["shared", "disaggregated"],
        help="which pairs of runs",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA rank for every run (0: full fine-tuning, the default config)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=2e-4,
        help="learning rate with --lora-rank (the README's LoRA command's)",
    )
    parser.add_argument("--no-four", action="store_true",
                        help="skip the tiny 4-generation-worker run")  # fmt: skip
    args = parser.parse_args()

    import phalanx as px
    from phalanx.algorithms.grpo import train

    cluster = px.Cluster(num_cpus=max(8, os.cpu_count() or 1))
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as d:
        for mode, placement in [r for r in RUNS if r[1] in args.placements]:
            name = f"{mode} {placement}"
            out = train(_config(args, mode, placement, os.path.join(d, name.replace(" ", "_"))),
                        cluster)  # fmt: skip
            summary = _summary(out["history"], out["eval_accuracy"])
            results[name] = {"history": out["history"], "evals": out["eval_accuracy"],
                             "summary": summary}  # fmt: skip
            print(
                f"{name:<22} " + ", ".join(f"{k} {v:.3g}" for k, v in summary.items()), flush=True
            )
        for placement, goal in (("disaggregated", ">= 1.4"), ("shared", ">= 0.95")):
            if placement not in args.placements:
                continue
            a = results[f"async {placement}"]["summary"]["steps_per_hour"]
            s = results[f"sync {placement}"]["summary"]["steps_per_hour"]
            print(f"RATIO async/sync steps per hour, {placement}: {a / s:.2f}x (goal {goal})")
            if placement == "disaggregated":
                # Each side on its own cores: sync's step is generation + training, async's at
                # least the longer of the two, so overlap gives at most 1 + shorter/longer.
                sync = results[f"sync {placement}"]["summary"]
                g, t = sync["generation_s"], sync["training_s"]
                print(f"  ceiling from sync's phases, 1 + min(g, t) / max(g, t): "
                      f"{1 + min(g, t) / max(g, t):.2f}x (g {g:.3g} s, t {t:.3g} s)")  # fmt: skip
        _plot(results, args.png)
        print(f"curves: {args.png}")

        if args.no_four:
            return
        # The scheduling without the 2-core ceiling: 4 generation workers, tiny model.
        cfg = _config(argparse.Namespace(tiny=True, minutes=min(args.minutes, 2.0)), "async",
                      "shared", os.path.join(d, "four"), num_generation_workers=4)  # fmt: skip
        out = train(cfg, cluster)
        summary = _summary(out["history"], out["eval_accuracy"])
        print("tiny, async, 4 generation workers: "
              + ", ".join(f"{k} {v:.3g}" for k, v in summary.items()))  # fmt: skip


if __name__ == "__main__":
    main()
