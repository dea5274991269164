"""Fan-out and launch as groups grow: phalanx group vs raw Ray, at several sizes.

For each size N:

- no-op call to every worker: ``group.noop().wait()`` vs ``ray.get([a.noop.remote() ...])``
  on the *same* actors (``group.actors``), interleaved; goal <= 1.10x at every size;
- launch: ``create_group().launch(...)`` until every worker answers vs creating N bare
  raw Ray actors (one CPU each, a class that imports nothing of phalanx) until every one
  answers; goal <= 1.2x. Measured raw, group, group, raw (each side's mean), so neither
  side always finds Ray's pool of idle worker processes fuller. Also printed: the launch
  of the same worker class as N plain Ray actors (``ray.remote(num_cpus=1)(Noop)``); it
  pays phalanx's import like the group, and Ray's set-up of every method a
  ``phalanx.Worker`` inherits (the host actor exposes only the worker's public methods);
- driver memory: growth of this process's RSS per worker, for the group and the raw actors.

``--nodes K`` runs the same on a ``ray.cluster_utils.Cluster`` of K local nodes (the group
spread over the nodes with ``NodePlacement(num_workers=N)``; the raw actors spread by
Ray's default scheduling).

    python benchmarks/bench_fanout.py [--sizes 8,32,64] [--nodes 4] [--repeats 200]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import psutil
import ray
from _common import interleaved

import phalanx as px


class Noop(px.Worker):
    def noop(self):
        return None


RawNoop = ray.remote(num_cpus=1)(Noop)  # the same worker class as a plain Ray actor


@ray.remote(num_cpus=1)
class BareActor:
    def noop(self):
        return None


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def _wait_cpus_free(total: float, timeout_s: float = 120.0) -> None:
    """Block until Ray gives back every CPU (killed actors release theirs asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) + 1e-9 < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"CPUs not released after {timeout_s}s")
        time.sleep(0.05)


def _launch_raw(cls, n: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    actors = [cls.remote() for _ in range(n)]
    ray.get([a.noop.remote() for a in actors])
    return actors, time.perf_counter() - t0


def _kill_raw(actors: list, total_cpus: float) -> None:
    for a in actors:
        ray.kill(a)
    _wait_cpus_free(total_cpus)


def _launch_group(cluster: px.Cluster, n: int, name: str) -> tuple[px.WorkerGroup, float]:
    t0 = time.perf_counter()
    group = Noop.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=n), name=name, timeout_s=900
    )
    group.noop().wait()
    return group, time.perf_counter() - t0


def bench_size(cluster: px.Cluster, n: int, repeats: int) -> dict[str, float]:
    total_cpus = ray.cluster_resources().get("CPU", 0.0)
    _wait_cpus_free(total_cpus)
    bare_times, group_times = [], []
    # bare, group, group, bare: the pool of idle worker processes Ray keeps is drained by
    # whichever side runs first after a quiet spell.
    mem0 = _rss_mb()
    bare, t = _launch_raw(BareActor, n)
    raw_mem = (_rss_mb() - mem0) / n
    bare_times.append(t)
    _kill_raw(bare, total_cpus)
    del bare
    mem0 = _rss_mb()
    group, t = _launch_group(cluster, n, f"bench_fanout_{n}_a")
    group_mem = (_rss_mb() - mem0) / n
    group_times.append(t)
    group.shutdown()
    _wait_cpus_free(total_cpus)
    group, t = _launch_group(cluster, n, f"bench_fanout_{n}_b")
    group_times.append(t)
    actors = group.actors
    t_call = interleaved(
        {
            "phalanx": lambda: group.noop().wait(),
            "raw": lambda: ray.get([a.noop.remote() for a in actors]),
        },
        repeats=repeats,
        warmup=10,
    )
    group.shutdown()
    _wait_cpus_free(total_cpus)
    bare, t = _launch_raw(BareActor, n)
    bare_times.append(t)
    _kill_raw(bare, total_cpus)
    same, same_launch = _launch_raw(RawNoop, n)
    _kill_raw(same, total_cpus)
    group_launch, raw_launch = statistics.mean(group_times), statistics.mean(bare_times)
    return {
        "call_phalanx_ms": t_call["phalanx"] * 1e3,
        "call_raw_ms": t_call["raw"] * 1e3,
        "call_ratio": t_call["phalanx"] / t_call["raw"],
        "launch_phalanx_s": group_launch,
        "launch_raw_s": raw_launch,
        "launch_same_class_s": same_launch,
        "launch_ratio": group_launch / raw_launch,
        "launch_ratio_same_class": group_launch / same_launch,
        "driver_mb_per_worker_phalanx": group_mem,
        "driver_mb_per_worker_raw": raw_mem,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,32,64", help="group sizes (default 8,32,64)")
    p.add_argument("--nodes", type=int, default=1, help="local Ray nodes (default 1)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per size and side")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    local = None
    if args.nodes > 1:
        from ray.cluster_utils import Cluster as LocalNodes

        per_node = -(-max(sizes) // args.nodes) + 1
        local = LocalNodes(
            initialize_head=True, head_node_args={"num_cpus": per_node, "include_dashboard": False}
        )
        for _ in range(args.nodes - 1):
            local.add_node(num_cpus=per_node)
        local.wait_for_nodes()
        cluster = px.Cluster(num_nodes=args.nodes, address=local.address)
    else:
        # a fresh local Ray even if a `ray start` cluster runs on this machine
        for attempt in (1, 2):  # Ray gives its raylet a fixed 30 s; a loaded machine may need more
            try:
                ray.init(address="local", num_cpus=max(sizes) + 4, include_dashboard=False)
                break
            except Exception as e:
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
                ray.shutdown()
        cluster = px.Cluster()
    where = f"{args.nodes} nodes" if args.nodes > 1 else "1 node"
    # One-time costs (exporting each actor class, Ray's first leases) land on no side.
    total_cpus = ray.cluster_resources().get("CPU", 0.0)
    for cls in (RawNoop, BareActor):
        _kill_raw(_launch_raw(cls, 2)[0], total_cpus)
    _launch_group(cluster, 2, "bench_fanout_warmup")[0].shutdown()
    _wait_cpus_free(total_cpus)
    rows = []
    for n in sizes:
        r = bench_size(cluster, n, args.repeats)
        rows.append((n, r))
        print(
            f"[{where}] {n:3d} workers: RATIO call {r['call_ratio']:.3f}x (goal <= 1.10x; "
            f"phalanx {r['call_phalanx_ms']:.2f} ms, raw Ray {r['call_raw_ms']:.2f} ms) | RATIO "
            f"launch {r['launch_ratio']:.2f}x (goal <= 1.2x; phalanx {r['launch_phalanx_s']:.2f} s, "
            f"bare raw actors {r['launch_raw_s']:.2f} s; the worker class as plain Ray actors "
            f"{r['launch_same_class_s']:.2f} s: {r['launch_ratio_same_class']:.2f}x) | driver RSS "
            f"per worker phalanx {r['driver_mb_per_worker_phalanx']:.2f} MB, raw "
            f"{r['driver_mb_per_worker_raw']:.2f} MB",
            flush=True,
        )
    if len(rows) > 1:
        (n0, r0), (n1, r1) = rows[0], rows[-1]
        grow = n1 / n0
        for key, label in (
            ("call_phalanx_ms", "phalanx call"),
            ("call_raw_ms", "raw Ray call"),
            ("launch_phalanx_s", "phalanx launch"),
            ("launch_raw_s", "raw launch"),
        ):
            print(
                f"[{where}] {label}: {r1[key] / r0[key]:.2f}x the time for {grow:.0f}x the workers "
                f"({n0} -> {n1})"
            )
        print(
            f"[{where}] worst call ratio {max(r['call_ratio'] for _, r in rows):.3f}x, worst launch "
            f"ratio {max(r['launch_ratio'] for _, r in rows):.2f}x, median call ratio "
            f"{statistics.median(r['call_ratio'] for _, r in rows):.3f}x"
        )
    ray.shutdown()
    if local is not None:
        local.shutdown()


if __name__ == "__main__":
    main()
