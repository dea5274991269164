"""p2p benchmark: phalanx send/recv vs raw torch.distributed gloo and vs a plain Ray call.

1. A 64 MB CPU tensor bounced between two workers on one node: phalanx ``send``/``recv``
   (shared-memory path, and with shared memory off: the gloo path) against raw
   ``ProcessGroupGloo.send``/``recv`` into preallocated buffers between the same two
   processes. Bandwidth = bytes / one-way time (half a round trip).
2. Round-trip latency of a ~1 KB object: ``send`` then ``recv`` of the echo, against a
   plain Ray actor call to the other worker that returns its argument.

Run: ``python benchmarks/bench_p2p.py`` (``--small``: only the small round trip, repeated
``--repeats`` times interleaved with the Ray call, medians; for before/after comparisons).
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch

import phalanx as px

MB = 1 << 20
SIZE = 64 * MB
ROUNDS = 12
REPEATS = 3
SMALL_ROUNDS = 300


class Bench(px.Worker):
    def set_shm(self, on: bool):
        from phalanx.comm import configure

        configure(use_shm=on)
        return on

    def echo_loop(self, peer_group, n):
        for _ in range(n):
            self.send(self.recv(peer_group, 0), peer_group, 0)
        return n

    def echo_tensor_loop(self, peer_group, n, nbytes):
        buf = torch.empty(nbytes // 4)
        for _ in range(n):
            self.send_tensor(self.recv_tensor(buf, peer_group, 0), peer_group, 0)
        return n

    def bounce_tensor(self, peer_group, n, nbytes):
        t = torch.ones(nbytes // 4)
        t0 = None
        for i in range(n):
            if i == 1:
                t0 = time.perf_counter()
            self.send_tensor(t, peer_group, 0)
            self.recv_tensor(t, peer_group, 0)
        return (time.perf_counter() - t0) / (2 * (n - 1))

    def bounce(self, peer_group, n, nbytes):
        t = torch.ones(nbytes // 4)
        self.send(t, peer_group, 0)  # warm-up (connection, first segment)
        self.recv(peer_group, 0)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            self.send(t, peer_group, 0)
            t = self.recv(peer_group, 0)
        return (time.perf_counter() - t0) / (2 * (n - 1))

    def gloo_pg(self, members):
        from phalanx.comm.collective import get_group

        self._pg = get_group(members, backend="gloo", tag="bench").pg
        return True

    def gloo_bounce(self, rank, n, nbytes):
        t = torch.ones(nbytes // 4)
        other = 1 - rank
        t0 = None
        for i in range(n):
            if i == 1:
                t0 = time.perf_counter()
            if rank == 0:
                self._pg.send([t], other, 0).wait()
                self._pg.recv([t], other, 0).wait()
            else:
                self._pg.recv([t], other, 0).wait()
                self._pg.send([t], other, 0).wait()
        return (time.perf_counter() - t0) / (2 * (n - 1))

    def small_rtt(self, peer_group, n):
        obj = {"step": 1, "payload": b"x" * 900}
        self.send(obj, peer_group, 0)
        self.recv(peer_group, 0)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            self.send(obj, peer_group, 0)
            self.recv(peer_group, 0)
        return (time.perf_counter() - t0) / (n - 1)

    def ray_rtt(self, peer_actor_name, n):
        actor = ray.get_actor(peer_actor_name, namespace="phalanx")
        obj = {"step": 1, "payload": b"x" * 900}
        ray.get(actor._px_call.remote("echo", obj))
        t0 = time.perf_counter()
        for _ in range(n - 1):
            ray.get(actor._px_call.remote("echo", obj))
        return (time.perf_counter() - t0) / (n - 1)

    def echo(self, obj):
        return obj


def small_only(a, b, repeats: int) -> None:
    """Only the ~1 KB round trip, interleaved with the Ray call; medians of ``repeats``."""
    p2p, ray_call = [], []
    for _ in range(repeats):
        hb = b.echo_loop("bench_a", SMALL_ROUNDS)
        p2p.append(a.small_rtt("bench_b", SMALL_ROUNDS).wait(timeout=300)[0])
        hb.wait(timeout=60)
        ray_call.append(a.ray_rtt("bench_b:0", SMALL_ROUNDS).wait(timeout=300)[0])
    p2p_rtt, ray_rtt = statistics.median(p2p), statistics.median(ray_call)
    print(f"~1 KB object round trip (us, median of {repeats} x {SMALL_ROUNDS} rounds)")
    print(f"  plain Ray actor call                 : {ray_rtt * 1e6:8.0f}")
    print(f"  phalanx send + recv of the echo      : {p2p_rtt * 1e6:8.0f}")
    print(f"  all p2p runs (us): {[round(x * 1e6) for x in p2p]}")
    print(f"RATIO small round trip, Ray call / p2p:    {ray_rtt / p2p_rtt:.2f}x (report)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="only the small round trip")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of --small")
    args = parser.parse_args()
    cluster = px.Cluster(num_cpus=8)
    a = Bench.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="bench_a")
    b = Bench.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="bench_b")
    if args.small:
        small_only(a, b, args.repeats)
        a.shutdown()
        b.shutdown()
        return

    def phalanx_bw(shm: bool) -> float:
        a.set_shm(shm).wait()
        b.set_shm(shm).wait()
        hb = b.echo_loop("bench_a", ROUNDS)
        one_way = a.bounce("bench_b", ROUNDS, SIZE).wait(timeout=300)[0]
        hb.wait(timeout=60)
        return SIZE / one_way / MB

    members = ["bench_a:0", "bench_b:0"]
    ha, hb = a.gloo_pg(members), b.gloo_pg(members)
    ha.wait(timeout=120), hb.wait(timeout=120)

    def gloo_bw() -> float:
        hb = b.gloo_bounce(1, ROUNDS, SIZE)
        one_way = a.gloo_bounce(0, ROUNDS, SIZE).wait(timeout=300)[0]
        hb.wait(timeout=60)
        return SIZE / one_way / MB

    def inplace_bw() -> float:
        a.set_shm(True).wait()
        b.set_shm(True).wait()
        hb = b.echo_tensor_loop("bench_a", ROUNDS, SIZE)
        one_way = a.bounce_tensor("bench_b", ROUNDS, SIZE).wait(timeout=300)[0]
        hb.wait(timeout=60)
        return SIZE / one_way / MB

    # Interleaved repeats, medians: the machine is noisy and every ratio should compare
    # measurements taken under the same conditions.
    runs: dict[str, list[float]] = {"gloo": [], "shm": [], "sock": [], "inplace": []}
    for _ in range(REPEATS):
        runs["gloo"].append(gloo_bw())
        runs["shm"].append(phalanx_bw(True))
        runs["inplace"].append(inplace_bw())
        runs["sock"].append(phalanx_bw(False))
    gloo, shm, sock, inplace = (
        statistics.median(runs[k]) for k in ("gloo", "shm", "sock", "inplace")
    )

    hb = b.echo_loop("bench_a", SMALL_ROUNDS)
    p2p_rtt = a.small_rtt("bench_b", SMALL_ROUNDS).wait(timeout=300)[0]
    hb.wait(timeout=60)
    ray_rtt = a.ray_rtt("bench_b:0", SMALL_ROUNDS).wait(timeout=300)[0]

    print(f"64 MB CPU tensor, worker -> worker, same node (MB/s one way, median of {REPEATS})")
    print(f"  raw torch.distributed gloo send/recv : {gloo:8.0f}")
    print(f"  phalanx send/recv, shared memory     : {shm:8.0f}")
    print(f"  phalanx send/recv, shm off (gloo)    : {sock:8.0f}")
    print(f"  phalanx send_tensor/recv_tensor, shm : {inplace:8.0f}")
    print("~1 KB object round trip between the same two workers (us)")
    print(f"  plain Ray actor call                 : {ray_rtt * 1e6:8.0f}")
    print(f"  phalanx send + recv of the echo      : {p2p_rtt * 1e6:8.0f}")
    print()
    print(f"RATIO send/recv shared memory vs raw gloo: {shm / gloo:.2f}x (goal >= 1x)")
    print(f"RATIO send/recv gloo path vs raw gloo:     {sock / gloo:.2f}x (goal >= 0.9x)")
    print(f"RATIO send_tensor/recv_tensor vs raw gloo: {inplace / gloo:.2f}x")
    print(f"RATIO small round trip, Ray call / p2p:    {ray_rtt / p2p_rtt:.2f}x (report)")
    a.shutdown()
    b.shutdown()


if __name__ == "__main__":
    main()
