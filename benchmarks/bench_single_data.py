"""``run_all_workers_single_data`` with a 64 MB payload to 8 workers vs passing the
object to each call (Ray serializes it once per call). Reports the ratio."""

from __future__ import annotations

import numpy as np
import ray
from _common import interleaved, report

import phalanx as px


class Sink(px.Worker):
    def consume(self, payload):
        return int(payload.nbytes)


def main() -> None:
    px.Cluster(num_cpus=32)
    vc = px.RayVirtualCluster([8], use_gpus=False)
    group = px.RayWorkerGroup(vc, px.RayWorkerBuilder(Sink), name_prefix="bench_single")
    payload = np.random.default_rng(0).standard_normal(8 * 1024 * 1024)  # 64 MB
    actors = group.actors

    def ours():
        return ray.get(group.run_all_workers_single_data("consume", payload=payload))

    def per_call():
        return ray.get([a._px_call.remote("consume", payload=payload) for a in actors])

    assert ours() == per_call() == [payload.nbytes] * 8
    t = interleaved({"phalanx": ours, "per_call": per_call}, repeats=10, warmup=2)
    report(
        "single data, 64 MB to 8 workers (object put once vs per call)", t["phalanx"], t["per_call"]
    )
    group.shutdown()
    vc.shutdown()


if __name__ == "__main__":
    main()
