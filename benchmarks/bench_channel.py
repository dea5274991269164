"""Channel throughput vs ``ray.util.queue.Queue``, producer worker -> consumer worker.

10 000 small items (a dict with an int), then 200 tensors of 4 MB. Each run times from
the start of both workers until the consumer has every item.

Run: ``python benchmarks/bench_channel.py``
"""

from __future__ import annotations

import time

import torch
from ray.util.queue import Queue

import phalanx as px

SMALL = 10_000
BIG = 200
BIG_NUMEL = (4 << 20) // 4


class Producer(px.Worker):
    def produce(self, q, n, big):
        item = torch.ones(BIG_NUMEL) if big else None
        for i in range(n):
            q.put(item if big else {"i": i})
        return n


class Consumer(px.Worker):
    def consume(self, q, n):
        t0 = time.perf_counter()
        last = None
        for _ in range(n):
            last = q.get()
        assert last is not None
        return time.perf_counter() - t0


def run(prod, cons, q, n, big) -> float:
    t0 = time.perf_counter()
    hc = cons.consume(q, n)
    hp = prod.produce(q, n, big)
    hc.wait(timeout=600)
    hp.wait(timeout=600)
    return time.perf_counter() - t0


def main() -> None:
    cluster = px.Cluster(num_cpus=8)
    prod = Producer.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name="bench_prod"
    )
    cons = Consumer.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name="bench_cons"
    )
    ch = px.create_channel("bench_channel")
    rq = Queue()
    run(prod, cons, ch, 100, False)  # warm-up: connections
    run(prod, cons, rq, 100, False)
    for label, n, big in (("10 000 small items", SMALL, False), ("200 x 4 MB tensors", BIG, True)):
        t_ch = run(prod, cons, ch, n, big)
        t_rq = run(prod, cons, rq, n, big)
        print(f"{label}:")
        print(f"  ray.util.queue.Queue : {t_rq:7.2f} s  ({n / t_rq:8.0f} items/s)")
        print(
            f"  phalanx channel      : {t_ch:7.2f} s  ({n / t_ch:8.0f} items/s)   speed-up {t_rq / t_ch:.2f}x"
        )
    ch.close()
    prod.shutdown()
    cons.shutdown()


if __name__ == "__main__":
    main()
