"""Policy worker train step tokens/s on CUDA in bf16 vs a plain Hugging Face step.

``DTensorPolicyWorker`` (FSDP2, world size 1, ``precision="bfloat16"``) trains on random
token batches; the baseline is the same model's forward, backward and AdamW step under
bf16 autocast, without FSDP. The model is ``--model`` / ``$PHALANX_GPU_MODEL`` (e.g. a
SmolLM2-135M folder), else the tiny test model. Prints ``RATIO policy_train/plain_hf``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import model_path, rank0_env, report, timed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if min(args.rows, args.seq, args.repeats) < 1:
        ap.error("--rows, --seq and --repeats must be >= 1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import phalanx as px
    from phalanx.llm.loss import NLLLoss

    work = tempfile.mkdtemp(prefix="bench_train_")
    path = model_path(args.model, work)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    vocab = AutoConfig.from_pretrained(path).vocab_size
    seq = min(args.seq, AutoConfig.from_pretrained(path).max_position_embeddings)
    ids = torch.randint(0, vocab, (args.rows, seq), generator=torch.Generator().manual_seed(0))
    data = px.BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.full((args.rows,), seq),
        token_mask=torch.ones(args.rows, seq),
        sample_mask=torch.ones(args.rows),
    )
    cfg = {
        "model_name": path,
        "precision": "bfloat16",
        "train_global_batch_size": args.rows,
        "train_micro_batch_size": min(8, args.rows),
        "max_total_sequence_length": seq,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}},
    }
    rank0_env()
    worker = px.DTensorPolicyWorker(cfg, tokenizer, init_reference_model=False)
    try:
        policy_s = timed(lambda: worker.train(data, NLLLoss()), args.repeats)
    finally:
        worker.shutdown()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gpu_ids = ids.cuda()
    mbs = cfg["train_micro_batch_size"]

    def plain_step() -> None:
        opt.zero_grad(set_to_none=True)
        for s in range(0, args.rows, mbs):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=gpu_ids[s : s + mbs], use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1)
            nll = -lp.gather(-1, gpu_ids[s : s + mbs, 1:, None]).sum()
            (nll / (args.rows * (seq - 1))).backward()
        opt.step()

    plain_s = timed(plain_step, args.repeats)
    tokens = args.rows * seq
    report(
        "bench_train",
        "policy_train/plain_hf",
        (tokens / policy_s) / (tokens / plain_s),
        model=os.path.basename(path.rstrip("/")),
        policy_tokens_per_s=round(tokens / policy_s),
        plain_tokens_per_s=round(tokens / plain_s),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
