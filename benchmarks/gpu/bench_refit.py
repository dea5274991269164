"""Refit of the whole model into a colocated generation worker by CUDA IPC vs one device copy.

The policy (``DTensorPolicyWorker``, bf16, this process) hands its weights to an
``HFGenerationWorker`` in another process on the same GPU with NeMo-RL's methods:
``prepare_weights_for_ipc`` and ``get_weights_ipc_handles`` on the policy,
``update_weights_from_ipc_handles`` on the generator. A refit is timed from the first
call to the generator's answer. The first refit (cold: the policy allocates its refit
buffer, the generator maps it) is timed apart from the next ``--repeats`` (steady: the
same buffer and mapping), whose medians make the ratio. The floor is one
device-to-device ``copy_`` of the same bytes (the packed weights, tied ones once) in one
process. Prints ``RATIO refit_ipc/d2d_copy``, and a ``PARTS`` line per kind of refit:
prepare, pack (the policy's ``get_weights_ipc_handles``), update (the generator's copy)
and other (the handles' trip between processes and the answer's). Without CUDA the same
runs through shared memory against one host memory copy (the CPU path of the same
methods). ``--model``: a folder or an architecture of ``configs/`` (e.g. ``qwen2.5-1.5b``);
with ``--narrow``, that architecture's every tensor at tiny widths (``_common.narrow_model``):
the bytes then cost nothing, and the figures are a refit's fixed cost at the real model's
tensor count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    model_path,
    narrow_model,
    one_rank_policy,
    report,
    sync,
    timed,
)


def generator(path: str, in_q, out_q) -> None:
    """A generation worker that applies each handle it gets and answers with the seconds."""
    from transformers import AutoTokenizer

    from phalanx.llm.generation import HFGenerationWorker

    cfg = {"model_name": path, "precision": "bfloat16", "max_new_tokens": 1}
    worker = HFGenerationWorker(cfg, AutoTokenizer.from_pretrained(path))
    out_q.put("ready")
    while (handles := in_q.get(timeout=600)) is not None:
        t0 = time.perf_counter()
        ok = worker.update_weights_from_ipc_handles(handles)
        out_q.put((ok, time.perf_counter() - t0))
    out_q.put({k: v[:4].float().cpu().numpy() for k, v in worker.model.state_dict().items()})


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _parts_line(kind: str, parts: dict[str, float]) -> str:
    shown = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items())
    return f"PARTS {kind}: {shown}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--narrow",
        action="store_true",
        help="the --model architecture's every tensor at tiny widths: a refit's fixed cost",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from transformers import AutoTokenizer

    cuda = torch.cuda.is_available()
    workdir = tempfile.mkdtemp(prefix="bench_refit_")
    path = narrow_model(args.model, workdir) if args.narrow else model_path(args.model, workdir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ctx = torch.multiprocessing.get_context("spawn")
    in_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=generator, args=(path, in_q, out_q), daemon=True)
    proc.start()
    worker = one_rank_policy(path, tokenizer, init_optimizer=False)
    last: dict = {}  # the handles of the latest refit
    phases: dict[str, list[float]] = {
        k: [] for k in ("refit", "prepare", "pack", "update", "other")
    }
    try:
        if out_q.get(timeout=300) != "ready":
            raise RuntimeError("generator did not start")

        def refit() -> None:
            t0 = time.perf_counter()
            info, _ = worker.prepare_weights_for_ipc()
            t1 = time.perf_counter()
            handles = worker.get_weights_ipc_handles([k for k, _ in info])
            t2 = time.perf_counter()
            last.clear()
            last.update(handles)
            in_q.put(handles)
            ok, update_s = out_q.get(timeout=300)
            t3 = time.perf_counter()
            if ok is not True:
                raise RuntimeError("update_weights_from_ipc_handles did not return True")
            phases["refit"].append(t3 - t0)
            phases["prepare"].append(t1 - t0)
            phases["pack"].append(t2 - t1)
            phases["update"].append(update_s)
            phases["other"].append(t3 - t2 - update_s)  # the handles' trip and the answer's

        for _ in range(1 + args.repeats):
            refit()
        in_q.put(None)
        got = out_q.get(timeout=300)
        state = worker.return_full_state_dict()
        for k, v in got.items():  # the generator holds the policy's weights (bf16)
            torch.testing.assert_close(
                torch.from_numpy(v), state[k][:4].to(torch.bfloat16).float(), rtol=0, atol=0
            )
        (handle,) = last.values()
        nbytes = handle["layout"].total_bytes  # what a refit moves: tied weights once
    finally:
        worker.shutdown()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    dst = torch.empty_like(src)
    floor = timed(lambda: dst.copy_(src), args.repeats)
    sync()

    parts: dict[str, dict[str, float]] = {}
    for kind, pick in (("cold", lambda xs: xs[0]), ("steady", lambda xs: _median(xs[1:]))):
        parts[kind] = {k: pick(v) for k, v in phases.items()}
        print(_parts_line(kind, {k: v for k, v in parts[kind].items() if k != "refit"}), flush=True)
    steady, cold = parts["steady"], parts["cold"]
    return report(
        "bench_refit",
        "refit_ipc/d2d_copy",
        steady["refit"] / floor,
        model=os.path.basename(path.rstrip("/")),
        tensors=len(handle["layout"].specs) + len(handle["layout"].aliases),
        transport="cuda_ipc" if cuda else "shm",
        mib=round(nbytes / (1 << 20), 1),
        refit_s=round(steady["refit"], 7),
        floor_s=round(floor, 7),
        prepare_s=round(steady["prepare"], 7),
        handles_s=round(steady["pack"], 7),
        update_s=round(steady["update"], 7),
        other_s=round(steady["other"], 7),
        repeats=args.repeats,
        cold_refit_s=round(cold["refit"], 7),
        cold_prepare_s=round(cold["prepare"], 7),
        cold_handles_s=round(cold["pack"], 7),
        cold_update_s=round(cold["update"], 7),
    )


if __name__ == "__main__":
    main()
    raise SystemExit(0)
