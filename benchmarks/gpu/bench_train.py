"""Policy worker train step vs a plain Hugging Face step: tokens/s and model FLOPs utilisation.

``DTensorPolicyWorker`` (FSDP2, world size 1, bf16 mixed precision, dynamic batching, fused
AdamW, gradient clipping) trains on a batch of random tokens; the baseline is the loop a
user writes by hand on the same model and batch: float32 weights, forward under bf16
autocast, the same attention implementation (sdpa), the same masked token NLL, fused AdamW
and clipping, micro-batches of ``--mbs`` rows in order, each cut to its longest row.

``--lengths uniform``: every row is ``--seq`` tokens (the two do the same work, so the
ratio is phalanx's overhead). ``--lengths varied``: lengths drawn from [seq/4, seq], as a
GRPO batch has (dynamic batching then sorts rows by length and pads less).

``--model`` / ``$PHALANX_GPU_MODEL`` names a folder or an architecture of ``configs/``
(``qwen2.5-0.5b``, ``qwen2.5-1.5b``: random weights), else the tiny test model. Prints
``RATIO policy_train/plain_hf`` and a ``RESULT`` record with both tokens/s and MFU (of the
card's dense bf16 peak); ``--profile`` also prints where each step's GPU time goes.
``--compile on`` compiles the worker's decoder layers (``dtensor_cfg.compile``); the first
step, which compiles, is timed apart (``policy_first_step_s``) and not in the ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

from phalanx.llm.policy_config import LOGPROB_KERNELS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bf16_peak_flops, model_path, profile_summary, rank0_env, report, timed  # noqa: E402


def batch_lengths(rows: int, seq: int, mode: str, seed: int = 0) -> torch.Tensor:
    """Row lengths: all ``seq`` (uniform) or uniform in [seq/4, seq] (varied)."""
    if mode == "uniform":
        return torch.full((rows,), seq, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(max(2, seq // 4), seq + 1, (rows,), generator=gen)


def make_batch(rows: int, seq: int, vocab: int, lengths: torch.Tensor, pad: int) -> dict:
    """Right-padded random token rows with NeMo-RL's masks (every real token trained)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    valid = torch.arange(seq)[None] < lengths[:, None]
    return {
        "input_ids": ids.masked_fill(~valid, pad),
        "input_lengths": lengths,
        "token_mask": valid.float(),
        "sample_mask": torch.ones(rows),
    }


def policy_config(
    path: str,
    rows: int,
    seq: int,
    mbs: int,
    device: str,
    chunk: int | None = None,
    kernel: str = "auto",
    gather_once: str | bool = "auto",
    compiled: bool = False,
) -> dict:
    """The policy config of the measured worker: bf16 (float32 on a CPU, whose bf16 matrix
    products are slow), dynamic batching, fused AdamW; ``chunk`` positions per eager
    log-prob chunk (None: the worker's default), the log-prob ``kernel``, whether FSDP's
    gathered weights are kept for the step (``dtensor_cfg.gather_weights_once_per_step``)
    and whether the decoder layers are compiled (``dtensor_cfg.compile``)."""
    kwargs = {"lr": 1e-5, **({"fused": True} if device == "cuda" else {})}
    return {
        "dtensor_cfg": {"gather_weights_once_per_step": gather_once, "compile": compiled},
        **({"logprob_chunk_size": chunk} if chunk is not None else {}),
        "logprob_kernel": kernel,
        "model_name": path,
        "precision": "bfloat16" if device == "cuda" else "float32",
        "train_global_batch_size": rows,
        "train_micro_batch_size": mbs,
        "max_total_sequence_length": seq,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": kwargs},
        "dynamic_batching": {
            "enabled": True,
            "train_mb_tokens": mbs * seq,
            "logprob_mb_tokens": mbs * seq,
            "sequence_length_round": 64,
        },
    }


def plain_hf_step(path: str, batch: dict, mbs: int, device: str):
    """A closure running one plain HF training step on ``batch``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if device == "cuda" else {}))
    ids = batch["input_ids"].to(device)
    mask = batch["token_mask"].to(device)
    lengths = batch["input_lengths"].tolist()
    total = mask[:, 1:].sum()
    rows = ids.shape[0]
    amp_dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for s in range(0, rows, mbs):
            t = max(lengths[s : s + mbs])
            mb_ids, mb_mask = ids[s : s + mbs, :t], mask[s : s + mbs, 1:t]
            with torch.autocast(device, dtype=amp_dtype, enabled=device == "cuda"):
                logits = model(input_ids=mb_ids, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1)
            nll = -(lp.gather(-1, mb_ids[:, 1:, None])[..., 0] * mb_mask).sum()
            (nll / total).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    return step, model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--lengths", choices=("uniform", "varied"), default="uniform")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--logprob-chunk-size", type=int, default=None,
        help="positions per eager log-prob chunk of the policy worker (default: its own)",
    )  # fmt: skip
    ap.add_argument(
        "--logprob-kernel", choices=LOGPROB_KERNELS, default="auto",
        help="the policy worker's log-prob kernel (auto: compiled on a GPU with Triton)",
    )  # fmt: skip
    ap.add_argument(
        "--gather-once", choices=("auto", "on", "off"), default="auto",
        help="keep FSDP's gathered weights for the whole step (auto: with one FSDP shard)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", choices=("on", "off"), default="off",
        help="torch.compile the policy worker's decoder layers (dtensor_cfg.compile)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if min(args.rows, args.seq, args.mbs, args.repeats) < 1:
        ap.error("--rows, --seq, --mbs and --repeats must be >= 1")
    if args.rows % args.mbs:
        ap.error(f"--mbs {args.mbs} must divide --rows {args.rows}")
    from transformers import AutoConfig, AutoTokenizer

    import phalanx as px
    from phalanx.llm.flops import decoder_shape
    from phalanx.llm.logprobs import kernel_runs
    from phalanx.llm.loss import NLLLoss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = model_path(args.model, tempfile.mkdtemp(prefix="bench_train_"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path)
    seq = min(args.seq, config.max_position_embeddings)
    lengths = batch_lengths(args.rows, seq, args.lengths)
    batch = make_batch(args.rows, seq, config.vocab_size, lengths, tokenizer.pad_token_id)
    gather_once = {"auto": "auto", "on": True, "off": False}[args.gather_once]
    cfg = policy_config(
        path,
        args.rows,
        seq,
        args.mbs,
        device,
        args.logprob_chunk_size,
        args.logprob_kernel,
        gather_once,
        args.compile == "on",
    )
    shards, _ = px.BatchedDataDict(batch).shard_by_batch_size(
        1,
        batch_size=args.rows,
        dynamic_batching_args={
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "max_tokens_per_microbatch": args.mbs * seq,
            "sequence_length_round": 64,
        },
    )
    rank0_env()
    worker = px.DTensorPolicyWorker(cfg, tokenizer, init_reference_model=False)
    gathered = worker.gather_once
    runs_before = kernel_runs()
    try:
        # The first step apart: it compiles (with --compile on, and the log-prob kernel).
        first_s = timed(lambda: worker.train(shards[0], NLLLoss()), 1, warmup=0)
        policy_s = timed(lambda: worker.train(shards[0], NLLLoss()), args.repeats, warmup=0)
        if args.profile:
            profile_summary(lambda: worker.train(shards[0], NLLLoss()), "phalanx train step")
    finally:
        runs = {k: v - runs_before.get(k, 0) for k, v in kernel_runs().items()}
        worker.shutdown()
        worker.model = worker.optimizer = None  # free its memory before the baseline loads
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    step, model = plain_hf_step(path, batch, args.mbs, device)
    plain_s = timed(step, args.repeats)
    if args.profile:
        profile_summary(step, "plain HF train step")
    params = sum(p.numel() for p in model.parameters())
    del model, step

    tokens = int(lengths.sum())
    try:
        shape = decoder_shape(config)
        flops = sum(shape.train_flops(int(n)) for n in lengths)
    except ValueError:  # an architecture the count does not cover
        flops = None
    peak = bf16_peak_flops()

    def mfu(seconds: float) -> float | None:
        return round(flops / seconds / peak, 4) if flops and peak else None

    return report(
        "bench_train",
        "policy_train/plain_hf",
        plain_s / policy_s,
        model=os.path.basename(path.rstrip("/")),
        params_m=round(params / 1e6, 1),
        lengths=args.lengths,
        rows=args.rows,
        seq=seq,
        mbs=args.mbs,
        logprob_chunk_size=args.logprob_chunk_size,
        logprob_kernel=args.logprob_kernel,
        logprob_kernel_runs={k: v for k, v in runs.items() if v},
        gather_once=gathered,
        compile=args.compile == "on",
        policy_first_step_s=round(first_s, 3),
        tokens=tokens,
        policy_tokens_per_s=round(tokens / policy_s),
        plain_tokens_per_s=round(tokens / plain_s),
        policy_mfu=mfu(policy_s),
        plain_mfu=mfu(plain_s),
        peak_tflops=round(peak / 1e12, 1) if peak else None,
    )


if __name__ == "__main__":
    main()
    raise SystemExit(0)
