"""Tracing off vs on over many group calls (4 workers).

Blocks of calls alternate between tracing off and on (so machine noise hits both alike);
each block's median per-call time is kept, and the medians of the blocks are compared.
Two workloads: a no-op call (the worst case: all overhead, no work) and a 5 ms step with
two nested ``worker_timer`` spans (closer to a training step). Also prints what the
off-path check (``trace.ON``) costs against one no-op group call.

Goal: on/off <= 1.05 for the step workload; the off-path check far below 1% of a call.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import timeit

from _common import report

import phalanx as px
from phalanx.observe import trace


class Stepper(px.Worker):
    def noop(self):
        return None

    def step(self):
        with self.worker_timer("step"), self.worker_timer("compute"):
            time.sleep(0.005)
        return 1.0


def _block(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(fn, blocks: int, per_block: int, path: str) -> tuple[float, float]:
    off, on = [], []
    for _ in range(3):
        fn()
    for _ in range(blocks):
        off.append(_block(fn, per_block))
        trace.enable(path)
        on.append(_block(fn, per_block))
        trace.disable()
        trace.reset()
    return statistics.median(on), statistics.median(off)


def main() -> None:
    cluster = px.Cluster(num_cpus=32)
    group = Stepper.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=4), name="bench_trace"
    )
    path = tempfile.mktemp(suffix=".json")
    on, off = compare(lambda: group.noop().wait(), blocks=10, per_block=100, path=path)
    report("no-op call to 4 workers, tracing on vs off", on, off, "(worst case)")
    noop_off = off
    on, off = compare(lambda: group.step().wait(), blocks=8, per_block=40, path=path)
    report("5 ms step with 2 timer spans, on vs off", on, off, "(goal <= 1.05x)")
    check = min(timeit.repeat("trace.ON", globals={"trace": trace}, number=100_000, repeat=5))
    check /= 100_000
    print(
        f"off-path cost: one trace.ON check {check * 1e9:.0f} ns per hook, "
        f"{3 * check / noop_off * 100:.4f}% of a {noop_off * 1e3:.2f} ms no-op call (3 hooks per call)"
    )
    group.shutdown()


if __name__ == "__main__":
    main()
