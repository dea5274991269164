"""``phalanx demo``: a short tour of the runtime on the embedded Ray.

Starts Ray, launches a sharded group (dp x tp), runs a sharded call on a BatchedDataDict,
shows who was called and who returned, and prints timings.
"""

from __future__ import annotations

import argparse
import os
import time

import phalanx as px


class DemoWorker(px.Worker):
    """Sums its shard; reports where it runs."""

    def where(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "address": self.worker_address.get_name()}

    def train(self, data, scale: float = 1.0) -> dict:
        with self.worker_timer("train"):
            with self.worker_timer("sum"):
                total = float(data["x"].sum()) * scale
            time.sleep(0.01)
        return {"rank": self.rank, "rows": int(data["x"].shape[0]), "sum": total}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument(
        "--rows", type=int, default=1024, help="rows of the demo batch (default 1024)"
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.dp < 1 or args.tp < 1:
        raise ValueError("--dp and --tp must be >= 1")
    if args.rows % args.dp:
        raise ValueError(f"--rows {args.rows} must be divisible by --dp {args.dp}")
    t0 = time.perf_counter()
    cluster = px.Cluster()
    t_ray = time.perf_counter() - t0
    n = args.dp * args.tp
    layout = [[d * args.tp + t for t in range(args.tp)] for d in range(args.dp)]
    sharding = px.NamedSharding(layout, ["dp", "tp"])
    t0 = time.perf_counter()
    group = DemoWorker.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=n), name="demo", sharding=sharding
    )
    t_launch = time.perf_counter() - t0
    console.print(
        f"[bold]phalanx demo[/bold]: Ray up in {t_ray:.2f}s, {n} workers launched in {t_launch:.2f}s"
    )
    console.print(f"sharding: {sharding}")

    batch = px.BatchedDataDict({"x": torch.arange(args.rows, dtype=torch.float32)})
    t0 = time.perf_counter()
    fut = group.run_all_workers_sharded_data(
        "train",
        data=batch,
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
        common_kwargs={"scale": 1.0},
    )
    results = fut.get_results(group)
    t_call = time.perf_counter() - t0
    table = Table(title="sharded call: train(data) over dp, replicated over tp")
    for col in ("rank", "coords", "called", "returned", "rows", "sum"):
        table.add_column(col)
    by_rank = {r["rank"]: r for r in results}
    for rank in range(n):
        r = by_rank.get(rank)
        table.add_row(
            str(rank),
            str(sharding.get_worker_coords(rank)),
            "yes" if rank in fut.called_workers else "no",
            "yes" if rank in fut.return_from_workers else "no",
            str(r["rows"]) if r else "-",
            f"{r['sum']:.0f}" if r else "-",
        )
    console.print(table)
    expected = float(batch["x"].sum())
    got = sum(r["sum"] for r in results)
    console.print(
        f"sum over returned shards {got:.0f} (expected {expected:.0f}); call took {t_call * 1e3:.1f} ms"
    )

    h = group.train(px.BatchedDataDict({"x": torch.ones(8)}))
    h.wait()
    console.print(f"timers (max over ranks): {h.consume_durations()}")
    t0 = time.perf_counter()
    for _ in range(100):
        group.where().wait()
    console.print(
        f"100 fan-out calls to {n} workers: {(time.perf_counter() - t0) * 10:.2f} ms per call"
    )
    console.print(f"execute_on(0, {n - 1}): {group.execute_on(0, n - 1).where().wait()}")
    group.shutdown()
    cluster.shutdown()
    if got != expected:
        console.print("[red]sums differ[/red]")
        return 1
    return 0
