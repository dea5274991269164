"""GRPO on a real pretrained model: SmolLM2-135M-Instruct learning two-digit addition on CPU.

Fetches the model if needed (``phalanx models fetch smollm2-135m-instruct``), measures
held-out greedy accuracy of the base model (the baseline, step 0), runs GRPO for at most
``--minutes`` of wall time, measures it again, and prints: accuracy before and after and
their ratio, steps, wall time, the median step-time breakdown per phase and the peak
memory per phase. The curve (training reward and held-out accuracy per step) is copied to
``--curve`` (default ``docs/grpo_smollm2_addition.png``) and a JSON summary printed.

Goal (issue 17): held-out accuracy from about 7% to at least 40% within 60 minutes on
2 CPU cores.

    python benchmarks/bench_grpo_real.py --minutes 60 --run-dir runs/grpo_real
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-time budget of GRPO")
    ap.add_argument("--run-dir", default="runs/grpo_real")
    ap.add_argument("--curve", default="docs/grpo_smollm2_addition.png")
    ap.add_argument(
        "--steps", type=int, default=1000, help="step cap (the budget usually ends first)"
    )
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--kl-beta", type=float, default=0.0)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads per worker")
    ap.add_argument("--precision", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--train-micro-batch-size", type=int, default=8)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    from phalanx.algorithms.grpo import GRPOConfig, train
    from phalanx.llm.models import fetch_model

    t0 = time.perf_counter()
    fetch_model("smollm2-135m-instruct")
    fetch_s = time.perf_counter() - t0
    cfg = GRPOConfig(
        model="smollm2-135m-instruct",
        task="addition",
        run_dir=args.run_dir,
        steps=args.steps,
        time_limit_s=args.minutes * 60,
        prompts_per_step=args.prompts_per_step,
        samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        kl_beta=args.kl_beta,
        eval_size=args.eval_size,
        eval_every=args.eval_every,
        num_threads=args.num_threads,
        precision=args.precision,
        train_micro_batch_size=args.train_micro_batch_size,
        checkpoint_every=10,
        resume=args.resume,
        progress=True,
    )
    result = train(cfg)
    hist = result["history"]
    evals = result["eval_accuracy"]
    phases = ("generation", "logprobs", "training", "refit", "step")
    breakdown = {p: statistics.median(h[f"time/{p}"] for h in hist) for p in phases if hist}
    mem = {}
    for key in ("generation", "logprobs", "training"):
        vals = [h[f"memory/{key}_peak_gb"] for h in hist if f"memory/{key}_peak_gb" in h]
        if vals:
            mem[key] = max(vals)
    before, after = evals[0][1], evals[-1][1]
    summary = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised)",
        "task": "addition (two-digit), held-out split",
        "cores": os.cpu_count(),
        "load_average_1min_at_end": os.getloadavg()[0],
        "accuracy_before": before,
        "accuracy_after": after,
        "evaluations": evals,
        "steps": len(hist),
        "grpo_wall_s": result["wall_s"],
        "fetch_s": fetch_s,
        "median_phase_s": breakdown,
        "peak_memory_gb": mem,
        "config": {k: getattr(cfg, k) for k in vars(args) if hasattr(cfg, k)},
    }
    if result["curve"]:
        os.makedirs(os.path.dirname(args.curve) or ".", exist_ok=True)
        shutil.copy(result["curve"], args.curve)
        summary["curve"] = args.curve
    print(json.dumps(summary, indent=2))
    print(
        f"held-out greedy accuracy {before:.1%} -> {after:.1%} after {len(hist)} steps in "
        f"{result['wall_s'] / 60:.1f} min (goal: >= 40% within 60 min)"
    )
    if hist:
        print("median step time: " + ", ".join(f"{p} {t:.1f}s" for p, t in breakdown.items()))
    ratio = after / before if before else float("inf")
    print(f"RATIO accuracy after / before: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
