"""Fault tolerance: recovery time after ``kill -9`` and the cost of health tracking.

1. Time from ``kill -9`` of a worker's process to that worker healthy again with its
   state restored (``set_state``), default ``RestartPolicy()``. Goal: under 5 s.
2. No-op fan-out to 8 workers: a group with health tracking (default policy, the health
   monitor watching every worker) against calls to the same kind of worker actors
   collected without any fault handling (a plain ``Collector``: no health check before
   dispatch, no suspect marking), and against raw Ray. Goal: under 5% over the baseline.
3. ``--env-runners``: where the time of an env runner's restart goes (PPO's runners:
   CartPole, restarts on, weights synced): kill -> death seen by the health monitor ->
   restart started -> new process up -> env built (``__init__`` running: imports done)
   -> runner healthy with state and weights restored -> back in service at the next
   probe. Compared with a plain ``ray.remote`` actor of the same host process started
   on an idle node (``actor start`` baseline), as a ratio. Then the same kills on a Ray
   whose worker processes preload torch and gymnasium (``_system_config=
   {"preload_python_modules": ...}``, as ``phalanx train ppo`` starts its Ray): the
   ratio of the two restart times. Last, kill -> back in service with a hot standby
   runner (``num_standby_env_runners=1``: a pre-started runner takes over the killed
   runner's id, state and weights) against the cold restart, in one run (``--standby``
   runs only that).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

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


def _timed_cartpole(ctx):
    """CartPole whose remote runner notes when its env is built (inside ``__init__``)."""
    import gymnasium as gym

    if getattr(ctx, "remote", False) and getattr(ctx, "vector_index", 0) == 0:
        out = Path(ctx["stamps"]) / f"{os.getpid()}"
        if not out.exists():
            out.write_text(repr(time.time()))
    return gym.make("CartPole-v1")


@ray.remote(num_cpus=0)
class _Bare:
    def ready(self) -> int:
        return os.getpid()


def env_runner_restarts(cluster: px.Cluster, rounds: int = 5) -> float:
    import psutil

    from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig
    from phalanx.envs.policy import ActorCritic

    stamps = tempfile.mkdtemp(prefix="px_stamps_")
    cfg = EnvRunnerGroupConfig(env_config={"stamps": stamps}, num_envs_per_env_runner=1, seed=0)
    g = EnvRunnerGroup(
        env_creator=_timed_cartpole,
        config=cfg,
        num_env_runners=2,
        local_env_runner=False,
        cluster=cluster,
        name="bench_env_restart",
    )
    learner = ActorCritic(*g.get_spaces()["__env__"])
    g.sync_weights(from_worker_or_learner_group=learner, timeout_seconds=None)
    rg = g.remote_group
    phases: dict[str, list[float]] = {}

    def note(name: str, dt: float) -> None:
        phases.setdefault(name, []).append(dt)

    for i in range(rounds):
        g.sample(num_timesteps=8)
        n_events = len(rg.health_events())
        pid = rg.worker_metadata[0]["pid"]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        back: list[int] = []
        deadline = time.monotonic() + 300
        while 1 not in back and time.monotonic() < deadline:
            back += g.probe_unhealthy_env_runners()
        t_back = time.time()
        if 1 not in back:
            raise RuntimeError(f"round {i}: runner 1 not back: {rg.health_events()[-3:]}")
        ev = rg.health_events()[n_events:]
        t_seen = next(e.time for e in ev if e.new == px.WorkerHealth.UNHEALTHY)
        t_restart = next(e.time for e in ev if e.new == px.WorkerHealth.RESTARTING)
        t_healthy = next(e.time for e in ev if e.new == px.WorkerHealth.HEALTHY)
        new_pid = rg.worker_metadata[0]["pid"]
        t_proc = psutil.Process(new_pid).create_time()
        t_env = float((Path(stamps) / str(new_pid)).read_text())
        note("kill -> death seen", t_seen - t_kill)
        note("death seen -> restart started", t_restart - t_seen)
        note("restart started -> process up", max(0.0, t_proc - t_restart))
        note("process up -> env built (imports, init)", t_env - max(t_proc, t_restart))
        note("env built -> healthy (init end, restore)", t_healthy - t_env)
        note("healthy -> back in service (probe)", t_back - t_healthy)
        note("total", t_back - t_kill)
    g.stop()
    print("env runner restart, median over", rounds, "kills (wall s):")
    for name, ts in phases.items():
        print(f"  {name}: {statistics.median(ts):.3f} (max {max(ts):.3f})")
    # Baseline: a bare actor (no phalanx, no torch or gymnasium import) started on the node.
    starts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        a = _Bare.remote()
        ray.get(a.ready.remote())
        starts.append(time.perf_counter() - t0)
        ray.kill(a)
    total = statistics.median(phases["total"])
    base = statistics.median(starts)
    print(
        f"env runner restart (kill -> back in service) vs bare Ray actor start: "
        f"phalanx {total:.3f} s, baseline {base:.3f} s, RATIO {total / base:.2f}x"
    )
    return total


PRELOAD = ["torch", "gymnasium"]


def env_runner_preload(rounds: int) -> None:
    """Restart time on a Ray without and with torch/gymnasium preloaded in its workers."""
    totals = {}
    for label, system_config in (("plain", {}), ("preload", {"preload_python_modules": PRELOAD})):
        if ray.is_initialized():
            ray.shutdown()
        print(f"--- Ray workers: {label}")
        cluster = px.Cluster(num_cpus=8, _system_config=system_config)
        totals[label] = env_runner_restarts(cluster, rounds)
        ray.shutdown()
    print(
        f"env runner restart, preloaded Ray workers vs plain: {totals['preload']:.3f} s vs "
        f"{totals['plain']:.3f} s, RATIO {totals['preload'] / totals['plain']:.2f}x"
    )


def _kill_to_service(g, rounds: int) -> list[float]:
    """Kill the process serving runner 1, ``rounds`` times: seconds until a probe that
    waits for nothing (as every ``sample`` round does) reports runner 1 back."""
    out = []
    for i in range(rounds):
        g.sample(num_timesteps=8)
        pid = g.foreach_env_runner(lambda w: os.getpid(), remote_worker_ids=[1])[0]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        back: list[int] = []
        deadline = time.monotonic() + 300
        while 1 not in back and time.monotonic() < deadline:
            back += g.probe_unhealthy_workers(timeout_seconds=1e-3)
            time.sleep(0.005)  # poll, do not spin: the cores are the runners' and Ray's
        if 1 not in back:
            raise RuntimeError(f"round {i}: runner 1 not back in service")
        out.append(time.perf_counter() - t0)
        deadline = time.monotonic() + 300  # every runner and standby up before the next kill
        while time.monotonic() < deadline and (
            g.num_healthy_remote_env_runners() < 2
            or g.num_healthy_standby_env_runners() < g.num_standby_env_runners()
        ):
            g.probe_unhealthy_workers(timeout_seconds=1.0)
    return out


def env_runner_standby(rounds: int) -> None:
    """Kill -> back in service with a hot standby runner vs a cold restart, one Ray."""
    from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig

    if ray.is_initialized():
        ray.shutdown()
    cluster = px.Cluster(num_cpus=8)
    res = {}
    for standby in (0, 1):
        cfg = EnvRunnerGroupConfig(
            env="CartPole-v1", num_envs_per_env_runner=1, seed=0, num_standby_env_runners=standby
        )
        g = EnvRunnerGroup(
            config=cfg, num_env_runners=2, local_env_runner=False, cluster=cluster,
            name=f"bench_standby_{standby}",
        )  # fmt: skip
        g.sync_weights(from_worker_or_learner_group=g.foreach_env_runner("get_weights")[0],
                       timeout_seconds=None)  # fmt: skip
        res[standby] = _kill_to_service(g, rounds)
        g.stop()
    cold, hot = statistics.median(res[0]), statistics.median(res[1])
    print(f"env runner kill -> back in service, median of {rounds}: cold restart {cold:.3f} s "
          f"(max {max(res[0]):.3f}), hot standby {hot:.3f} s (max {max(res[1]):.3f}); "
          f"RATIO standby / cold {hot / cold:.3f}x (goal: standby <= 1 s)")  # fmt: skip
    ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env-runners", action="store_true", help="only the env runner breakdown")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--standby", action="store_true",
                    help="only hot standby vs cold restart of an env runner")  # fmt: skip
    args = ap.parse_args()
    if args.standby:
        env_runner_standby(args.rounds)
        return
    if not args.env_runners:
        cluster = px.Cluster(num_cpus=32)
        recovery(cluster)
        overhead(cluster)
    env_runner_preload(args.rounds)
    env_runner_standby(args.rounds)


if __name__ == "__main__":
    main()
