"""LoRA against full fine-tuning: one GRPO step's training phase, optimizer state, peak
memory, and the cost of merging adapters for a refit.

Each configuration (full fine-tuning, LoRA rank 8 and 32 on every linear layer, alpha 32
as NeMo-RL's example config) runs in its own process so that its peak memory is its own
(peak RSS on CPU, ``torch.cuda.max_memory_allocated`` on a GPU). A process loads the
model, builds one GRPO global batch (prompts x samples rows of random tokens with
advantages and old log-probs), runs one warm-up step, then times ``--steps`` steps of the
training phase: micro-batched forward/backward with the clipped policy-gradient loss,
gradient clipping, one AdamW step. LoRA processes also time the refit merge
(``merged_state_dict``: base + alpha/dim * B @ A for every adapted weight) against a
full-weight refit's floor (one copy of every weight into a preallocated buffer), and the
adapters-only alternative (copy the factors, merge on the receiver).

    python benchmarks/bench_lora.py                       # SmolLM2-135M-Instruct (fetched)
    python benchmarks/bench_lora.py --model tiny --prompts 4 --samples 4 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch
from _common import interleaved

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _batch(args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = args.prompts * args.samples
    ids = torch.randint(3, vocab, (rows, args.tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[:, : args.tokens // 4] = 0  # the prompt part is not trained on
    batch = {
        "input_ids": ids,
        "token_mask": mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, generator=g),
        "prev_logprobs": -torch.rand(rows, args.tokens, generator=g) * 5,
    }
    return {k: v.to(device) for k, v in batch.items()}


def _train_step(model, opt, params, batch, mbs: int, loss_fn) -> None:
    opt.zero_grad(set_to_none=True)
    rows = batch["input_ids"].shape[0]
    toks = (batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]).sum()
    seqs = batch["sample_mask"].sum()
    for i in range(0, rows, mbs):
        mb = {k: v[i : i + mbs] for k, v in batch.items()}
        logits = model(input_ids=mb["input_ids"]).logits
        loss, _ = loss_fn(logits, mb, seqs, toks)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    if batch["input_ids"].is_cuda:
        torch.cuda.synchronize()


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def _merge_costs(peft_model, repeats: int) -> dict[str, float]:
    from phalanx.llm.lora import adapter_factors, base_state_dict, merge_adapters, merged_state_dict

    base = base_state_dict(peft_model)
    dst = {k: torch.empty_like(v) for k, v in base.items()}
    factors = adapter_factors(peft_model)
    sent = {k: torch.empty_like(v) for k, v in factors.items()}

    def full_refit() -> None:
        for k, v in base.items():
            dst[k].copy_(v)

    def merged_refit() -> None:
        for k, v in merged_state_dict(peft_model).items():
            dst[k].copy_(v)

    def adapters_only() -> None:
        for k, v in factors.items():
            sent[k].copy_(v)
        merge_adapters(dst, sent)

    times = interleaved(
        {
            "full_refit_s": full_refit,
            "merged_refit_s": merged_refit,
            "adapters_only_s": adapters_only,
        },
        repeats,
        warmup=1,
    )
    return {
        **times,
        "factor_bytes": sum(v.numel() * v.element_size() for v in factors.values()),
    }


def child(args: argparse.Namespace) -> dict[str, float]:
    """One configuration (``args.rank`` 0: full fine-tuning) in this process."""
    from transformers import AutoModelForCausalLM

    from phalanx.llm.lora import apply_lora, lora_settings
    from phalanx.llm.loss import ClippedPGLossFn

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    peft_model = None
    if args.rank:
        cfg = {"enabled": True, "match_all_linear": True, "dim": args.rank, "alpha": 32}
        peft_model = apply_lora(model, lora_settings(cfg))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    batch = _batch(args, model.config.vocab_size, device)
    loss_fn = ClippedPGLossFn()
    setup_mb = _rss_mb() if device.type == "cpu" else torch.cuda.memory_allocated(device) / 2**20
    step = lambda: _train_step(model, opt, params, batch, args.micro_batch, loss_fn)  # noqa: E731
    out = {
        "train_s": interleaved({"train": step}, args.steps, warmup=1)["train"],
        "optimizer_bytes": _optimizer_bytes(opt),
        "trainable": sum(p.numel() for p in params),
        "setup_mb": setup_mb,
        "peak_mb": _peak_mb(device),
    }
    if peft_model is not None:
        out.update(_merge_costs(peft_model, args.merge_repeats))
    return out


def _model_path(name: str, tmp: str) -> str:
    if name == "tiny":
        from phalanx.algorithms.grpo_tiny_task import build_tiny_model

        return build_tiny_model(os.path.join(tmp, "tiny"))
    from phalanx.llm.models import resolve_model

    try:
        return resolve_model(name, quiet=True)
    except FileNotFoundError as e:
        sys.exit(f"{e}\n(or run with --model tiny)")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="'tiny', a known name or a folder"
    )
    p.add_argument("--ranks", default="8,32", help="LoRA ranks to compare with full fine-tuning")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="sequence length of each row")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="timed training steps (after one warm-up)")
    p.add_argument("--merge-repeats", type=int, default=5)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        args.rank = args.child
        print("RESULT " + json.dumps(child(args)))
        return
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_path(args.model, tmp)
        results = {}
        for rank in [0, *ranks]:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                *sys.argv[1:],
                "--child",
                str(rank),
                "--path",
                path,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(
                    f"configuration rank={rank} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
                )
            results[rank] = json.loads(lines[-1][len("RESULT ") :])
    rows = args.prompts * args.samples
    print(f"model {args.model}: {rows} rows x {args.tokens} tokens, micro-batch {args.micro_batch}")
    full = results[0]
    for rank, r in results.items():
        name = f"LoRA r{rank}" if rank else "full"
        print(
            f"  {name:<9} train {r['train_s']:7.2f} s  trainable {r['trainable'] / 1e6:8.3f} M  "
            f"optimizer {r['optimizer_bytes'] / 2**20:8.2f} MiB  peak {r['peak_mb']:8.0f} MiB "
            f"(after setup {r['setup_mb']:.0f} MiB)"
        )
    for rank in ranks:
        r = results[rank]
        print(
            f"RATIO training phase LoRA r{rank} / full: {r['train_s'] / full['train_s']:.3f} (goal <= 0.6)"
        )
        print(
            f"RATIO optimizer state LoRA r{rank} / full: "
            f"{r['optimizer_bytes'] / full['optimizer_bytes']:.4f} (goal <= 0.05)"
        )
        print(f"RATIO peak memory LoRA r{rank} / full: {r['peak_mb'] / full['peak_mb']:.3f}")
        print(
            f"RATIO merged refit / full-weight refit copy, r{rank}: "
            f"{r['merged_refit_s'] / r['full_refit_s']:.2f} ({r['merged_refit_s'] * 1e3:.1f} ms vs "
            f"{r['full_refit_s'] * 1e3:.1f} ms)"
        )
        print(
            f"RATIO adapters-only refit (copy factors, merge on receiver) / full-weight refit "
            f"copy, r{rank}: {r['adapters_only_s'] / r['full_refit_s']:.2f} "
            f"({r['factor_bytes'] / 2**20:.2f} MiB of factors)"
        )


if __name__ == "__main__":
    main()
