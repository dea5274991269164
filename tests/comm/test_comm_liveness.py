"""No hangs when a peer dies: restarts are seen, connects fail fast."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import phalanx as px
from phalanx.comm import p2p
from phalanx.comm.config import CONFIG, CommConfig

pytestmark = pytest.mark.timeout(240)


class Node(px.Worker):
    def recv_then_report(self, group, rank, marker):
        """Post a blocking receive (timeout=None); report how it ended."""
        t0 = time.monotonic()
        work = self.recv(group, rank, async_op=True)
        with open(marker, "w") as f:
            f.write("posted")
        try:
            value = work.wait()
        except Exception as e:  # noqa: BLE001 - returned for the test
            return type(e).__name__, str(e), time.monotonic() - t0
        return "value", value, time.monotonic() - t0

    def send_to(self, obj, group, rank):
        t0 = time.monotonic()
        try:
            self.send(obj, group, rank)
        except Exception as e:  # noqa: BLE001 - returned for the test
            return type(e).__name__, str(e), time.monotonic() - t0
        return "sent", "", time.monotonic() - t0

    def recv_one(self, group, rank):
        return self.recv(group, rank, timeout=60)

    def pid(self):
        return os.getpid()

    def drain(self, group, rank, marker):
        """Receive messages until killed; the marker says the first one arrived."""
        self.recv(group, rank)
        with open(marker, "w") as f:
            f.write("1")
        while True:
            self.recv(group, rank)

    def send_gloo_until_error(self, group, rank, rounds):
        """Send 64 MB tensors through gloo (shared memory off) until a send fails."""
        import torch

        from phalanx.comm import configure

        configure(use_shm=False)
        t = torch.ones(16 << 20)
        for i in range(rounds):
            try:
                self.send(t, group, rank)
            except Exception as e:  # noqa: BLE001 - returned for the test
                return type(e).__name__, str(e), i
        return "sent", "", rounds


class BarePeer:
    """A live actor under a phalanx worker's name that never opens an endpoint."""

    def _px_ping(self):
        return os.getpid()


def _wait_for_file(path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not written within {timeout}s"
        time.sleep(0.01)


def _restarted(group, restarts: int, timeout: float = 90.0) -> None:
    """Wait until the group has restarted ``restarts`` workers in all and is healthy again."""
    deadline = time.monotonic() + timeout
    while group.num_remote_worker_restarts() < restarts:
        assert time.monotonic() < deadline, f"{group.name} did not restart within {timeout}s"
        time.sleep(0.05)
    assert group.wait_healthy(timeout)


def _kill9(group, rank) -> int:
    pid = group.worker_metadata[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture
def pair(cluster, request):
    tag = request.node.name.split("[")[0][-12:]
    policy = px.RestartPolicy(max_restarts_per_worker=3)
    s = Node.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name=f"lv_s_{tag}", restart_policy=policy
    )
    r = Node.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name=f"lv_r_{tag}", restart_policy=policy
    )
    yield s, r
    s.shutdown()
    r.shutdown()


def test_recv_fails_when_sender_is_killed_and_restarted(pair, tmp_path):
    s, r = pair
    marker = tmp_path / "posted"
    h = r.recv_then_report(s.name, 0, str(marker))  # no message ever sent before: no socket
    _wait_for_file(marker)
    old_pid = _kill9(s, 0)
    kind, message, waited = h.wait(timeout=120)[0]
    assert kind == "PeerDiedError", (kind, message)
    assert f"{s.name}:0" in message
    assert waited < 60
    # The sender comes back under the same name; later calls between the pair work.
    _restarted(s, 1)
    assert s.pid().wait(timeout=60)[0] != old_pid
    assert s.num_remote_worker_restarts() == 1
    hr = r.recv_one(s.name, 0)
    assert s.send_to({"after": "restart"}, r.name, 0).wait(timeout=60)[0][0] == "sent"
    assert hr.wait(timeout=60) == [{"after": "restart"}]


def test_recv_fails_when_connected_sender_is_restarted(pair, tmp_path):
    s, r = pair
    hr = r.recv_one(s.name, 0)
    assert s.send_to("first", r.name, 0).wait(timeout=60)[0][0] == "sent"
    assert hr.wait(timeout=60) == ["first"]
    marker = tmp_path / "posted"
    h = r.recv_then_report(s.name, 0, str(marker))
    _wait_for_file(marker)
    _kill9(s, 0)
    kind, message, waited = h.wait(timeout=120)[0]
    assert kind == "PeerDiedError" and f"{s.name}:0" in message and waited < 60
    _restarted(s, 1)
    hr = r.recv_one(s.name, 0)
    assert s.send_to("second", r.name, 0).wait(timeout=60)[0][0] == "sent"
    assert hr.wait(timeout=60) == ["second"]


def test_send_reaches_a_restarted_receiver_at_once(pair):
    s, r = pair
    hr = r.recv_one(s.name, 0)
    assert s.send_to(1, r.name, 0).wait(timeout=60)[0][0] == "sent"
    assert hr.wait(timeout=60) == [1]
    _kill9(r, 0)
    _restarted(r, 1)
    # The sender's connection went to the dead incarnation: it sees that and reconnects to
    # the new one (the message is not written into the dead socket and lost).
    hr = r.recv_one(s.name, 0)
    kind, message, took = s.send_to(2, r.name, 0).wait(timeout=60)[0]
    assert kind == "sent" and took < 10, (kind, message)
    assert hr.wait(timeout=60) == [2]


def test_send_to_a_live_peer_that_never_used_comm_does_not_wait(pair):
    s, r = pair
    # r never called send/recv: it announced its endpoint when it started.
    kind, _, took = s.send_to("early", r.name, 0).wait(timeout=60)[0]
    assert kind == "sent" and took < 10
    assert r.recv_one(s.name, 0).wait(timeout=60) == ["early"]


def test_send_to_a_dead_peer_fails_fast(cluster):
    s = Node.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="lv_dead_s")
    d = Node.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="lv_dead_d")
    try:
        ray.kill(d.actors[0], no_restart=True)  # no restart policy: it stays dead
        kind, message, took = s.send_to("x", "lv_dead_d", 0).wait(timeout=60)[0]
        assert kind in ("PeerDiedError", "PeerNotFoundError") and "lv_dead_d" in message
        assert took < 10
    finally:
        s.shutdown()
        d.shutdown()


def test_connect_waits_a_bounded_time_for_an_endpoint(cluster):
    assert CommConfig().connect_timeout_s == 30.0
    bare = ray.remote(BarePeer).options(name="lv_bare:0", namespace="phalanx", num_cpus=0).remote()
    ray.get(bare._px_ping.remote(), timeout=60)
    old = CONFIG.connect_timeout_s
    CONFIG.connect_timeout_s = 1.5
    try:
        t0 = time.monotonic()
        with pytest.raises(px.comm.CommError, match="did not announce its communication endpoint"):
            p2p.send("x", "lv_bare", 0)
        assert 1.5 <= time.monotonic() - t0 < 15
    finally:
        CONFIG.connect_timeout_s = old
        ray.kill(bare, no_restart=True)


def test_receiver_killed_mid_gloo_send_fails_the_sender_fast(cluster, tmp_path):
    s = Node.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="lv_big_s")
    r = Node.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="lv_big_r")
    try:
        marker = tmp_path / "first"
        r.drain("lv_big_s", 0, str(marker))
        h = s.send_gloo_until_error("lv_big_r", 0, 1000)
        _wait_for_file(marker, 90)
        t0 = time.monotonic()
        _kill9(r, 0)  # no restart policy: it stays dead
        kind, message, sent = h.wait(timeout=90)[0]
        assert kind == "PeerDiedError" and "lv_big_r:0" in message, (kind, message)
        assert sent >= 1 and time.monotonic() - t0 < 30
    finally:
        s.shutdown()
        r.shutdown(force=True)
