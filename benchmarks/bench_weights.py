"""Weight sync of a 512 MB fp32 model to 4 receiver workers on one node.

Measured in one run, each against its baseline:
- the default sender (``transport="auto"``: shared memory on one node) and the object-store
  transport vs the naive way (``ray.put(model.state_dict())``, every receiver
  ``load_state_dict(ray.get(ref))``, Ray's defaults): goal >= 10x faster;
- phalanx vs the in-process floor (the same four ``param.copy_(src)`` passes in one
  process, on both cores): goal <= 2x the floor;
- the collective transport vs raw ``torch.distributed.broadcast`` of the same tensors over
  the same kind of process group: goal >= 0.9x its speed;
- read-only receivers (``read_only_weights = True``: their parameters become views of the
  sender's shared buffers, one copy per send for all of them) vs the floor: goal <= 0.5x;
  and vs TorchRL 0.14's ``RayWeightSyncScheme`` moving the same model to the same number
  of Ray actors: goal >= 6x faster. TorchRL is a benchmark extra (``pip install
  '.[bench]'``; it pins ``tensordict<0.15``, so use a separate environment, e.g. a venv made
  with ``--system-site-packages``); without it that comparison is skipped with a message.

Each sender runs alternately with its baselines (floor, and for the default also the naive
way; raw broadcast for the collective), medians of ``--repeats``. The object store is reported twice: right after one warm-up send, and in
steady state after ``--os-warmup`` more sends (see ``phalanx/weights/transports/object_store.py``).

Run: ``python benchmarks/bench_weights.py [--mb 512] [--workers 4] [--repeats 5]``.
Memory: about (3 + 2 x workers) x ``--mb`` at the peak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.pop("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", None)  # the naive baseline uses defaults

import ray  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.comm.process_group import broadcast, host_store, join_store  # noqa: E402
from phalanx.weights.transports.collective import new_process_group  # noqa: E402

WIDTH = 4096  # one 4096x4096 fp32 layer is 64 MiB


def make_model(mb: int) -> torch.nn.Module:
    layers = max(1, mb // 64)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


class BenchReceiver(px.Worker):
    def __init__(self, mb: int):
        super().__init__()
        torch.manual_seed(1)
        self.model = make_model(mb)
        self._pg = None

    def naive_load(self, box: list) -> float:
        t = time.perf_counter()
        self.model.load_state_dict(ray.get(box[0]))
        return time.perf_counter() - t

    def raw_join(self, addr: str, port: int, world: int, rank: int) -> bool:
        store = join_store(addr, port, 120, world)
        self._pg = new_process_group(store, "raw", rank, world, "gloo", 120)
        return True

    def raw_recv(self) -> bool:
        with torch.no_grad():
            works = [broadcast(self._pg, p.data) for p in self.model.parameters()]
            for w in works:
                w.wait()
        return True

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))


class BenchViewer(BenchReceiver):
    """An inference-only receiver: same-node sends make its parameters shared views."""

    read_only_weights = True


@ray.remote(num_cpus=1)
class TorchRLReceiver:
    """A plain Ray actor receiving through TorchRL's ``RayWeightSyncScheme``."""

    def __init__(self, mb: int, worker_idx: int, scheme: object):
        torch.set_num_threads(1)
        self.model = make_model(mb)
        self.worker_idx = worker_idx
        self.scheme = scheme  # the sender's scheme, shipped before init (as TorchRL does)
        self.scheme.init_on_receiver(model_id="policy", model=self.model, worker_idx=worker_idx)

    def ready(self) -> bool:
        return True

    def connect(self) -> bool:
        self.scheme.connect(worker_idx=self.worker_idx)
        return True

    def _receive_weights_scheme(self, model_version: int | None = None) -> None:
        self.scheme.receive()

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))


def torchrl_sync(model: torch.nn.Module, workers: int, mb: int):
    """A ``send()`` through TorchRL's ``RayWeightSyncScheme`` to ``workers`` actors, and a
    function that tears it down; None (with the reason printed) if TorchRL is missing."""
    try:
        import torchrl
        from tensordict import TensorDict
        from torchrl.weight_update import RayWeightSyncScheme
    except ImportError as e:
        print(f"TorchRL comparison skipped: torchrl is not installed here ({e}); install the")
        print("  'bench' extra (torchrl==0.14.1) in a separate environment to run it")
        return None
    scheme = RayWeightSyncScheme()
    actors = [TorchRLReceiver.remote(mb, i, scheme) for i in range(workers)]
    ray.get([a.ready.remote() for a in actors], timeout=600)  # started (imports are slow)
    scheme.init_on_sender(model_id="policy", remote_collectors=actors, num_workers=workers)
    joins = [a.connect.remote() for a in actors]
    scheme.connect(weights=TensorDict.from_module(model))
    ray.get(joins, timeout=600)
    print(f"torchrl {torchrl.__version__}: RayWeightSyncScheme to {workers} Ray actors")

    def send() -> None:
        scheme.send(model)

    def close() -> list[float]:
        sums = ray.get([a.checksum.remote() for a in actors], timeout=600)
        scheme.shutdown()
        for a in actors:
            ray.kill(a)
        return sums

    return send, close


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, process groups, caches
    return statistics.median(_once(fn) for _ in range(repeats))


def paired(fn, baselines: dict, repeats: int) -> float:
    """Median time of ``fn``, run in turn with each baseline (``{fn: list of its times}``,
    appended to) so that all see the same load on a shared machine."""
    fn()
    for b in baselines:
        b()
    times = []
    for _ in range(repeats):
        times.append(_once(fn))
        for b, samples in baselines.items():
            samples.append(_once(b))
    return statistics.median(times)


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--os-warmup", type=int, default=12, help="sends before the steady state")
    args = ap.parse_args()
    torch.set_num_threads(2)
    # A Ray of its own, even if another one runs on this machine.
    ray.init(
        address="local",
        num_cpus=max(12, 2 * args.workers + 4),
        namespace="phalanx",
        include_dashboard=False,
    )
    cluster = px.Cluster()
    model = make_model(args.mb)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"model: {nbytes / 2**20:.0f} MiB fp32, {args.workers} receivers, 1 node, "
        f"{os.cpu_count()} cores"
    )
    group = BenchReceiver.create_group(args.mb).launch(
        cluster, px.NodePlacement(num_workers=args.workers), name="bench_weights"
    )
    expected = float(sum(p.detach().double().sum() for p in model.parameters()))

    def check() -> None:
        sums = group.checksum().wait()
        assert all(abs(s - expected) < 1e-6 * max(1.0, abs(expected)) for s in sums), sums

    # Floor: the same copies in one process, both cores.
    srcs = [p.detach() for p in model.parameters()]
    dsts = [[torch.empty_like(s) for s in srcs] for _ in range(args.workers)]

    def floor() -> None:
        for dst in dsts:
            for d, s in zip(dst, srcs):
                d.copy_(s)

    floor_samples: list[float] = []

    # Naive: ray.put(state_dict) and load_state_dict(ray.get(ref)) on each receiver.
    def naive() -> None:
        ref = ray.put(model.state_dict())
        group.naive_load([ref]).wait(timeout=600)

    naive_samples: list[float] = []

    # Raw torch.distributed broadcast of the same tensors (driver = rank 0).
    addr = ray.util.get_node_ip_address()
    store = host_store(addr, 120)
    world = args.workers + 1
    joins = [
        group.execute_on(r).raw_join(addr, store.port, world, r + 1) for r in range(args.workers)
    ]
    pg = new_process_group(store, "raw", 0, world, "gloo", 120)
    for j in joins:
        j.wait(timeout=120)

    def raw() -> None:
        h = group.raw_recv()
        works = [broadcast(pg, s) for s in srcs]
        for w in works:
            w.wait()
        h.wait(timeout=600)

    # Each phalanx sender runs alternately with its baseline: the floor, or for the
    # collective transport the raw broadcast.
    raw_samples: list[float] = []
    results = {}
    for transport in ("auto", "object_store", "collective"):
        sender = px.WeightSender(group, model, transport=transport, bucket_size_mb=64)
        if transport == "auto":
            picked = sorted(set(sender._route(list(range(args.workers)), srcs).values()))

        def sync(sender=sender) -> None:
            r = sender.send()
            assert r.ok and len(r.applied) == args.workers, r

        if transport == "collective":
            results[transport] = paired(sync, {raw: raw_samples}, args.repeats)
        else:
            # The default also alternates with the (slow) naive way, fewer times.
            extra = {naive: naive_samples} if transport == "auto" else {}
            reps = 3 if extra else args.repeats
            results[transport] = paired(sync, {floor: floor_samples, **extra}, reps)
            check()
        if transport == "object_store":
            # Every put writes a new object; until the store has used (and so faulted in)
            # all the regions it cycles over, some sends pay page faults. Steady state:
            for _ in range(args.os_warmup):
                sync()
            results["object_store (steady)"] = paired(sync, {floor: floor_samples}, args.repeats)
            check()
        sender.close()
    check()
    group.shutdown()

    # Read-only receivers: one copy per send, vs the floor and vs TorchRL.
    viewers = BenchViewer.create_group(args.mb).launch(
        cluster, px.NodePlacement(num_workers=args.workers), name="bench_weights_view"
    )
    view_sender = px.WeightSender(viewers, model, bucket_size_mb=64)
    view_routes: set[str] = set()

    def view_sync() -> None:
        r = view_sender.send()
        assert r.ok and len(r.applied) == args.workers, r
        view_routes.update(r.routes.values())

    # Each send alternates with the floor and, when TorchRL is here, with its send.
    t_torchrl = None
    trl = torchrl_sync(model, args.workers, args.mb)
    trl_samples: list[float] = []
    baselines = {floor: floor_samples}
    if trl is not None:
        baselines[trl[0]] = trl_samples
    results["read-only (shm_view)"] = paired(view_sync, baselines, args.repeats)
    sums = viewers.checksum().wait()
    assert all(abs(s - expected) < 1e-6 * max(1.0, abs(expected)) for s in sums), sums
    if trl is not None:
        t_torchrl = statistics.median(trl_samples)
        sums = trl[1]()
        assert all(abs(s - expected) < 1e-6 * max(1.0, abs(expected)) for s in sums), sums
    view_sender.close()
    viewers.shutdown()

    t_floor = statistics.median(floor_samples)
    t_raw = statistics.median(raw_samples)
    t_naive = statistics.median(naive_samples)

    default = f"default: auto -> {'+'.join(picked)}"
    print(f"floor (4x copy_ in one process):     {t_floor:7.3f} s")
    print(f"naive (put state_dict + load):       {t_naive:7.3f} s")
    for name, t in results.items():
        print(
            f"phalanx {name:<21s}       {t:7.3f} s   "
            f"{t_naive / t:6.1f}x faster than naive, {t / t_floor:5.2f}x the floor"
        )
    print(f"raw torch.distributed.broadcast:     {t_raw:7.3f} s")
    if t_torchrl is not None:
        print(f"TorchRL RayWeightSyncScheme:         {t_torchrl:7.3f} s")
    print()
    t_auto, t_os, t_coll = results["auto"], results["object_store"], results["collective"]
    t_steady = results["object_store (steady)"]
    print(f"RATIO speedup vs naive ({default}): {t_naive / t_auto:.1f}x (goal >= 10x)")
    print(f"RATIO vs floor ({default}):          {t_auto / t_floor:.2f}x (goal <= 2x)")
    print(f"RATIO speedup vs naive (object_store):        {t_naive / t_os:.1f}x (goal >= 10x)")
    print(f"RATIO vs floor (object_store):                {t_os / t_floor:.2f}x (goal <= 2x)")
    steady = f"object_store after {args.os_warmup + 1 + args.repeats} sends"
    print(f"RATIO speedup vs naive ({steady}): {t_naive / t_steady:.1f}x (goal >= 10x)")
    print(f"RATIO vs floor ({steady}):          {t_steady / t_floor:.2f}x (goal <= 2x)")
    print(f"RATIO collective speed vs raw broadcast:      {t_raw / t_coll:.2f}x (goal >= 0.9x)")
    t_view = results["read-only (shm_view)"]
    routes = "+".join(sorted(view_routes))
    print(f"RATIO read-only receivers ({routes}) vs floor: {t_view / t_floor:.2f}x (goal <= 0.5x)")
    if t_torchrl is not None:
        print(f"RATIO read-only speedup vs TorchRL RayWeightSyncScheme: {t_torchrl / t_view:.1f}x")
        print("      (goal >= 6x)")
    else:
        print("RATIO vs TorchRL RayWeightSyncScheme: skipped (torchrl not installed)")


if __name__ == "__main__":
    main()
