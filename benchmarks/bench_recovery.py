"""Fault tolerance: recovery time after ``kill -9`` and the cost of health tracking.

1. Time from ``kill -9`` of a worker's process to that worker healthy again with its
   state restored (``set_state``), default ``RestartPolicy()``. Goal: under 5 s.
2. No-op fan-out to 8 workers: a group with health tracking (default policy, the health
   monitor watching every worker) against calls to the same kind of worker actors
   collected without any fault handling (a plain ``Collector``: no health check before
   dispatch, no suspect marking), and against raw Ray. Goal: under 5% over the baseline.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import ray
from _common import interleaved, report

import phalanx as px
from phalanx.group.collect import Collector


class Stateful(px.Worker):
    def __init__(self):
        super().__init__()
        self.value = 0

    def noop(self):
        return None

    def add(self, k):
        self.value += k
        return self.value

    def get_state(self):
        return {"value": self.value}

    def set_state(self, state):
        self.value = state["value"]

    def get_value(self):
        return self.value


@ray.remote(num_cpus=1)
class RawActor:
    def noop(self):
        return None


def _wait_back(g: px.WorkerGroup, restarts_before: int, timeout: float = 60.0) -> float | None:
    """Wait until one more restart finished and every worker is healthy; returns the wall
    time the rank turned healthy (from the health event), or None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            g.num_remote_worker_restarts() > restarts_before
            and g.num_healthy_workers() == g.world_size
        ):
            back = [e for e in g.health_events() if e.new == px.WorkerHealth.HEALTHY]
            return back[-1].time
        time.sleep(0.002)
    return None


def recovery(cluster: px.Cluster, rounds: int = 5) -> None:
    g = Stateful.create_group().launch(
        cluster,
        placement=px.NodePlacement(num_workers=2),
        name="bench_recovery",
        restart_policy=px.RestartPolicy(),
    )
    times, detect = [], []
    for i in range(rounds):
        g.add(1).wait()
        g.get_state().wait()  # the group keeps the state it saw
        before = g.num_remote_worker_restarts()
        n_events = len(g.health_events())
        pid = g.worker_metadata[1]["pid"]
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        t1 = _wait_back(g, before)
        if t1 is None:
            raise RuntimeError(f"round {i}: worker not back after 60 s: {g.health_events()[-3:]}")
        assert g.execute_on(1).get_value().wait() == [i + 1], "state not restored"
        times.append(t1 - t0)
        detect.append(g.health_events()[n_events].time - t0)
    g.shutdown()
    print(
        f"kill -9 -> healthy with state restored: median {statistics.median(times):.2f} s, "
        f"max {max(times):.2f} s over {rounds} kills (death seen after median "
        f"{statistics.median(detect) * 1e3:.0f} ms) (goal < 5 s)"
    )


def overhead(cluster: px.Cluster) -> None:
    tracked = Stateful.create_group().launch(
        cluster,
        placement=px.NodePlacement(num_workers=8),
        name="bench_tracked",
        restart_policy=px.RestartPolicy(),
    )
    untracked = Stateful.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=8), name="bench_untracked"
    )
    plain = Collector(None, None, name="bench_untracked")
    hosts = untracked.actors
    ranks = list(range(8))
    actors = [RawActor.remote() for _ in range(8)]
    ray.get([a.noop.remote() for a in actors])
    fns = {
        "tracked": lambda: tracked.noop().wait(),
        "untracked": lambda: plain.wait_all("noop", ranks, [a.noop.remote() for a in hosts], None),
        "raw": lambda: ray.get([a.noop.remote() for a in actors]),
    }
    # Both orders, so that whatever runs first in a round is not favoured.
    t1 = interleaved(fns, repeats=300, warmup=20)
    t2 = interleaved(dict(reversed(list(fns.items()))), repeats=300, warmup=5)
    t = {k: (t1[k] + t2[k]) / 2 for k in fns}
    report(
        "no-op fan-out to 8, health tracking vs none",
        t["tracked"],
        t["untracked"],
        "(goal < 1.05x)",
    )
    report(
        "no-op fan-out to 8, health tracking vs raw Ray",
        t["tracked"],
        t["raw"],
        "(core goal <= 1.15x)",
    )
    tracked.shutdown()
    untracked.shutdown()


def main() -> None:
    cluster = px.Cluster(num_cpus=32)
    recovery(cluster)
    overhead(cluster)


if __name__ == "__main__":
    main()
