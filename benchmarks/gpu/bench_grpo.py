"""A few GRPO steps on one GPU, policy and generation colocated: step time and its phases.

phalanx's GRPO loop (``phalanx.algorithms.grpo.train``) on a one-GPU Ray cluster, the
policy (FSDP2, bf16) and one generation worker sharing the GPU, refitted by CUDA IPC.
The model is ``--model`` (default ``qwen2.5-0.5b``: random weights, so responses run to
``--new`` tokens, GRPO's batch shape at its longest); the prompts are the tiny addition
task's. Reports the median of each phase over the steps after the first (which warms up),
and ``RATIO grpo_step/phases``: the step's wall time over the sum of its phases (every
``time/<phase>`` the loop logs: generation, log-probs, training, keeping the recovery
state, refit, ...; waits that overlap a phase are left out), i.e. what the loop adds
around them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import model_path, report  # noqa: E402

PHASES = ("generation", "logprobs", "training", "refit")  # always reported, 0 when absent


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new", type=int, default=512, help="max new tokens per response")
    ap.add_argument("--mbs", type=int, default=8, help="train micro-batch rows")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step warms up)")
    if min(args.prompts, args.new, args.mbs) < 1 or args.samples < 2:
        ap.error("--prompts, --new and --mbs must be >= 1 and --samples >= 2")
    import torch

    import phalanx as px
    from phalanx.algorithms.grpo import GRPOConfig, train

    work = tempfile.mkdtemp(prefix="bench_grpo_")
    path = model_path(args.model, work)
    gpus = 1 if torch.cuda.is_available() else 0
    cfg = GRPOConfig(
        model=path,
        task="tiny-addition",
        format_reward=0.0,
        steps=args.steps,
        prompts_per_step=args.prompts,
        samples_per_prompt=args.samples,
        max_new_tokens=args.new,
        train_micro_batch_size=args.mbs,
        logprob_micro_batch_size=args.mbs,
        eval_every=0,
        eval_at_start=False,
        checkpoint_every=10_000,
        num_policy_workers=1,
        num_generation_workers=1,
        run_dir=os.path.join(work, "run"),
        progress=False,
    )
    cluster = px.Cluster(num_cpus=8, num_gpus=gpus)
    try:
        result = train(cfg, cluster)
    finally:
        cluster.shutdown()
    ratio, figures = summarize(result["history"], args.prompts * args.samples)
    return report(
        "bench_grpo",
        "grpo_step/phases",
        ratio,
        model=os.path.basename(path.rstrip("/")),
        steps=args.steps,
        max_new_tokens=args.new,
        **figures,
    )


def summarize(history: list[dict], rows: int) -> tuple[float, dict]:
    """The step over the sum of its phases, and the figures of the report: each phase's
    median over the steps after the first, the generated tokens/s, the first step."""
    from phalanx.observe.plots import phase_keys

    later = history[1:]
    names = [k.removeprefix("time/") for k in phase_keys(later) if not k.endswith("_wait")]
    names = list(PHASES) + [k for k in names if k not in PHASES]
    median = {k: statistics.median(r.get(f"time/{k}", 0.0) for r in later) for k in names}
    step = statistics.median(r["time/step"] for r in later)
    tokens = statistics.median(r["response_length"] for r in later) * rows
    figures = {
        "rows": rows,
        "step_s": round(step, 3),
        **{f"{k}_s": round(v, 3) for k, v in median.items()},
        "generated_tokens_per_s": round(tokens / median["generation"]),
        "first_step_s": round(history[0]["time/step"], 3),
    }
    return step / sum(median.values()), figures


if __name__ == "__main__":
    main()
    raise SystemExit(0)
