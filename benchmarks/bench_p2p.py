"""p2p benchmark: phalanx send/recv vs raw torch.distributed gloo and vs a plain Ray call.

1. A 64 MB CPU tensor bounced between two workers on one node: phalanx ``send``/``recv``
   (shared-memory path, and with shared memory off: the gloo path) against raw
   ``ProcessGroupGloo.send``/``recv`` into preallocated buffers between the same two
   processes. Bandwidth = bytes / one-way time (half a round trip).
2. Round-trip latency of a ~1 KB object: ``send`` then ``recv`` of the echo, against a
   plain Ray actor call to the other worker that returns its argument.

3. ``--preauth``: the small round trip of this tree against the same code before its
   sockets were authenticated (commit ``0b954ff``, ``--baseline-ref``), in one run. That
   commit is extracted with ``git archive`` to a temporary folder; one child process per
   tree (``PYTHONPATH`` and working directory set to that tree, its own embedded Ray, two
   workers that ping-pong through the public ``Worker.send``/``recv``, which both trees
   have) answers "measure" requests, alternated A/B/A/B ``--repeats`` times. Each request
   times ``--rounds`` round trips one by one; the pooled rounds give median and p90 per
   tree, and the RATIO line is current / pre-auth (goal <= 1.10x).

Run: ``python benchmarks/bench_p2p.py`` (``--small``: only the small round trip, repeated
``--repeats`` times interleaved with the Ray call, medians; ``--preauth``: see 3.).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

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

    def small_rtt_rounds(self, peer_group, n):
        """Seconds of each of ``n`` round trips of a ~1 KB object (after one warm-up)."""
        obj = {"step": 1, "payload": b"x" * 900}
        self.send(obj, peer_group, 0)
        self.recv(peer_group, 0)
        out = []
        clock = time.perf_counter
        for _ in range(n - 1):
            t0 = clock()
            self.send(obj, peer_group, 0)
            self.recv(peer_group, 0)
            out.append(clock() - t0)
        return out

    def phalanx_file(self):
        import phalanx

        return phalanx.__file__

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


PREAUTH_REF = "0b954ff"
_TAG = "@@px "  # marks the protocol lines of a child's stdout (Ray may print there too)


def _child(rounds: int) -> None:
    """One tree's side of ``--preauth``: measure on each ``run`` line read from stdin."""
    cluster = px.Cluster(num_cpus=4)
    a = Bench.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="bench_a")
    b = Bench.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="bench_b")

    def measure() -> list[float]:
        hb = b.echo_loop("bench_a", rounds)
        out = a.small_rtt_rounds("bench_b", rounds).wait(timeout=300)[0]
        hb.wait(timeout=60)
        return out

    where = a.phalanx_file().wait(timeout=60)[0]
    measure()  # connections, handshakes, first allocations
    print(_TAG + json.dumps({"ready": where}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(_TAG + json.dumps({"rounds": measure()}), flush=True)
    a.shutdown()
    b.shutdown()


def _materialise(repo: Path, ref: str) -> Path:
    """The ``phalanx/`` package of commit ``ref``, extracted once under the temp folder."""
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dest = Path(tempfile.gettempdir()) / f"px_preauth_{sha[:12]}"
    if (dest / "phalanx" / "__init__.py").exists():
        return dest
    tar = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", sha, "phalanx"],
        check=True,
        capture_output=True,
    ).stdout
    staging = Path(tempfile.mkdtemp(prefix="px_preauth_", dir=tempfile.gettempdir()))
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(staging, filter="data")
    try:
        staging.rename(dest)
    except OSError:  # another run extracted it meanwhile
        pass
    return dest


class _Tree:
    """A child process measuring with the phalanx package found in ``root``."""

    def __init__(self, label: str, root: Path, rounds: int):
        self.label = label
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            "w+", prefix="px_bench_child_", suffix=".log", delete=False
        )
        env = {**os.environ, "PYTHONPATH": str(root)}
        env.pop("RAY_ADDRESS", None)
        # Ray puts the driver's working directory on its workers' sys.path: run in ``root``.
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--_child", "--rounds", str(rounds)],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.rounds: list[float] = []
        self.medians: list[float] = []
        self.where = self._reply()["ready"]
        if not Path(self.where).resolve().is_relative_to(root.resolve()):
            raise RuntimeError(f"{label}: workers imported {self.where}, not the tree at {root}")

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                return json.loads(line[len(_TAG) :])
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        raise RuntimeError(f"{self.label}: child exited ({self.proc.wait()}); its log:\n{tail}")

    def measure(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        rounds = self._reply()["rounds"]
        self.rounds.extend(rounds)
        self.medians.append(statistics.median(rounds))

    def close(self) -> None:
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def compare_preauth(ref: str, repeats: int, rounds: int) -> None:
    """Small round trip: this tree vs commit ``ref``, in alternating child processes."""
    repo = Path(__file__).resolve().parents[1]
    old = _materialise(repo, ref)
    cur = _Tree("current", repo, rounds)
    try:
        pre = _Tree(f"pre-auth {ref}", old, rounds)
    except BaseException:
        cur.close()
        raise
    try:
        for i in range(repeats):
            for t in (cur, pre) if i % 2 == 0 else (pre, cur):
                t.measure()
    finally:
        cur.close()
        pre.close()
    print(f"~1 KB object round trip, Worker.send + recv of the echo ({repeats} x {rounds} rounds)")
    for t in (cur, pre):
        print(
            f"  {t.label:<20} median {statistics.median(t.rounds) * 1e6:7.1f} us, "
            f"p90 {_p90(t.rounds) * 1e6:7.1f} us  ({t.where})"
        )
        print(f"    per-repeat medians (us): {[round(m * 1e6, 1) for m in t.medians]}")
    med = statistics.median(cur.rounds) / statistics.median(pre.rounds)
    p90 = _p90(cur.rounds) / _p90(pre.rounds)
    rep = statistics.median(cur.medians) / statistics.median(pre.medians)
    print(f"RATIO small round trip median, current / pre-auth: {med:.3f}x (goal <= 1.10x)")
    print(f"RATIO small round trip p90, current / pre-auth:    {p90:.3f}x (report)")
    print(f"RATIO median of per-repeat medians:                {rep:.3f}x (report)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="only the small round trip")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of --small/--preauth")
    parser.add_argument(
        "--preauth", action="store_true", help="small round trip: this tree vs pre-auth"
    )
    parser.add_argument("--baseline-ref", default=PREAUTH_REF, help="commit for --preauth")
    parser.add_argument("--rounds", type=int, default=SMALL_ROUNDS, help="rounds per repeat")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        _child(args.rounds)
        return
    if args.preauth:
        compare_preauth(args.baseline_ref, args.repeats, args.rounds)
        return
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
