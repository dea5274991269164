"""Keeping the policy's training state for in-place recovery: mapped files vs a checkpoint.

After every GRPO step each policy rank keeps its weights, optimizer and scheduler state
outside its process, so a relaunched rank can restore it. ``keep_state`` copies the state
into memory-mapped files laid out once (two slots in turn); the baseline is
``save_checkpoint`` (``torch.distributed.checkpoint``) into a fresh folder of the same
file system, which is how the state was kept before. Both write to ``--root`` (default
``/dev/shm``, memory of the driver's node). One ``DTensorPolicyWorker`` (world size 1,
bf16 mixed precision: fp32 weights and Adam moments) in this process. Prints
``RATIO keep_state/dcp_save`` (below 1: faster), the first keep (files created) and a
restore into the same worker.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import model_path, one_rank_policy, report, timed  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from transformers import AutoTokenizer

    work = tempfile.mkdtemp(prefix="bench_keep_state_")
    path = model_path(args.model, work)
    root = tempfile.mkdtemp(prefix="bench_keep_state_", dir=args.root)
    worker = one_rank_policy(path, AutoTokenizer.from_pretrained(path))
    slots = iter(range(10**6))
    saves = iter(range(10**6))

    def dcp_save() -> None:
        folder = os.path.join(root, f"step_{next(saves)}")
        worker.save_checkpoint(os.path.join(folder, "weights"), os.path.join(folder, "optim"))
        shutil.rmtree(folder)  # as the old keep removed the previous state

    try:
        t = time.perf_counter()
        nbytes = worker.keep_state(root, next(slots) % 2)
        first = time.perf_counter() - t
        keep = timed(lambda: worker.keep_state(root, next(slots) % 2), args.repeats, warmup=0)
        save = timed(dcp_save, args.repeats)
        t = time.perf_counter()
        worker.restore_kept_state(root, 0)
        restore = time.perf_counter() - t
    finally:
        worker.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return report(
        "bench_keep_state",
        "keep_state/dcp_save",
        keep / save,
        model=os.path.basename(path.rstrip("/")),
        mib=round(nbytes / (1 << 20), 1),
        keep_s=round(keep, 4),
        first_keep_s=round(first, 4),
        dcp_save_s=round(save, 4),
        restore_s=round(restore, 4),
    )


if __name__ == "__main__":
    main()
    raise SystemExit(0)
