"""Weight sync by CUDA IPC vs a device-to-device copy floor (512 MiB by default).

The sender process packs its weights into one CUDA buffer and shares the handle
(``phalanx.weights.pack_to_cuda`` / ``ipc_handle``); the receiver (this process) opens
it and copies every tensor into its own. The floor is one ``copy_`` of the same bytes
inside one process. Prints ``RATIO cuda_ipc_sync/d2d_copy``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import report, timed  # noqa: E402

MIB = 1 << 20


def weights(total_mib: int, n: int) -> dict[str, torch.Tensor]:
    per = total_mib * MIB // 4 // n
    return {f"layer{i}.weight": torch.full((per,), float(i), device="cuda") for i in range(n)}


def sender(total_mib: int, n: int, out_q, cmd_q) -> None:
    from phalanx.weights import gather, ipc_handle, pack_to_cuda

    named = weights(total_mib, n)
    layout, sources = gather(named)
    alive = None
    while cmd_q.get() != "exit":
        t0 = time.perf_counter()
        alive = pack_to_cuda(layout, sources, torch.device("cuda", 0))
        out_q.put((layout, ipc_handle(alive), time.perf_counter() - t0))
    del alive


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.mib < 1 or args.tensors < 1 or args.repeats < 1:
        ap.error("--mib, --tensors and --repeats must be >= 1")
    from phalanx.weights import open_handle, views

    own = weights(args.mib, args.tensors)
    src = torch.empty(args.mib * MIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    floor = timed(lambda: dst.copy_(src), args.repeats)

    ctx = torch.multiprocessing.get_context("spawn")
    out_q, cmd_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=sender, args=(args.mib, args.tensors, out_q, cmd_q), daemon=True)
    proc.start()

    def sync() -> None:
        cmd_q.put("next")
        layout, handle, _ = out_q.get(timeout=120)
        for k, v in views(open_handle(handle), layout).items():
            own[k].copy_(v)

    try:
        ipc = timed(sync, args.repeats)
        assert all(float(v[0]) == i for i, v in enumerate(own.values()))
    finally:
        cmd_q.put("exit")
        proc.join(60)
    report(
        "bench_ipc",
        "cuda_ipc_sync/d2d_copy",
        ipc / floor,
        mib=args.mib,
        ipc_s=round(ipc, 5),
        floor_s=round(floor, 5),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
