"""One communication endpoint per process: its listener, peers, inboxes and liveness.

Every process that communicates (a worker, a channel, the driver) has one ``Endpoint``
with a TCP listener on its node's address, announced in Ray's KV store under its name
(``peers.py``; a worker's name is its actor name ``group:rank``). The endpoint is put
together from three halves, one file each: ``sending.py`` (one outgoing connection per
peer, bulk transports), ``receiving.py`` (listener, authentication, reader threads,
frames) and ``liveness.py`` (the monitor that fails operations waiting on a dead or
restarted peer). B reads every incoming message eagerly into an inbox (``inbox.py``); a
``recv`` may come before or after the ``send``, and messages between a pair arrive in
send order.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import ray

from phalanx.comm import auth, shm
from phalanx.comm.config import bind_address
from phalanx.comm.errors import CommError
from phalanx.comm.frames import close_socket
from phalanx.comm.inbox import Inbox
from phalanx.comm.liveness import Liveness
from phalanx.comm.peers import (
    ACTOR_NAMESPACE,
    DRIVER_PREFIX,
    KV_NAMESPACE,
    PeerInfo,
    announce,
    announced,
    gpu_uuids,
    withdraw,
)
from phalanx.comm.receiving import Receiving
from phalanx.comm.sending import Sending
from phalanx.comm.wire import Outgoing
from phalanx.comm.work import Work

__all__ = [
    "ACTOR_NAMESPACE",
    "DRIVER_PREFIX",
    "KV_NAMESPACE",
    "Endpoint",
    "get_endpoint",
    "listen_address",
    "reset_endpoint",
]


def listen_address() -> str:
    """The address listeners bind to: ``bind_address`` if set, else Ray's node address."""
    return bind_address() or ray.util.get_node_ip_address()


def _listen(ip: str) -> socket.socket:
    try:
        return socket.create_server((ip, 0), backlog=256)
    except OSError as e:
        raise CommError(
            "listener",
            f"phalanx could not listen on {ip} ({e}); set PHALANX_COMM_BIND_ADDRESS to an "
            "address of this machine",
        ) from None


class Endpoint(Receiving, Sending, Liveness):
    """This process's communication endpoint (see the module docstring)."""

    def __init__(self, name: str):
        if not ray.is_initialized():
            raise RuntimeError("phalanx communication needs Ray: create a px.Cluster() first")
        Receiving.__init__(self)
        Sending.__init__(self)
        Liveness.__init__(self)
        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
        self.name = name
        self.closed = False
        self.job_id = ""
        self.secret = auth.cluster_secret()
        ip = listen_address()  # never 0.0.0.0
        self.listener = _listen(ip)
        self.info = PeerInfo(
            name=name,
            incarnation=f"{actor_id or '-'}/{os.getpid()}/{uuid.uuid4().hex}",
            ip=ip,
            port=self.listener.getsockname()[1],
            node_id=ctx.get_node_id(),
            pid=os.getpid(),
            is_actor=actor_id is not None,
            gpu_uuids=gpu_uuids(),
            actor_id=actor_id or "",
        )
        self.lock = threading.RLock()
        self.inboxes: dict[str, Inbox] = {}
        self.default_handler: Callable[[str, Any], None] | None = None
        announce(self.info)
        threading.Thread(target=self.accept_loop, name="px-accept", daemon=True).start()
        self.start_monitor()

    def send(self, peer: str, msg: Outgoing, async_op: bool = False) -> Work:
        fut = self.out_conn(peer).submit(msg, async_op)
        work = Work(f"send of {msg.desc} to {peer}", fut)
        if not async_op:
            work.wait()
        return work

    def recv(self, peer: str, kind: str = "obj", buffer: Any = None) -> Work:
        box = self.inbox(peer)
        fut = box.claim(kind, buffer, self.probe_for(box))
        return Work(f"recv from {peer}", fut)

    def recv_now(
        self, peer: str, timeout: float | None, kind: str = "obj", buffer: Any = None
    ) -> Any:
        """A blocking receive; on timeout it is withdrawn, so the message goes to the next receive."""
        box = self.inbox(peer)
        fut = box.claim(kind, buffer, self.probe_for(box))
        try:
            return Work(f"recv from {peer}", fut).wait(timeout)
        except TimeoutError:
            if box.cancel(fut):
                raise
            return fut.result()

    def inbox(self, peer: str) -> Inbox:
        with self.lock:
            box = self.inboxes.get(peer)
            if box is None:
                box = self.inboxes[peer] = Inbox(peer, lambda: self.closed, self.retire)
                if self.default_handler is not None:
                    box.handler = self.default_handler
            return box

    def set_handler(self, peer: str, handler: Callable[[str, Any], None]) -> None:
        """Route every message from ``peer`` to ``handler(peer, value_or_error)``."""
        box = self.inbox(peer)
        with box.cv:
            if box.claims or box.arrived:
                raise CommError(peer, f"{peer} already has pending receives")
            box.handler = handler

    def announced(self, peer: str) -> PeerInfo | None:
        """The endpoint ``peer`` announces in Ray's KV store now (None if none)."""
        return announced(peer)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        err = CommError(self.name, "endpoint closed")
        close_socket(self.listener)
        for conn in list(self.out_conns.values()):
            conn.fail(err)
        for box in list(self.inboxes.values()):
            close_socket(box.sock)
            box.fail(err)
        withdraw(self.info)
        shm.cleanup_created()


_ENDPOINT: Endpoint | None = None
_ENDPOINT_LOCK = threading.Lock()


def get_endpoint() -> Endpoint:
    """This process's endpoint, started on first use (named after the Ray actor, if any)."""
    global _ENDPOINT
    ep = _ENDPOINT
    if ep is not None and not ep.closed:
        if ray.is_initialized() and _session_key() == ep.job_id:
            return ep
        ep.close()  # Ray was restarted under this process: announce a new endpoint
    with _ENDPOINT_LOCK:
        if _ENDPOINT is None or _ENDPOINT.closed:
            name = None
            if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
                name = ray.get_runtime_context().get_actor_name()
            _ENDPOINT = Endpoint(name or f"{DRIVER_PREFIX}{uuid.uuid4().hex[:12]}")
            _ENDPOINT.job_id = _session_key()
            atexit.register(_ENDPOINT.close)
        return _ENDPOINT


def _session_key() -> str:
    """Identifies the Ray session: job ids restart at 01000000 in a new Ray, node ids do not."""
    ctx = ray.get_runtime_context()
    return f"{ctx.get_job_id()}@{ctx.get_node_id()}"


def reset_endpoint() -> None:
    """Close this process's endpoint (e.g. before ``ray.shutdown()`` in the driver)."""
    global _ENDPOINT
    with _ENDPOINT_LOCK:
        if _ENDPOINT is not None:
            _ENDPOINT.close()
            _ENDPOINT = None
