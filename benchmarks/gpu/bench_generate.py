"""Generation tokens/s: ``HFGenerationWorker``'s KV-cached loop vs HF ``generate``.

Both decode greedily the same batch (``--prompts`` x ``--samples`` rows: repeated prompts,
as a GRPO group has) for ``--new`` tokens with no stop token, in bf16 on a GPU (float32 on
a CPU). Prints ``RATIO phalanx_generate/hf_generate``; with ``--static`` also
``RATIO phalanx_generate/hf_static_compiled`` against HF's static KV cache with its
compiled decoding step (its compile time is reported, not counted). ``--model``: a folder
or an architecture of ``configs/`` (e.g. ``qwen2.5-0.5b``), else the tiny test model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import model_path, report, sync, timed  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8, help="rows per prompt")
    ap.add_argument("--new", type=int, default=48, help="tokens generated per row")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--static", action="store_true", help="also HF's static-cache compiled")
    args = ap.parse_args(argv)
    if min(args.prompts, args.samples, args.new, args.prompt_len, args.repeats) < 1:
        ap.error("--prompts, --samples, --new, --prompt-len and --repeats must be >= 1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import phalanx as px

    path = model_path(args.model, tempfile.mkdtemp(prefix="bench_generate_"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path)
    new = min(args.new, config.max_position_embeddings // 2)
    P = min(args.prompt_len, config.max_position_embeddings - new)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, config.vocab_size, (args.prompts, P), generator=gen)
    ids = ids.repeat_interleave(args.samples, 0)
    lengths = torch.full((ids.shape[0],), P)
    data = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = "bfloat16" if device == "cuda" else "float32"
    cfg = {
        "model_name": path,
        "max_new_tokens": new,
        "stop_token_ids": [-1],
        "precision": precision,
    }
    worker = px.HFGenerationWorker(cfg, tokenizer)
    ours = timed(lambda: worker.generate(data, greedy=True), args.repeats)
    worker.model = None  # free its memory before the baseline loads
    dtype = getattr(torch, precision)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    dev_ids = ids.to(device)

    def hf(**kwargs) -> None:
        model.generate(
            input_ids=dev_ids,
            attention_mask=torch.ones_like(dev_ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )

    tokens = ids.shape[0] * new
    common = {
        "model": os.path.basename(path.rstrip("/")),
        "rows": ids.shape[0],
        "prompt_len": P,
        "new_tokens": new,
        "phalanx_tokens_per_s": round(tokens / ours),
    }
    with torch.no_grad():
        theirs = timed(hf, args.repeats)
    records = [
        report(
            "bench_generate",
            "phalanx_generate/hf_generate",
            theirs / ours,
            **common,
            hf_tokens_per_s=round(tokens / theirs),
        )
    ]
    if args.static:
        with torch.no_grad():
            t0 = time.perf_counter()
            hf(cache_implementation="static")  # compiles the decoding step
            sync()
            compile_s = time.perf_counter() - t0
            static = timed(lambda: hf(cache_implementation="static"), args.repeats, warmup=1)
        records.append(
            report(
                "bench_generate",
                "phalanx_generate/hf_static_compiled",
                static / ours,
                **common,
                hf_static_tokens_per_s=round(tokens / static),
                hf_static_first_call_s=round(compile_s, 1),
            )
        )
    return records


if __name__ == "__main__":
    main()
    raise SystemExit(0)
