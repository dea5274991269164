"""Generation tokens/s on CUDA: ``HFGenerationWorker``'s KV-cached loop vs HF ``generate``.

Both decode greedily the same batch of prompts (repeated prompts, as a GRPO group has)
for ``--new`` tokens with no stop token. Prints ``RATIO phalanx_generate/hf_generate``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import model_path, report, timed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8, help="rows per prompt")
    ap.add_argument("--new", type=int, default=48, help="tokens generated per row")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if min(args.prompts, args.samples, args.new, args.repeats) < 1:
        ap.error("--prompts, --samples, --new and --repeats must be >= 1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import phalanx as px

    path = model_path(args.model, tempfile.mkdtemp(prefix="bench_generate_"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path)
    new = min(args.new, config.max_position_embeddings // 2)
    P = min(16, config.max_position_embeddings - new)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, config.vocab_size, (args.prompts, P), generator=gen)
    ids = ids.repeat_interleave(args.samples, 0)
    lengths = torch.full((ids.shape[0],), P)
    data = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
    cfg = {"model_name": path, "max_new_tokens": new, "stop_token_ids": [-1]}
    worker = px.HFGenerationWorker(cfg, tokenizer)
    ours = timed(lambda: worker.generate(data, greedy=True), args.repeats)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    gpu_ids = ids.cuda()

    def hf() -> None:
        model.generate(
            input_ids=gpu_ids,
            attention_mask=torch.ones_like(gpu_ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=tokenizer.pad_token_id,
        )

    with torch.no_grad():
        theirs = timed(hf, args.repeats)
    tokens = ids.shape[0] * new
    report(
        "bench_generate",
        "phalanx_generate/hf_generate",
        (tokens / ours) / (tokens / theirs),
        model=os.path.basename(path.rstrip("/")),
        rows=ids.shape[0],
        new_tokens=new,
        phalanx_tokens_per_s=round(tokens / ours),
        hf_tokens_per_s=round(tokens / theirs),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
