"""Refit of the whole model into a colocated generation worker by CUDA IPC vs one device copy.

The policy (``DTensorPolicyWorker``, bf16, this process) hands its weights to an
``HFGenerationWorker`` in another process on the same GPU with NeMo-RL's methods:
``prepare_weights_for_ipc`` and ``get_weights_ipc_handles`` on the policy,
``update_weights_from_ipc_handles`` on the generator. One refit is timed from the first
call to the generator's answer. The floor is one device-to-device ``copy_`` of the same
bytes in one process. Prints ``RATIO refit_ipc/d2d_copy`` and each phase's seconds.
``--model``: a folder or an architecture of ``configs/`` (e.g. ``qwen2.5-1.5b``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import model_path, rank0_env, report, sync, timed  # noqa: E402


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("bench_refit: needs CUDA (CUDA IPC)")
    from transformers import AutoTokenizer

    import phalanx as px

    path = model_path(args.model, tempfile.mkdtemp(prefix="bench_refit_"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    ctx = torch.multiprocessing.get_context("spawn")
    in_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=generator, args=(path, in_q, out_q), daemon=True)
    proc.start()
    rank0_env()
    cfg = {
        "model_name": path,
        "precision": "bfloat16",
        "train_global_batch_size": 1,
        "train_micro_batch_size": 1,
    }
    worker = px.DTensorPolicyWorker(
        cfg, tokenizer, init_optimizer=False, init_reference_model=False
    )
    phases: dict[str, list[float]] = {"prepare": [], "handles": [], "update": []}
    try:
        if out_q.get(timeout=300) != "ready":
            raise RuntimeError("generator did not start")

        def refit() -> None:
            t0 = time.perf_counter()
            info, _ = worker.prepare_weights_for_ipc()
            t1 = time.perf_counter()
            handles = worker.get_weights_ipc_handles([k for k, _ in info])
            t2 = time.perf_counter()
            in_q.put(handles)
            ok, update_s = out_q.get(timeout=300)
            if ok is not True:
                raise RuntimeError("update_weights_from_ipc_handles did not return True")
            phases["prepare"].append(t1 - t0)
            phases["handles"].append(t2 - t1)
            phases["update"].append(update_s)

        ipc = timed(refit, args.repeats)
        in_q.put(None)
        got = out_q.get(timeout=300)
        state = worker.return_full_state_dict()
        for k, v in got.items():  # the generator holds the policy's weights (bf16)
            torch.testing.assert_close(
                torch.from_numpy(v), state[k][:4].to(torch.bfloat16).float(), rtol=0, atol=0
            )
        nbytes = sum(n for _, n in worker.prepare_weights_for_ipc()[0])
    finally:
        worker.shutdown()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    floor = timed(lambda: dst.copy_(src), args.repeats)
    sync()

    def median(xs: list[float]) -> float:
        return round(sorted(xs)[len(xs) // 2], 5)

    return report(
        "bench_refit",
        "refit_ipc/d2d_copy",
        ipc / floor,
        model=os.path.basename(path.rstrip("/")),
        mib=round(nbytes / (1 << 20), 1),
        refit_s=round(ipc, 5),
        floor_s=round(floor, 5),
        prepare_s=median(phases["prepare"]),
        handles_s=median(phases["handles"]),
        update_s=median(phases["update"]),
    )


if __name__ == "__main__":
    main()
    raise SystemExit(0)
