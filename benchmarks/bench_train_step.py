"""The GRPO training step's FLOP rate against an fp32 matrix product, interleaved.

This machine's product rate moves between levels from one minute to the next, so a
ratio against a product measured before or after a run carries that drift. Here one
process builds the policy worker GRPO uses (``DTensorPolicyWorker``, one rank, dynamic
batching, the on-policy GRPO loss, the real model, fp32) and alternates: a 2048^2 fp32
``torch.mm`` sample, one training step on a GRPO-shaped batch (64 rows: a 40-token chat
prompt and 8-64 response tokens, as the README command's steps have), another product
sample. Each step's rate (6 x parameters x unpadded tokens / step time) is divided by the
mean of the two products around it; the median over steps is the RATIO.

    python benchmarks/bench_train_step.py --steps 5 [--logprob-kernel compiled]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from phalanx.llm.policy_config import LOGPROB_KERNELS

PROMPT = 40


def _batch(rng: random.Random, pad_id: int, rows: int) -> tuple[object, int]:
    from phalanx.data import BatchedDataDict

    lengths = [rng.randint(8, 64) for _ in range(rows)]
    T = PROMPT + max(lengths)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    ids = torch.randint(0, 49000, (rows, T), generator=gen)
    mask = torch.zeros(rows, T)
    for i, n in enumerate(lengths):
        mask[i, PROMPT : PROMPT + n] = 1
        ids[i, PROMPT + n :] = pad_id
    data = BatchedDataDict(
        input_ids=ids,
        token_mask=mask,
        input_lengths=torch.tensor([PROMPT + n for n in lengths]),
        advantages=torch.randn(rows),
        sample_mask=torch.ones(rows),
    )
    return data, sum(PROMPT + n for n in lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument(
        "--logprob-kernel", choices=LOGPROB_KERNELS, default="auto",
        help="the policy worker's log-prob kernel (auto: eager on a CPU)",
    )  # fmt: skip
    args = ap.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", "0")
    from bench_precision import mm_rate
    from transformers import AutoTokenizer

    from phalanx.algorithms.grpo_loss import OnPolicyPGLossFn
    from phalanx.llm.models import cache_root
    from phalanx.llm.policy_worker import DTensorPolicyWorker

    torch.set_num_threads(os.cpu_count() or 1)
    path = os.path.join(cache_root(), "smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    max_seq = PROMPT + 64
    budget = 8 * max_seq
    cfg = {
        "model_name": path,
        "train_global_batch_size": args.rows,
        "train_micro_batch_size": 8,
        "max_total_sequence_length": max_seq,
        "precision": "float32",
        "max_grad_norm": 1.0,
        "logprob_kernel": args.logprob_kernel,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-7}},
        "dynamic_batching": {"enabled": True, "train_mb_tokens": budget,
                             "logprob_mb_tokens": budget, "sequence_length_round": 16},
    }  # fmt: skip
    worker = DTensorPolicyWorker(cfg, tokenizer, init_reference_model=False)
    params = sum(p.numel() for p in worker.model.parameters())
    loss_fn = OnPolicyPGLossFn({"reference_policy_kl_penalty": 0.0})
    plan = {"input_key": "input_ids", "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": budget, "sequence_length_round": 16}  # fmt: skip
    rng = random.Random(0)

    def step() -> tuple[float, int]:
        data, tokens = _batch(rng, tokenizer.pad_token_id, args.rows)
        shard = data.shard_by_batch_size(1, batch_size=args.rows, dynamic_batching_args=plan)
        t = time.perf_counter()
        worker.train(shard[0][0], loss_fn)
        return time.perf_counter() - t, tokens

    step()  # warm-up
    ratios, rates = [], []
    mm = mm_rate(2048, torch.float32, repeats=5)
    for i in range(args.steps):
        seconds, tokens = step()
        mm_next = mm_rate(2048, torch.float32, repeats=5)
        rate = 6 * params * tokens / seconds
        ratios.append(rate / ((mm + mm_next) / 2))
        rates.append(rate)
        print(
            f"step {i + 1}: {tokens} tokens in {seconds:.1f} s, {rate / 1e9:.1f} GFLOP/s; "
            f"product {mm / 1e9:.0f} -> {mm_next / 1e9:.0f} GFLOP/s; ratio {ratios[-1]:.2f}",
            flush=True,
        )
        mm = mm_next
    print(
        f"RATIO training step FLOP rate / fp32 matmul rate (interleaved): "
        f"{statistics.median(ratios):.2f} (goal >= 0.70; {statistics.median(rates) / 1e9:.1f} "
        f"GFLOP/s median; per step {min(ratios):.2f}-{max(ratios):.2f})"
    )
    worker.shutdown()


if __name__ == "__main__":
    main()
