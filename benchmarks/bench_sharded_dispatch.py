"""Sharded dispatch of a 64 MB BatchedDataDict to 4 dp workers vs hand-written
per-shard ``ray.put`` + call. Goal: ratio <= 1.2."""

from __future__ import annotations

import ray
import torch
from _common import interleaved, report

import phalanx as px


class Shard(px.Worker):
    def consume(self, data):
        return int(data["x"].shape[0])


@ray.remote(num_cpus=1)
class RawActor:
    def consume(self, data):
        return int(data["x"].shape[0])


def main() -> None:
    px.Cluster(num_cpus=32)
    vc = px.RayVirtualCluster([4], use_gpus=False)
    group = px.RayWorkerGroup(vc, px.RayWorkerBuilder(Shard), name_prefix="bench_shard")
    actors = [RawActor.remote() for _ in range(4)]
    batch = px.BatchedDataDict({"x": torch.randn(4096, 4096)})  # 64 MB of fp32
    shards = batch.shard_by_batch_size(4)

    def ours():
        fut = group.run_all_workers_sharded_data("consume", data=shards, in_sharded_axes=["dp"])
        return fut.get_results(group)

    def raw():
        refs = [ray.put(s) for s in shards]
        return ray.get([a.consume.remote(r) for a, r in zip(actors, refs)])

    assert ours() == raw() == [1024] * 4
    t = interleaved({"phalanx": ours, "raw": raw}, repeats=15, warmup=2)
    report("sharded dispatch, 64 MB to 4 dp workers", t["phalanx"], t["raw"], "(goal <= 1.2x)")
    group.shutdown()
    vc.shutdown()


if __name__ == "__main__":
    main()
