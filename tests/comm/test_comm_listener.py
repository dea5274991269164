"""The listener survives outsiders: fd exhaustion, handshake floods,
log floods, oversized frames; listeners follow the node address phalanx was given."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
from ray.experimental import internal_kv

import phalanx as px
from phalanx.comm.frames import FrameTooLarge, check_frame, recv_bytes
from tests.helpers import until

pytestmark = pytest.mark.timeout(240)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Target(px.Worker):
    def limit_fds(self, extra: int) -> tuple[int, int]:
        """Lower this process's descriptor limit to what it has open now plus ``extra``."""
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = len(os.listdir("/proc/self/fd")) + extra
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        return soft, limit

    def restore_fds(self, soft: int) -> None:
        import resource

        resource.setrlimit(
            resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    def ping_pong(self, group, rank, value):
        self.send(value, group, rank)
        return self.recv(group, rank, timeout=60)

    def echo_once(self, group, rank):
        self.send(self.recv(group, rank, timeout=60), group, rank)
        return True

    def handshake_threads(self) -> int:
        return sum(t.name == "px-recv" for t in threading.enumerate())

    def rss(self) -> int:
        return psutil.Process().memory_info().rss

    def pid(self) -> int:
        return os.getpid()


def _announced(name: str) -> dict:
    raw = internal_kv._internal_kv_get(f"ep/{name}".encode(), namespace="phalanx_comm")
    assert raw is not None, f"{name} announced no endpoint"
    return json.loads(raw)


def _closed_by_server(sock: socket.socket, timeout: float = 30.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _authenticated(name: str) -> socket.socket:
    """A connection to ``name``'s listener that passed the handshake and sent a hello."""
    from phalanx.comm.auth import client_handshake

    secret = internal_kv._internal_kv_get(b"auth/secret", namespace="phalanx_comm")
    info = _announced(name)
    sock = socket.create_connection((info["ip"], info["port"]), timeout=30)
    client_handshake(sock, secret, name)
    me = dict(
        info, name="px-driver-frametest", incarnation="-/0/frametest", port=1, pid=os.getpid()
    )
    hello = json.dumps(me).encode()
    sock.sendall(struct.pack("<I", len(hello)) + hello)
    return sock


@pytest.fixture(scope="module")
def pair(cluster):
    """Two workers whose listeners are on loopback: the attacks below never leave the machine."""
    loopback = {"PHALANX_COMM_BIND_ADDRESS": "127.0.0.1"}
    t = Target.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name="lst_t", env_vars=loopback
    )
    p = Target.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name="lst_p", env_vars=loopback
    )
    assert _announced("lst_t:0")["ip"] == _announced("lst_p:0")["ip"] == "127.0.0.1"
    yield t, p
    t.shutdown()
    p.shutdown()


def test_listener_keeps_accepting_after_running_out_of_descriptors(pair):
    t, p = pair
    pid = t.pid().wait(timeout=60)[0]
    soft, limit = t.limit_fds(30).wait(timeout=60)[0]
    info = _announced("lst_t:0")
    idle = []
    try:
        for _ in range(60):  # more than the worker can accept: it hits EMFILE
            idle.append(socket.create_connection((info["ip"], info["port"]), timeout=30))
        assert until(lambda: psutil.Process(pid).num_fds() >= limit, timeout=60)
    finally:
        for s in idle:
            s.close()
    assert until(lambda: psutil.Process(pid).num_fds() < limit - 20, timeout=60)
    t.restore_fds(soft).wait(timeout=60)
    # lst_p never talked to lst_t: this is a new connection through the listener.
    h = t.echo_once("lst_p", 0)
    assert p.ping_pong("lst_t", 0, {"after": "EMFILE"}).wait(timeout=60) == [{"after": "EMFILE"}]
    assert h.wait(timeout=60) == [True]


def test_handshakes_in_progress_are_capped(pair):
    t, p = pair
    from phalanx.comm.config import CommConfig

    cap = CommConfig().max_handshakes
    info = _announced("lst_t:0")
    before = t.handshake_threads().wait(timeout=60)[0]
    idle = [
        socket.create_connection((info["ip"], info["port"]), timeout=30) for _ in range(cap + 40)
    ]
    try:
        # The excess is closed at once, the rest wait in their handshake (one thread each).
        closed = [s for s in idle[cap:] if _closed_by_server(s, timeout=30)]
        assert len(closed) == 40
        assert t.handshake_threads().wait(timeout=60)[0] - before <= cap
    finally:
        for s in idle:
            s.close()
    h = t.echo_once("lst_p", 0)
    assert p.ping_pong("lst_t", 0, "after the flood").wait(timeout=60) == ["after the flood"]
    assert h.wait(timeout=60) == [True]


def test_refused_connections_are_logged_once_per_interval(cluster, caplog, monkeypatch):
    from phalanx.comm.endpoint import Endpoint

    monkeypatch.setenv("PHALANX_COMM_BIND_ADDRESS", "127.0.0.1")
    ep = Endpoint("px-driver-logflood")
    assert ep.info.ip == "127.0.0.1"
    try:
        with caplog.at_level(logging.WARNING, logger="phalanx.comm.receiving"):
            for _ in range(20):
                with socket.create_connection((ep.info.ip, ep.info.port), timeout=30) as s:
                    s.sendall(b"GARBAGE!" * 8)
                    assert _closed_by_server(s)
            assert until(lambda: ep.refused == 19, timeout=30)
        warnings = [r for r in caplog.records if r.name == "phalanx.comm.receiving"]
        assert len(warnings) == 1
        assert "refused 1 connection(s)" in warnings[0].getMessage()
    finally:
        ep.close()


_SILENT_GIGABYTE = textwrap.dedent(
    """
    import resource, socket
    from phalanx.comm.frames import recv_bytes
    a, b = socket.socketpair()
    a.sendall(b"x" * 1000)
    a.close()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        recv_bytes(b, 1 << 30)  # a gigabyte promised, a kilobyte sent
    except ConnectionError:
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


def test_frame_header_is_capped_and_large_frames_are_streamed():
    with pytest.raises(FrameTooLarge, match="PHALANX_COMM_MAX_FRAME_BYTES"):
        check_frame(1 << 30, 0, 256 << 20)
    check_frame(1 << 20, 1 << 20, 256 << 20)
    run = subprocess.run(
        [sys.executable, "-c", _SILENT_GIGABYTE],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) < 64  # MiB of peak memory grown, not 1024
    c, d = socket.socketpair()
    payload = b"0123456789" * 4_000_000
    threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
    assert bytes(recv_bytes(d, len(payload))) == payload
    c.close()
    d.close()


def test_oversized_or_silent_frames_cost_no_memory(pair):
    t, p = pair
    with _authenticated("lst_t:0") as sock:  # 1 GiB promised: over the cap, dropped
        sock.sendall(struct.pack("<QQ", 1 << 30, 0))
        assert _closed_by_server(sock)
    base = t.rss().wait(timeout=60)[0]
    with _authenticated("lst_t:0") as sock:  # 200 MiB promised, 1 MiB sent, then silence
        sock.sendall(struct.pack("<QQ", 200 << 20, 0) + b"\0" * (1 << 20))
        grew = until(lambda: t.rss().wait(timeout=60)[0] - base > (100 << 20), timeout=3)
    assert not grew
    h = t.echo_once("lst_p", 0)
    assert p.ping_pong("lst_t", 0, "still fine").wait(timeout=60) == ["still fine"]
    assert h.wait(timeout=60) == [True]


_LOOPBACK_RUN = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import psutil, ray
    from ray.experimental import internal_kv
    import phalanx as px
    from phalanx.comm import p2p
    from phalanx.comm.endpoint import get_endpoint

    class Echo(px.Worker):
        def echo(self, peer):
            self.send(self.recv(peer, timeout=60), peer)
            return True
        def pid(self):
            return os.getpid()

    cluster = px.Cluster(num_cpus=4, _node_ip_address="127.0.0.1")
    g = Echo.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="lb")
    me = get_endpoint()
    raw = internal_kv._internal_kv_get(b"ep/lb:0", namespace="phalanx_comm")
    port = json.loads(raw)["port"]
    pid = g.pid().wait(timeout=60)[0]
    listening = [c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    h = g.execute_on(0).echo(px.WorkerAddress(me.name, []))
    p2p.send({"x": 1}, "lb", 0)
    got = p2p.recv("lb", 0, timeout=60)
    h.wait(timeout=60)
    waiting = p2p.recv("lb", 1, async_op=True)  # a receive still waiting at shutdown
    ch = px.create_channel("lb_chan")
    ch.put("item")
    got_item = ch.get(timeout=60)
    parked = ch.get(async_op=True)
    print(json.dumps({"driver": me.info.ip, "worker": json.loads(raw)["ip"],
                      "listening": listening, "got": got, "item": got_item}), flush=True)
    ray.shutdown()
    # poll (deadline 30 s) until the reader threads have seen their peers die after the
    # shutdown: the moment a thread would touch the shut-down Ray
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        t.name == "px-recv" for t in threading.enumerate()
    ):
        time.sleep(0.05)
    print("exiting", flush=True)
    """
)


def test_loopback_cluster_keeps_listeners_on_loopback_and_exits_cleanly(tmp_path):
    """``px.Cluster(_node_ip_address="127.0.0.1")``: every listener on loopback; after
    ``ray.shutdown()`` no phalanx thread touches Ray and the process exits 0."""
    script = tmp_path / "loopback.py"
    script.write_text(_LOOPBACK_RUN)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PHALANX_COMM_BIND_ADDRESS")
    }
    env["PYTHONPATH"] = ROOT
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1] == "exiting"
    report = json.loads(lines[-2])
    assert report == {
        "driver": "127.0.0.1",
        "worker": "127.0.0.1",
        "listening": ["127.0.0.1"],
        "got": {"x": 1},
        "item": "item",
    }
    assert "core worker has already been shutdown" not in run.stderr
