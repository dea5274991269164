"""Fault tally: a fixed list of faults injected into real groups on a local Ray.

Each scenario is one small function with a fixed schedule (which rank, at which point, by
which means): no random kills. It states the guarantee it checks (the README's "Fault
tolerance" section), injects the fault, and reports what it observed, how long detection
took and how long recovery took. A scenario counts as survived when the documented
guarantee held; each is bounded by ``--timeout`` seconds (a scenario that runs past it
counts as not survived). The script ends with ``faults tried N / survived M``.

    python benchmarks/fault_matrix.py [--only NAME[,NAME...]] [--timeout 150]

This is a report, not a test: the same faults with exact assertions live in
tests/group/test_fault.py, tests/comm/test_comm_liveness.py, tests/weights/,
tests/envs/test_env_runner_failures.py and tests/group/test_driver_death.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import ray

import phalanx as px

NAMESPACE = "phalanx"


# --------------------------------------------------------------------------- workers
class Flaky(px.Worker):
    """Counts its incarnations in ``<dir>/rank<r>.inits``; may die in ``__init__``."""

    def __init__(self, marks: str, die_in_init_ranks: tuple[int, ...] = ()):
        super().__init__()
        path = os.path.join(marks, f"rank{self.rank}.inits")
        with open(path, "a") as f:
            f.write("x")
        with open(path) as f:
            incarnation = len(f.read())
        if self.rank in die_in_init_ranks and incarnation == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the first incarnation dies while starting
        self.value = 0

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def get_value(self) -> int:
        return self.value

    def get_state(self) -> dict:
        return {"value": self.value}

    def set_state(self, state: dict) -> None:
        self.value = state["value"]

    def slow_signal(self, s: float, marks: str) -> int:
        with open(os.path.join(marks, f"started{self.rank}"), "w"):
            pass
        time.sleep(s)
        return self.rank

    def hang_on(self, rank: int) -> int:
        if self.rank == rank:
            self.stuck_forever()
        return self.rank

    def stuck_forever(self) -> None:
        while True:
            time.sleep(0.05)

    def exit_now(self) -> None:
        sys.exit(3)


class Node(px.Worker):
    """p2p endpoints for the liveness scenarios."""

    def recv_then_report(self, group: str, rank: int, marker: str) -> tuple:
        t0 = time.monotonic()
        work = self.recv(group, rank, async_op=True)
        with open(marker, "w") as f:
            f.write("posted")
        try:
            value = work.wait()
        except Exception as e:  # noqa: BLE001 - reported
            return type(e).__name__, str(e)[:200], time.monotonic() - t0
        return "value", repr(value), time.monotonic() - t0

    def recv_one(self, group: str, rank: int) -> Any:
        return self.recv(group, rank, timeout=60)

    def send_to(self, obj: Any, group: str, rank: int) -> tuple:
        t0 = time.monotonic()
        try:
            self.send(obj, group, rank)
        except Exception as e:  # noqa: BLE001 - reported
            return type(e).__name__, str(e)[:200], time.monotonic() - t0
        return "sent", "", time.monotonic() - t0

    def drain(self, group: str, rank: int, marker: str) -> int:
        """Receive large messages until killed; the marker says the first one arrived."""
        n = 0
        while True:
            self.recv(group, rank)
            n += 1
            if n == 1:
                with open(marker, "w") as f:
                    f.write("1")

    def send_large_until_error(self, group: str, rank: int, mb: int, rounds: int) -> tuple:
        """Send ``rounds`` messages of ``mb`` MB through gloo (shared memory off)."""
        import torch

        from phalanx.comm import configure

        configure(use_shm=False)
        t = torch.ones(mb << 18)
        done = 0
        try:
            for _ in range(rounds):
                self.send(t, group, rank)
                done += 1
        except Exception as e:  # noqa: BLE001 - reported
            return type(e).__name__, str(e)[:200], done, time.monotonic()
        return "sent all", "", done, time.monotonic()


class ModelHolder(px.Worker):
    def __init__(self) -> None:
        super().__init__()
        import torch

        torch.manual_seed(0)
        self.model = torch.nn.Linear(64, 64)

    def pid(self) -> int:
        return os.getpid()


class FaultyCartPole(gym.Wrapper):
    """CartPole whose runner ``bad`` faults once at its ``at_step``-th step (marker file)."""

    def __init__(self, ctx: Any):
        super().__init__(gym.make("CartPole-v1"))
        self.index = getattr(ctx, "worker_index", 0)
        self.ctx = dict(ctx)
        self.steps = 0

    def step(self, action: Any):
        self.steps += 1
        c = self.ctx
        if self.index == c["bad"] and self.steps == c["at_step"]:
            marker = os.path.join(c["marks"], f"faulted_{self.index}")
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                if c["mode"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError(f"scheduled env failure on runner {self.index}")
        return self.env.step(action)


def make_faulty_cartpole(ctx: Any) -> gym.Env:
    return FaultyCartPole(ctx)


# --------------------------------------------------------------------------- helpers
@dataclass
class Outcome:
    observed: str
    survived: bool
    detect_s: float | None = None
    recover_s: float | None = None


def _kill9(group: Any, rank: int) -> int:
    pid = group.worker_metadata[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _until(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _inits(marks: str, rank: int) -> int:
    path = os.path.join(marks, f"rank{rank}.inits")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.read())


class Ctx:
    """What a scenario gets: the cluster, a scratch folder, and cleanup of its groups."""

    def __init__(self, cluster: px.Cluster, name: str):
        self.cluster = cluster
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f"px_fm_{name}_")
        self.cleanup: list[Callable[[], None]] = []

    def group(self, cls: Any, n: int, *args: Any, policy: Any = None, tag: str = "") -> Any:
        g = cls.create_group(*args).launch(
            self.cluster,
            px.NodePlacement(num_workers=n),
            name=f"fm_{self.name}{tag}",
            restart_policy=policy,
        )
        self.cleanup.append(lambda: g.shutdown(force=True))
        return g

    def close(self) -> None:
        for fn in reversed(self.cleanup):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort after a failed scenario
                pass


# --------------------------------------------------------------------------- scenarios
def kill9_idle_worker(c: Ctx) -> Outcome:
    """SIGKILL an idle worker of a group with a RestartPolicy: restarted, state restored."""
    g = c.group(Flaky, 2, c.dir, policy=px.RestartPolicy())
    g.add(5).wait(timeout=60)
    g.get_state().wait(timeout=60)  # the group remembers the states it saw
    old = g.worker_metadata[1]["pid"]
    t0 = time.monotonic()
    _kill9(g, 1)
    detected = _until(lambda: g.health()[1] != px.WorkerHealth.HEALTHY, 30)
    t_detect = time.monotonic() - t0
    back = _until(lambda: g.num_remote_worker_restarts() == 1, 90) and g.wait_healthy(90)
    t_back = time.monotonic() - t0
    values = g.get_value().wait(timeout=60)
    new = g.worker_metadata[1]["pid"]
    ok = detected and back and values == [5, 5] and new != old and _inits(c.dir, 1) == 2
    return Outcome(f"restarted={back}, values={values}, new pid={new != old}", ok, t_detect, t_back)


def kill9_during_call(c: Ctx) -> Outcome:
    """SIGKILL rank 1 during a 5 s call: WorkerDiedError naming rank 1 before the call ends."""
    g = c.group(Flaky, 3, c.dir, policy=px.RestartPolicy())
    g.add(2).wait(timeout=60)
    g.get_state().wait(timeout=60)
    h = g.slow_signal(5, c.dir)
    _until(lambda: all(os.path.exists(os.path.join(c.dir, f"started{r}")) for r in range(3)), 60)
    t0 = time.monotonic()
    _kill9(g, 1)
    try:
        h.wait(timeout=60)
        err = None
    except px.WorkerDiedError as e:
        err = e
    t_detect = time.monotonic() - t0
    back = g.wait_healthy(90)
    t_back = time.monotonic() - t0
    values = g.get_value().wait(timeout=60)
    ok = err is not None and err.rank == 1 and t_detect < 5 and back and values == [2, 2, 2]
    text = f"{type(err).__name__} rank={getattr(err, 'rank', None)}" if err else "no error"
    return Outcome(f"{text}, restarted={back}, values={values}", ok, t_detect, t_back)


def kill_during_init(c: Ctx) -> Outcome:
    """Rank 1's first incarnation SIGKILLs itself in ``__init__``: launch still succeeds."""
    t0 = time.monotonic()
    g = c.group(Flaky, 2, c.dir, (1,), policy=px.RestartPolicy())
    t_launch = time.monotonic() - t0
    values = g.add(1).wait(timeout=60)
    inits = (_inits(c.dir, 0), _inits(c.dir, 1))
    ok = values == [1, 1] and inits == (1, 2) and g.healthy_worker_ids() == [0, 1]
    return Outcome(f"launched, inits per rank={inits}, add -> {values}", ok, None, t_launch)


def sys_exit_in_method(c: Ctx) -> Outcome:
    """A method calls sys.exit(3): WorkerDiedError, restart, registered state restored."""
    g = c.group(Flaky, 2, c.dir, policy=px.RestartPolicy())
    g.register_state(1, {"value": 42})
    t0 = time.monotonic()
    try:
        g.execute_on(1).exit_now().wait(timeout=60)
        err = None
    except px.WorkerDiedError as e:
        err = e
    t_detect = time.monotonic() - t0
    back = g.wait_healthy(90)
    values = g.get_value().wait(timeout=60)
    ok = err is not None and err.rank == 1 and back and values == [0, 42]
    return Outcome(
        f"{type(err).__name__ if err else 'no error'}, values={values}",
        ok,
        t_detect,
        time.monotonic() - t0,
    )


def restart_limit_exhausted(c: Ctx) -> Outcome:
    """max_restarts_per_worker=1, two kills: the rank is dead and calls say so (no hang)."""
    g = c.group(Flaky, 2, c.dir, policy=px.RestartPolicy(max_restarts_per_worker=1))
    _kill9(g, 0)
    first = _until(lambda: g.num_remote_worker_restarts() == 1, 90) and g.wait_healthy(90)
    t0 = time.monotonic()
    _kill9(g, 0)
    dead = _until(lambda: g.health()[0] == px.WorkerHealth.DEAD, 60)
    t_detect = time.monotonic() - t0
    try:
        g.add(1).wait(timeout=30)
        err = None
    except px.WorkerDiedError as e:
        err = e
    ok = first and dead and err is not None and err.rank == 0
    return Outcome(
        f"first restart={first}, dead={dead}, call -> {type(err).__name__}", ok, t_detect
    )


def recv_sender_killed(c: Ctx) -> Outcome:
    """recv(timeout=None) while the sender is SIGKILLed and restarted: PeerDiedError."""
    policy = px.RestartPolicy(max_restarts_per_worker=3)
    s = c.group(Node, 1, policy=policy, tag="_s")
    r = c.group(Node, 1, policy=policy, tag="_r")
    marker = os.path.join(c.dir, "posted")
    h = r.recv_then_report(s.name, 0, marker)
    _until(lambda: os.path.exists(marker), 60)
    t0 = time.monotonic()
    _kill9(s, 0)
    kind, message, _ = h.wait(timeout=90)[0]
    t_detect = time.monotonic() - t0
    back = _until(lambda: s.num_remote_worker_restarts() == 1, 90) and s.wait_healthy(90)
    hr = r.recv_one(s.name, 0)
    sent = s.send_to("after", r.name, 0).wait(timeout=60)[0][0]
    got = hr.wait(timeout=60)
    ok = kind == "PeerDiedError" and f"{s.name}:0" in message and back and got == ["after"]
    return Outcome(
        f"{kind} (names sender: {f'{s.name}:0' in message}); after restart {sent} -> {got}",
        ok,
        t_detect,
        time.monotonic() - t0,
    )


def receiver_killed_mid_large_send(c: Ctx) -> Outcome:
    """The receiver of a stream of 64 MB gloo sends is SIGKILLed: the sender fails fast."""
    s = c.group(Node, 1, tag="_s")
    r = c.group(Node, 1, tag="_r")
    marker = os.path.join(c.dir, "first")
    r.drain(s.name, 0, marker)
    h = s.send_large_until_error(r.name, 0, 64, 200)
    if not _until(lambda: os.path.exists(marker), 90):
        return Outcome("the first 64 MB message never arrived", False)
    t0 = time.time()
    _kill9(r, 0)
    kind, message, done, t_end = h.wait(timeout=90)[0]
    # time.monotonic differs per process: the sender returns its own clock, measure here
    t_detect = time.time() - t0
    ok = kind in ("PeerDiedError", "CommError") and r.name in message and t_detect < 30
    return Outcome(f"{kind} after {done} messages: {message[:70]}", ok, t_detect)


def sender_to_dead_peer(c: Ctx) -> Outcome:
    """Send to a worker killed for good (no restart policy): fails fast naming it."""
    s = c.group(Node, 1, tag="_s")
    d = c.group(Node, 1, tag="_d")
    ray.kill(d.actors[0], no_restart=True)
    kind, message, took = s.send_to("x", d.name, 0).wait(timeout=60)[0]
    ok = kind in ("PeerDiedError", "PeerNotFoundError") and d.name in message and took < 10
    return Outcome(f"{kind}: {message[:70]}", ok, took)


def _runner_group(c: Ctx, mode: str) -> Any:
    from phalanx.envs import EnvRunnerGroup, EnvRunnerGroupConfig

    cfg = EnvRunnerGroupConfig(
        env_config={"bad": 2, "at_step": 15, "mode": mode, "marks": c.dir},
        num_envs_per_env_runner=1,
        seed=0,
        restart_failed_env_runners=True,
        env_runner_health_probe_timeout_s=120.0,
    )
    g = EnvRunnerGroup(
        env_creator=make_faulty_cartpole,
        config=cfg,
        num_env_runners=2,
        local_env_runner=False,
        cluster=c.cluster,
        name=f"fm_{c.name}",
    )
    c.cleanup.append(g.stop)
    return g


def _runner_round(g: Any) -> list[int]:
    return sorted(b["worker_index"] for b in g.sample(num_timesteps=10))


def _env_runner_fault(c: Ctx, mode: str) -> Outcome:
    g = _runner_group(c, mode)
    first = _runner_round(g)
    t0 = time.monotonic()
    second = _runner_round(g)  # runner 2 faults at its 15th step, inside this round
    t_detect = time.monotonic() - t0
    out = g.healthy_env_runner_ids()
    probed = g.probe_unhealthy_env_runners()
    third = _runner_round(g)
    t_back = time.monotonic() - t0
    restarts = g.num_remote_env_runner_restarts()
    ok = (
        first == [1, 2]
        and second == [1]
        and out == [1]
        and probed == [2]
        and third == [1, 2]
        and restarts == 1
    )
    return Outcome(
        f"rounds {first} {second} {third}, in service after fault {out}, probe -> {probed}, "
        f"restarts {restarts}",
        ok,
        t_detect,
        t_back,
    )


def env_runner_raises(c: Ctx) -> Outcome:
    """Runner 2's env raises in sample(): round completes from runner 1, runner 2 back."""
    return _env_runner_fault(c, "raise")


def env_runner_killed(c: Ctx) -> Outcome:
    """Runner 2's process is SIGKILLed in sample(): same as a raise (RLlib's rule)."""
    return _env_runner_fault(c, "kill")


def weights_to_killed_receiver(c: Ctx) -> Outcome:
    """WeightSender.send with rank 1 of 3 SIGKILLed (no restart): others get the weights."""
    import torch

    g = c.group(ModelHolder, 3)
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 64)
    sender = px.WeightSender(g, model, timeout_s=60)
    first = sender.send()
    _kill9(g, 1)
    with torch.no_grad():
        model.weight.add_(1.0)
    t0 = time.monotonic()
    result = sender.send()
    took = time.monotonic() - t0
    again = sender.send()
    ok = (
        first.applied == [0, 1, 2]
        and result.applied == [0, 2]
        and list(result.failed) == [1]
        and again.applied == [0, 2]
        and took < 30
    )
    return Outcome(
        f"applied {result.applied}, failed {list(result.failed)}; next send "
        f"applied {again.applied}",
        ok,
        took,
    )


def hung_worker_timeout(c: Ctx) -> Outcome:
    """Rank 1 hangs; wait(timeout=1) raises HangTimeoutError with a report of its stack."""
    os.environ["PHALANX_HANG_DIR"] = os.path.join(c.dir, "hangs")
    g = c.group(Flaky, 2, c.dir, policy=px.RestartPolicy())
    h = g.hang_on(1)
    t0 = time.monotonic()
    try:
        h.wait(timeout=1.0)
        err = None
    except px.HangTimeoutError as e:
        err = e
    took = time.monotonic() - t0
    if err is None:
        return Outcome("no timeout", False, took)
    with open(err.report_path) as f:
        report = f.read()
    ok = (
        err.pending_ranks == [1]
        and err.results == {0: 0}
        and "stuck_forever" in str(err)
        and "stuck_forever" in report
        and g.healthy_worker_ids() == [0, 1]
    )
    return Outcome(
        f"HangTimeoutError pending={err.pending_ranks}, report names the frame: "
        f"{'stuck_forever' in report}",
        ok,
        took,
    )


_DRIVER = """
import json, os, sys, torch, ray
import phalanx as px
from phalanx.resources.cluster import NAMESPACE

class Holder(px.Worker):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(256, 256)

ray.init(address=sys.argv[1], namespace=NAMESPACE)
g = Holder.create_group().launch(px.Cluster(), px.NodePlacement(num_workers=2), name=sys.argv[2])
model = torch.nn.Linear(256, 256)
sender = px.WeightSender(g, model)
sender.send()
out = {"pids": [m["pid"] for m in g.worker_metadata], "shm": list(sender.shared_buffers)}
print(json.dumps(out), flush=True)
sys.stdin.read()
"""


def killed_driver(c: Ctx) -> Outcome:
    """A driver SIGKILLed while holding a group and a shared buffer: actors and shm reaped."""
    name = f"fm_{c.name}"
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, ray.get_runtime_context().gcs_address, name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    c.cleanup.append(lambda: proc.poll() is None and proc.kill())
    line = proc.stdout.readline()
    if not line:
        return Outcome("the driver did not start its group", False)
    info = json.loads(line)

    def alive() -> list[str]:
        rows = ray.util.list_named_actors(all_namespaces=True)
        return sorted(r["name"] for r in rows if r["name"].startswith(f"{name}:"))

    def proc_alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    before = alive()
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=20)
    gone = _until(lambda: alive() == [], 30)
    t_actors = time.monotonic() - t0
    procs_gone = _until(lambda: not any(proc_alive(p) for p in info["pids"]), 30)
    left_before = [p for p in info["shm"] if os.path.exists(p)]
    # The next phalanx process started on the node reaps segments of dead owners.
    probe = c.group(ModelHolder, 1, tag="_reaper")
    probe.pid().wait(timeout=60)
    left = [p for p in info["shm"] if os.path.exists(p)]
    left += glob.glob(f"/dev/shm/px_*{proc.pid}-*")
    ok = before == [f"{name}:0", f"{name}:1"] and gone and procs_gone and not left
    return Outcome(
        f"actors gone={gone}, worker processes gone={procs_gone}, segments left after the "
        f"kill {len(left_before)}, after the next phalanx process {len(left)}",
        ok,
        t_actors,
        time.monotonic() - t0,
    )


# (name, expected outcome, function): the fixed list, run in this order.
SCENARIOS: list[tuple[str, str, Callable[[Ctx], Outcome]]] = [
    ("kill9_idle", "restarted on its slot, state restored", kill9_idle_worker),
    ("kill9_call", "WorkerDiedError(rank 1) < 5 s, restarted", kill9_during_call),
    ("kill_in_init", "launch succeeds, rank 1 started twice", kill_during_init),
    ("sys_exit", "WorkerDiedError, registered state restored", sys_exit_in_method),
    ("restart_limit", "rank dead after the limit, calls raise", restart_limit_exhausted),
    ("recv_sender_killed", "PeerDiedError naming the sender", recv_sender_killed),
    ("recv_killed_big_send", "sender fails fast naming the peer", receiver_killed_mid_large_send),
    ("send_to_dead", "PeerDiedError/NotFound < 10 s", sender_to_dead_peer),
    ("runner_raises", "round from runner 1, runner 2 back", env_runner_raises),
    ("runner_killed", "round from runner 1, runner 2 back", env_runner_killed),
    ("weights_killed_rx", "applied [0, 2], failed [1]", weights_to_killed_receiver),
    ("hang_timeout", "HangTimeoutError + stack report", hung_worker_timeout),
    ("driver_killed", "actors reaped, /dev/shm clean", killed_driver),
]


def _run(cluster: px.Cluster, name: str, fn: Callable[[Ctx], Outcome], timeout: float) -> Outcome:
    box: dict[str, Outcome] = {}
    c = Ctx(cluster, name)

    def target() -> None:
        try:
            box["out"] = fn(c)
        except Exception as e:  # noqa: BLE001 - a scenario that raised did not survive
            tb = traceback.format_exc(limit=2).strip().splitlines()[-1]
            box["out"] = Outcome(f"raised {type(e).__name__}: {str(e)[:80]} ({tb[:60]})", False)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    out = box.get("out") or Outcome(f"did not finish within {timeout:.0f} s", False)
    c.close()
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per scenario")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s[0] in args.only.split(",")]
    # The faults make Ray print a worker-death notice each: keep the table readable.
    cluster = px.Cluster(num_cpus=16, log_to_driver=False)
    header = (
        f"{'scenario':<22} {'expected':<44} {'ok':<4} {'detect s':>8} {'recover s':>9}  observed"
    )
    print(header)
    lines = []
    survived = 0
    for name, expected, fn in chosen:
        out = _run(cluster, name, fn, args.timeout)
        survived += out.survived
        lines.append(
            f"{name:<22} {expected:<44} {'yes' if out.survived else 'NO':<4} "
            f"{_fmt(out.detect_s):>8} {_fmt(out.recover_s):>9}  {out.observed}"
        )
        print(lines[-1], flush=True)
    # Ray prints a notice for every worker death between the rows above: the table again.
    print("\nsummary")
    print(header)
    print("\n".join(lines))
    print(f"faults tried {len(chosen)} / survived {survived}")


if __name__ == "__main__":
    main()
