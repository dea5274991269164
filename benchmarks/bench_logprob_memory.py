"""Peak memory of chosen-token log-probs: full ``log_softmax`` + gather (the baseline,
phalanx's code before) against ``phalanx.llm.logprobs`` (chunked, chosen tokens only).

Each variant runs in a fresh subprocess on the same logits (batch x positions x vocab,
float32 as on CPU); the figure is the peak resident memory above the logits themselves.
``inference`` is get_logprobs (no grad); ``training`` is a loss forward and backward.

    python benchmarks/bench_logprob_memory.py [--batch 16 --positions 128 --vocab 49152]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _child(variant: str, phase: str, b: int, t: int, v: int) -> None:
    import torch

    from phalanx.llm.logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    if phase == "training":
        logits.requires_grad_()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.set_grad_enabled(phase == "training"):
        if variant == "baseline":
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            lp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        else:
            lp = token_logprobs(logits, ids)
        if phase == "training":
            lp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mb": (peak - base) / 1024}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--positions", type=int, default=128)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "PHASE"))
    a = p.parse_args()
    if a.child:
        _child(*a.child, a.batch, a.positions, a.vocab)
        return
    logits_mb = a.batch * a.positions * a.vocab * 4 / 2**20
    print(f"logits {a.batch} x {a.positions} x {a.vocab} float32 = {logits_mb:.0f} MB")
    for phase in ("inference", "training"):
        got = {}
        for variant in ("baseline", "chunked"):
            cmd = [sys.executable, __file__, "--child", variant, phase]
            cmd += ["--batch", str(a.batch), "--positions", str(a.positions)]
            cmd += ["--vocab", str(a.vocab)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[variant] = json.loads(out.strip().splitlines()[-1])["extra_mb"]
        ratio = got["baseline"] / max(got["chunked"], 1e-9)
        print(
            f"{phase:9s}: peak above the logits  baseline {got['baseline']:7.0f} MB   "
            f"chunked {got['chunked']:7.0f} MB   ratio {ratio:.1f}x"
        )


if __name__ == "__main__":
    main()
