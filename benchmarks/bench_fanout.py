"""No-op call fanned out to 8 workers: phalanx group vs raw Ray actor calls.

Goal: ratio <= 1.15 (phalanx time / raw Ray time).
"""

from __future__ import annotations

import ray
from _common import interleaved, report

import phalanx as px


class Noop(px.Worker):
    def noop(self):
        return None


@ray.remote(num_cpus=1)
class RawActor:
    def noop(self):
        return None


def main() -> None:
    cluster = px.Cluster(num_cpus=32)
    group = Noop.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=8), name="bench_fanout"
    )
    actors = [RawActor.remote() for _ in range(8)]
    ray.get([a.noop.remote() for a in actors])
    t = interleaved(
        {
            "phalanx": lambda: group.noop().wait(),
            "raw": lambda: ray.get([a.noop.remote() for a in actors]),
        },
        repeats=400,
        warmup=20,
    )
    report("no-op fan-out to 8 workers", t["phalanx"], t["raw"], "(goal <= 1.15x)")
    group.shutdown()


if __name__ == "__main__":
    main()
