"""phalanx's sockets accept only peers that hold the Ray session's secret."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import socket
import struct

import psutil
import pytest
from ray.experimental import internal_kv

import phalanx as px

pytestmark = pytest.mark.timeout(180)


class Peer(px.Worker):
    def ping_pong(self, group, rank, value):
        self.send(value, group, rank)
        return self.recv(group, rank)

    def echo_once(self, group, rank):
        self.send(self.recv(group, rank), group, rank)
        return True

    def pid(self):
        return os.getpid()


class _CreatesFile:
    """Unpickling this creates ``path``: the payload an attacker would send."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def _announced(name: str) -> dict:
    raw = internal_kv._internal_kv_get(f"ep/{name}".encode(), namespace="phalanx_comm")
    assert raw is not None, f"{name} announced no endpoint"
    return json.loads(raw)


def _closed_by_server(sock: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sent until it closed the connection (raises if it stays open)."""
    sock.settimeout(timeout)
    got = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


@pytest.fixture(scope="module")
def peers(cluster):
    a = Peer.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="sec_a")
    b = Peer.create_group().launch(cluster, px.NodePlacement(num_workers=1), name="sec_b")
    yield a, b
    a.shutdown()
    b.shutdown()


def test_payload_is_live(tmp_path):
    """The attack payload really creates its file when unpickled (so the next test can fail)."""
    target = tmp_path / "control"
    pickle.loads(pickle.dumps(_CreatesFile(str(target))))
    assert target.exists()


@pytest.mark.parametrize("mode", ["old_frame", "raw_pickle", "bad_mac"])
def test_unauthenticated_client_is_dropped_before_unpickling(peers, tmp_path, mode):
    a, b = peers
    target = tmp_path / f"pwned_{mode}"
    payload = pickle.dumps(_CreatesFile(str(target)))
    info = _announced("sec_b:0")
    with socket.create_connection((info["ip"], info["port"]), timeout=30) as sock:
        if mode == "old_frame":  # the pre-authentication framing: length, then a pickle
            sock.sendall(struct.pack("<Q", len(payload)) + payload)
        elif mode == "raw_pickle":
            sock.sendall(payload * 4)
        else:  # speaks the handshake but does not know the secret
            sock.sendall(b"PXA1" + os.urandom(16))
            challenge = sock.recv(52)
            assert len(challenge) == 52 and challenge[:4] == b"PXA1"
            sock.sendall(os.urandom(32) + struct.pack("<Q", len(payload)) + payload)
        rest = _closed_by_server(sock)
    assert rest == b""  # disconnected without a reply
    assert not target.exists()
    # The worker that was attacked still talks to authenticated peers.
    h = b.echo_once("sec_a", 0)
    assert a.ping_pong("sec_b", 0, {"after": mode}).wait(timeout=60) == [{"after": mode}]
    assert h.wait(timeout=60) == [True]
    assert not target.exists()


def test_listener_on_the_node_address_and_secret_in_kv(peers):
    from phalanx.comm.endpoint import listen_address

    a, _ = peers
    node_ip = listen_address()  # the node address Ray was given: loopback in the suite
    info = _announced("sec_a:0")
    assert info["ip"] == node_ip
    pid = a.pid().wait(timeout=60)[0]
    listening = [
        c.laddr
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == info["port"]
    ]
    assert [addr.ip for addr in listening] == [node_ip]
    secret = internal_kv._internal_kv_get(b"auth/secret", namespace="phalanx_comm")
    assert isinstance(secret, bytes) and len(secret) == 32


@pytest.mark.smoke
def test_server_proves_itself_to_the_client(peers, tmp_path):
    """A squatter without the secret cannot pose as a peer: the client refuses it."""
    from phalanx.comm.auth import client_handshake
    from phalanx.comm.errors import AuthenticationError

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn, _ = server.accept()
    conn.sendall(b"PXA1" + os.urandom(16) + os.urandom(32))  # a challenge with a made-up MAC
    with pytest.raises(AuthenticationError, match="failed authentication"):
        client_handshake(client, b"s" * 32, "squatter:0")
    for s in (client, conn, server):
        s.close()


def test_pg_message_must_name_the_peers_own_address(peers):
    """Even an authenticated peer cannot send a worker to a TCP store on another host."""
    from phalanx.comm.auth import client_handshake

    secret = internal_kv._internal_kv_get(b"auth/secret", namespace="phalanx_comm")
    info = _announced("sec_b:0")
    decoy = socket.create_server(("127.0.0.2", 0))  # not the address this client announces
    me = {
        "name": "px-driver-sectest",
        "incarnation": "-/0/sectest",
        "ip": info["ip"],
        "port": 1,
        "node_id": "sectest",
        "pid": os.getpid(),
        "is_actor": False,
        "gpu_uuids": [],
        "actor_id": "",
    }
    with socket.create_connection((info["ip"], info["port"]), timeout=30) as sock:
        client_handshake(sock, secret, "sec_b:0")
        hello = json.dumps(me).encode()
        sock.sendall(struct.pack("<I", len(hello)) + hello)
        meta = pickle.dumps(("pg", "k", [], ("gloo", "127.0.0.2", decoy.getsockname()[1])))
        sock.sendall(struct.pack("<QQ", len(meta), 0) + meta)
        assert _closed_by_server(sock) == b""  # refused, connection dropped
    decoy.setblocking(False)
    with pytest.raises(BlockingIOError):
        decoy.accept()  # nobody was sent to the decoy store
    decoy.close()
