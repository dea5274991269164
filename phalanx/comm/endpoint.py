"""One communication endpoint per process: sockets to peers, inboxes, liveness.

Every process that communicates (a worker, a channel, the driver) has one ``Endpoint``
with a TCP listener on its node's address, announced in Ray's KV store under its name
(a worker's name is its actor name ``group:rank``). Messages from A to B travel over a
connection A opened to B and only A writes to, so the two directions never wait on
each other and no rendezvous order is needed. B reads every incoming message eagerly
into an inbox (a ``recv`` may come before or after the ``send``); receives claim
messages in order, so messages between a pair arrive in send order. Bulk tensor bytes
go through shared memory on one node, a lazily created gloo (CPU) or NCCL (CUDA)
process group per direction across nodes, or CUDA IPC on the same GPU.

Security. The listener is bound to the address Ray uses for the node
(``ray.util.get_node_ip_address()``), never to all interfaces, on a random ephemeral port
announced in Ray's KV store (namespace ``phalanx_comm``, key ``ep/<name>``). Every
connection first passes the HMAC challenge-response of ``comm/auth.py`` with the Ray
session's secret; a connection that fails it is closed before anything it sent is
unpickled. Frames are a fixed binary header (``<QQ``: metadata length, inline bytes)
followed by the metadata, which is unpickled only on an authenticated connection; the
``hello`` that names the connecting endpoint is JSON. A ``"pg"`` message (join a TCP store
to build a process group) comes only over an authenticated connection and only for a
store on the sending peer's own announced address.

Liveness. Each endpoint announces an incarnation (actor id, pid and a random id). A peer
that exits closes its sockets, which fails the operations waiting on it at once; a monitor
thread also probes peers with pending operations every ``peer_check_interval_s``: a peer
that is dead, that does not answer for ``peer_timeout_s``, or whose actor now is another
incarnation (it was restarted under the same name) fails those operations with a
``PeerDiedError`` naming it. A receive binds to the incarnation alive when it is posted,
so a sender killed and restarted while a ``recv`` waits is reported, and later receives
wait on the new incarnation. Connecting fails at once when the peer is dead and waits at
most ``connect_timeout_s`` (default 30 s) for a live peer to announce its endpoint.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import json
import logging
import os
import pickle
import select
import socket
import struct
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from phalanx.comm import auth, cuda_ipc, shm
from phalanx.comm.buffers import BufferPool
from phalanx.comm.config import CONFIG
from phalanx.comm.errors import AuthenticationError, CommError, PeerDiedError, PeerNotFoundError
from phalanx.comm.process_group import host_store, join_store, make_process_group
from phalanx.comm.wire import CUDA_IPC, GLOO, INLINE, NCCL, SHM, Outgoing, decode, select_transport
from phalanx.comm.work import Work

logger = logging.getLogger(__name__)

KV_NAMESPACE = "phalanx_comm"
ACTOR_NAMESPACE = "phalanx"
DRIVER_PREFIX = "px-driver-"
_PREFIX = struct.Struct("<QQ")  # meta length, inline bytes length
_HELLO_LEN = struct.Struct("<I")  # length of the JSON hello that follows the handshake
_MAX_HELLO = 1 << 16
_MAX_IOV = 512

# A process of a peer: (Ray actor id, pid). A pid of None means "any process of that actor".
Ident = tuple[str, "int | None"]


@dataclass
class PeerInfo:
    """How to reach an endpoint, announced in Ray's KV store (as JSON)."""

    name: str
    incarnation: str
    ip: str
    port: int
    node_id: str
    pid: int
    is_actor: bool
    gpu_uuids: list[str] = field(default_factory=list)
    actor_id: str = ""

    @property
    def ident(self) -> Ident:
        return (self.actor_id, self.pid)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PeerInfo:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise ValueError("a peer description must be a JSON object")
        return cls(**fields)


def _same_process(a: Ident, b: Ident) -> bool:
    """Whether two identities can be the same process (an unknown pid matches any)."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def _kv_key(name: str) -> bytes:
    return f"ep/{name}".encode()


def _kv_get(name: str) -> PeerInfo | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_kv_key(name), namespace=KV_NAMESPACE)
    return PeerInfo.from_json(raw) if raw else None


def _gpu_uuids() -> list[str]:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return [
                str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())
            ]
    except Exception:  # noqa: BLE001 - no usable CUDA
        pass
    return []


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    n = 0
    total = view.nbytes
    while n < total:
        got = sock.recv_into(view[n:], min(total - n, 1 << 26))
        if got == 0:
            raise ConnectionError("connection closed by peer")
        n += got


def _send_views(sock: socket.socket, views: list[memoryview], check: Callable[[], None]) -> None:
    """Send all views in order; between partial sends ``check`` may raise (peer dead)."""
    views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views if v.nbytes]
    while views:
        try:
            sent = sock.sendmsg(views[:_MAX_IOV])
        except TimeoutError:
            check()
            continue
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def _torch():
    import torch

    return torch


def _dtype(name: str) -> Any:
    return getattr(_torch(), name)


def _flat_u8(t: Any) -> Any:
    return t.reshape(-1).view(_torch().uint8)


def blob_bytes(b: Any) -> Any:
    """A blob's bytes as a flat uint8 tensor (a tensor's storage or a pickle buffer)."""
    return _flat_u8(b.data) if b.is_tensor else _torch().frombuffer(b.data, dtype=_torch().uint8)


def same_node_shm(b: Any) -> bool:
    """Whether blob ``b`` travels through shared memory to a peer on this node."""
    return (
        select_transport(b.device, b.nbytes, same_node=True, same_gpu=False, config=CONFIG) == SHM
    )


def _mv(t: Any) -> memoryview:
    """A writable/readable byte view of a contiguous CPU tensor."""
    return memoryview(_flat_u8(t).numpy())


class _Claim:
    __slots__ = ("kind", "buffer", "future")

    def __init__(self, kind: str, buffer: Any):
        self.kind = kind
        self.buffer = buffer
        self.future: concurrent.futures.Future = concurrent.futures.Future()


class _Inbox:
    """Messages from one peer, numbered in arrival order; receives claim numbers in order."""

    def __init__(self, ep: Endpoint, peer: str):
        self.ep = ep
        self.peer = peer
        self.cv = threading.Condition()
        self.claims: dict[int, _Claim] = {}
        self.arrived: dict[int, tuple[bool, Any]] = {}
        self.next_claim = 0
        self.next_msg = 0
        self.handler: Callable[[str, Any], None] | None = None
        self.error: CommError | None = None
        self.sock: socket.socket | None = None
        self.info: PeerInfo | None = None
        self.pgs: dict[str, Any] = {}
        self.segments = shm.SegmentReader()
        self.buffers = BufferPool(CONFIG.pool_slots, CONFIG.pool_bytes)
        self.has_pending: Callable[[], bool] | None = None  # handler mode: is anyone waiting?
        # The incarnation of the peer that pending receives wait on, set when the first of
        # them is posted: from the live connection, or from a ping sent at that moment
        # (``probe``: actor id and the ping's ref, resolved by the monitor thread).
        self.bound: Ident | None = None
        self.probe: tuple[str, Any] | None = None

    # -- receiving side (user threads) --------------------------------------------
    def needs_probe(self) -> bool:
        """True when a receive posted now could not name the peer's incarnation by itself."""
        with self.cv:
            return self.handler is None and not self.claims and not self._connected()

    def _connected(self) -> bool:
        return self.sock is not None and self.error is None and self.info is not None

    def claim(
        self, kind: str, buffer: Any = None, probe: tuple[str, Any] | None = None
    ) -> concurrent.futures.Future:
        with self.cv:
            if self.handler is not None:
                raise CommError(
                    self.peer, f"messages from {self.peer} are consumed by a channel client"
                )
            idx = self.next_claim
            self.next_claim += 1
            claim = _Claim(kind, buffer)
            if idx in self.arrived:
                ok, value = self.arrived.pop(idx)
                self._resolve(claim, ok, value)
                return claim.future
            if not self.claims:  # idle -> waiting: bind to the incarnation alive now
                if self._connected():
                    self.bound, self.probe = self.info.ident, None
                else:
                    self.bound, self.probe = None, probe
            # A failure reported earlier concerned the incarnation it was about; a receive
            # posted now waits on the current one (the monitor fails it if that is dead).
            self.error = None
            self.claims[idx] = claim
            self.cv.notify_all()
            return claim.future

    def cancel(self, future: concurrent.futures.Future) -> bool:
        """Withdraw the most recent receive if still unmatched (a sync receive that timed out)."""
        with self.cv:
            idx = self.next_claim - 1
            claim = self.claims.get(idx)
            if claim is None or claim.future is not future or future.done():
                return False
            del self.claims[idx]
            self.next_claim -= 1
            return True

    def pending(self) -> bool:
        if self.has_pending is not None and self.has_pending():
            return True
        with self.cv:
            return bool(self.claims)

    @staticmethod
    def _resolve(claim: _Claim, ok: bool, value: Any) -> None:
        if not ok:
            claim.future.set_exception(value)
            return
        if claim.kind == "tensor" and value is not claim.buffer:
            buf = claim.buffer
            torch = _torch()
            if not isinstance(value, torch.Tensor):
                claim.future.set_exception(
                    ValueError(
                        f"recv_tensor: the message is a {type(value).__name__}, not a tensor"
                    )
                )
                return
            if value.dtype != buf.dtype or value.numel() != buf.numel():
                claim.future.set_exception(_mismatch(buf, value.dtype, tuple(value.shape)))
                return
            buf.copy_(value.view(buf.shape))
            value = buf
        claim.future.set_result(value)

    # -- reader thread ------------------------------------------------------------------
    def deliver(self, ok: bool, value: Any) -> None:
        with self.cv:
            idx = self.next_msg
            self.next_msg += 1
            handler = self.handler
            if handler is None:
                claim = self.claims.pop(idx, None)
                if claim is None:
                    self.arrived[idx] = (ok, value)
                    return
        if handler is not None:
            try:
                handler(self.peer, value)
            except Exception:  # noqa: BLE001 - a handler bug must not kill the reader
                logger.exception("message handler for %s failed", self.peer)
            return
        self._resolve(claim, ok, value)

    def wait_claim(self) -> _Claim | None:
        """The claim of the next message (blocks until posted); None in handler mode."""
        with self.cv:
            while True:
                if self.handler is not None:
                    return None
                if self.next_msg in self.claims:
                    return self.claims[self.next_msg]
                if self.error is not None or self.ep.closed:
                    raise self.error or CommError(self.peer, "endpoint closed")
                self.cv.wait(1.0)

    def fail(self, err: CommError) -> None:
        with self.cv:
            self.error = err
            claims, self.claims = self.claims, {}
            if claims:  # failed receives consumed no message: the next one takes the next
                self.next_claim = self.next_msg
            self.bound, self.probe = None, None
            self.cv.notify_all()
        for c in claims.values():
            if not c.future.done():
                c.future.set_exception(err)
        if self.handler is not None:
            try:
                self.handler(self.peer, err)
            except Exception:  # noqa: BLE001
                logger.exception("message handler for %s failed", self.peer)

    def attach(self, sock: socket.socket, info: PeerInfo) -> None:
        with self.cv:
            old = self.sock
            if self.info is not None and self.info.incarnation != info.incarnation:
                self.pgs = {}
                self.segments.clear()
            self.sock, self.info, self.error = sock, info, None
            self.cv.notify_all()
        if old is not None and old is not sock:
            _close(old)


def _new_pool() -> shm.SegmentPool:
    return shm.SegmentPool(max_slots=CONFIG.pool_slots, max_bytes=CONFIG.pool_bytes)


def _mismatch(buf: Any, dtype: Any, shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"recv_tensor: buffer is {tuple(buf.shape)} {buf.dtype}, the sender sent {shape} {dtype}"
    )


def _closed_by_peer(sock: socket.socket, poller: Any) -> bool:
    """True when the peer closed this outgoing connection (it never writes to it).

    ``poller``: a ``select.poll`` with ``sock`` registered for reading (one syscall here).
    """
    try:
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def _close(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _OutConn:
    """The connection this endpoint opened to one peer; sends run in posting order."""

    def __init__(self, ep: Endpoint, peer: str):
        self.ep = ep
        self.peer = peer
        self.cv = threading.Condition()
        self.queue: deque[tuple[Outgoing, concurrent.futures.Future]] = deque()
        self.busy = False
        self.thread: threading.Thread | None = None
        self.sock: socket.socket | None = None
        self.info: PeerInfo | None = None
        self.pgs: dict[str, Any] = {}
        self.pool = _new_pool()
        self.poller: Any = None  # select.poll of ``sock``: did the peer close it?
        self.lock = threading.Lock()  # guards sock/info setup

    def submit(self, msg: Outgoing, async_op: bool) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            inline = not async_op and not self.busy and not self.queue
            if inline:
                self.busy = True
            else:
                self.queue.append((msg, fut))
                if self.thread is None or not self.thread.is_alive():
                    self.thread = threading.Thread(
                        target=self._drain, name=f"px-send-{self.peer}", daemon=True
                    )
                    self.thread.start()
                else:
                    self.cv.notify_all()
        if inline:
            try:
                self._run(msg, fut)
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()
        return fut

    def pending(self) -> bool:
        with self.cv:
            return self.busy or bool(self.queue)

    def _drain(self) -> None:
        while True:
            with self.cv:
                while self.busy or not self.queue:
                    if not self.cv.wait(30.0) and not self.queue and not self.busy:
                        self.thread = None
                        return
                msg, fut = self.queue.popleft()
                self.busy = True
            try:
                self._run(msg, fut)
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()

    def _run(self, msg: Outgoing, fut: concurrent.futures.Future) -> None:
        try:
            self.ep._send_message(self, msg)
        except BaseException as e:  # noqa: BLE001 - reported through the future
            if isinstance(e, (OSError, ConnectionError, RuntimeError)) and not isinstance(
                e, CommError
            ):
                err = self.ep._broken(self.peer, e)
                fut.set_exception(err)
            else:
                fut.set_exception(e)
            return
        fut.set_result(None)

    def fail(self, err: CommError) -> None:
        with self.cv:
            queued, self.queue = list(self.queue), deque()
        for _, fut in queued:
            if not fut.done():
                fut.set_exception(err)
        with self.lock:
            self.reset()

    def reset(self) -> None:
        """Drop the connection and what belongs to it (the caller holds ``lock``)."""
        _close(self.sock)
        self.sock = None
        self.poller = None
        self.pgs = {}
        self.pool.close()
        self.pool = _new_pool()


class Endpoint:
    """This process's communication endpoint (see the module docstring)."""

    def __init__(self, name: str):
        if not ray.is_initialized():
            raise RuntimeError("phalanx communication needs Ray: create a px.Cluster() first")
        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
        self.name = name
        self.closed = False
        self.job_id = ""
        self._secret = auth.cluster_secret()
        ip = ray.util.get_node_ip_address()  # the node's address as Ray uses it; never 0.0.0.0
        self._listener = socket.create_server((ip, 0), backlog=256)
        self.info = PeerInfo(
            name=name,
            incarnation=f"{actor_id or '-'}/{os.getpid()}/{uuid.uuid4().hex}",
            ip=ip,
            port=self._listener.getsockname()[1],
            node_id=ctx.get_node_id(),
            pid=os.getpid(),
            is_actor=actor_id is not None,
            gpu_uuids=_gpu_uuids(),
            actor_id=actor_id or "",
        )
        self._lock = threading.RLock()
        self._out: dict[str, _OutConn] = {}
        self._in: dict[str, _Inbox] = {}
        self._actors: dict[str, Any] = {}
        self._last_ok: dict[str, float] = {}
        self.default_handler: Callable[[str, Any], None] | None = None
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(
            _kv_key(name), self.info.to_json(), overwrite=True, namespace=KV_NAMESPACE
        )
        threading.Thread(target=self._accept_loop, name="px-accept", daemon=True).start()
        threading.Thread(target=self._monitor_loop, name="px-monitor", daemon=True).start()

    # ------------------------------------------------------------------ public
    def send(self, peer: str, msg: Outgoing, async_op: bool = False) -> Work:
        fut = self._out_conn(peer).submit(msg, async_op)
        work = Work(f"send of {msg.desc} to {peer}", fut)
        if not async_op:
            work.wait()
        return work

    def recv(self, peer: str, kind: str = "obj", buffer: Any = None) -> Work:
        box = self.inbox(peer)
        fut = box.claim(kind, buffer, self._probe_for(box))
        return Work(f"recv from {peer}", fut)

    def recv_now(
        self, peer: str, timeout: float | None, kind: str = "obj", buffer: Any = None
    ) -> Any:
        """A blocking receive; on timeout it is withdrawn, so the message goes to the next receive."""
        box = self.inbox(peer)
        fut = box.claim(kind, buffer, self._probe_for(box))
        try:
            return Work(f"recv from {peer}", fut).wait(timeout)
        except TimeoutError:
            if box.cancel(fut):
                raise
            return fut.result()

    def inbox(self, peer: str) -> _Inbox:
        with self._lock:
            box = self._in.get(peer)
            if box is None:
                box = self._in[peer] = _Inbox(self, peer)
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
        return _kv_get(peer)

    def peer_info(self, peer: str) -> PeerInfo | None:
        conn = self._out.get(peer)
        return conn.info if conn is not None else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        err = CommError(self.name, "endpoint closed")
        _close(self._listener)
        for conn in list(self._out.values()):
            conn.fail(err)
        for box in list(self._in.values()):
            _close(box.sock)
            box.fail(err)
        try:
            from ray.experimental import internal_kv

            if ray.is_initialized():
                cur = _kv_get(self.name)
                if cur is not None and cur.incarnation == self.info.incarnation:
                    internal_kv._internal_kv_del(_kv_key(self.name), namespace=KV_NAMESPACE)
        except Exception:  # noqa: BLE001 - Ray may be shutting down
            pass
        shm.cleanup_created()

    # ------------------------------------------------------------------ peers
    def check_peer_exists(self, peer: str) -> None:
        """Raise ``PeerNotFoundError`` naming ``peer`` when no such worker/channel exists."""
        if peer == self.name:
            return
        if peer.startswith(DRIVER_PREFIX):
            if _kv_get(peer) is None:
                raise PeerNotFoundError(peer, f"no endpoint named {peer!r}")
            return
        self._actor(peer)

    def _actor(self, peer: str) -> Any:
        actor = self._actors.get(peer)
        if actor is None:
            try:
                actor = ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
            except ValueError:
                raise PeerNotFoundError(peer, _not_found_text(peer)) from None
            self._actors[peer] = actor
        return actor

    def _broken(self, peer: str, exc: BaseException) -> CommError:
        """Turn a transport failure into a ``PeerDiedError`` and fail the pair's pending work."""
        err = PeerDiedError(peer, f"connection to {peer} failed: {type(exc).__name__}: {exc}")
        self._peer_dead(peer, err)
        return err

    def _peer_dead(self, peer: str, err: CommError) -> None:
        self._actors.pop(peer, None)
        conn = self._out.get(peer)
        if conn is not None:
            conn.fail(err)
        box = self._in.get(peer)
        if box is not None:
            _close(box.sock)
            box.fail(err)

    def _incarnation_gone(self, peer: str, gone: Ident, err: CommError) -> None:
        """Fail what is bound to the process ``gone`` of ``peer``; leave a newer one alone."""
        self._actors.pop(peer, None)
        conn = self._out.get(peer)
        if conn is not None and conn.info is not None and _same_process(conn.info.ident, gone):
            conn.fail(err)
        box = self._in.get(peer)
        if box is None:
            return
        with box.cv:
            stale_sock = box.info is not None and _same_process(box.info.ident, gone)
            bound_here = box.bound is None or _same_process(box.bound, gone)
            waiting = bool(box.claims) or box.handler is not None
        if stale_sock:
            _close(box.sock)
        if waiting and (bound_here or stale_sock):
            box.fail(err)

    def _probe_for(self, box: _Inbox) -> tuple[str, Any] | None:
        """Name the peer's incarnation for a receive posted now (slow path: no connection).

        Sends a ping to the actor registered under the peer's name now; the monitor reads
        its answer. Raises ``PeerDiedError`` when no actor has that name any more.
        """
        peer = box.peer
        if peer.startswith(DRIVER_PREFIX) or peer == self.name or not box.needs_probe():
            return None
        try:
            actor = ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
        except ValueError:
            raise PeerDiedError(peer, f"peer {peer} is dead (no live actor of that name)") from None
        return actor._actor_id.hex(), actor._px_ping.remote()

    def _live_ident(self, peer: str, timeout: float) -> Ident:
        """The (actor id, pid) of the actor registered as ``peer`` now; ``PeerDiedError`` if none."""
        try:
            actor = ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
        except ValueError:
            raise PeerDiedError(peer, f"peer {peer} is dead (no live actor of that name)") from None
        try:
            pid = ray.get(actor._px_ping.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise PeerDiedError(
                peer, f"peer {peer} did not answer a liveness probe in {timeout}s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            raise PeerDiedError(peer, f"peer {peer} died: {str(e).splitlines()[0]}") from None
        return actor._actor_id.hex(), pid

    def _check_alive(self, peer: str) -> None:
        """Raise ``PeerDiedError`` if Ray says ``peer``'s actor is dead or gone."""
        if peer.startswith(DRIVER_PREFIX) or peer == self.name:
            return
        self._live_ident(peer, CONFIG.peer_timeout_s)

    def _monitor_loop(self) -> None:
        """Probe peers that pending operations wait on; fail those that died or restarted."""
        inflight: dict[str, tuple[str, Any, float]] = {}
        while not self.closed:
            time.sleep(CONFIG.peer_check_interval_s)
            with self._lock:
                waiting = {p for p, b in self._in.items() if b.pending()}
                waiting |= {p for p, c in self._out.items() if c.pending()}
            now = time.monotonic()
            for peer in waiting:
                if peer.startswith(DRIVER_PREFIX) or peer == self.name:
                    continue
                try:
                    self._probe_step(peer, inflight, now)
                except Exception:  # noqa: BLE001 - Ray shutting down, keep going
                    logger.debug("liveness probe of %s failed", peer, exc_info=True)
            for peer in list(inflight):
                if peer not in waiting:
                    del inflight[peer]

    def _probe_step(
        self, peer: str, inflight: dict[str, tuple[str, Any, float]], now: float
    ) -> None:
        """One monitor round for ``peer``: resolve the receive-time probe, compare incarnations."""
        box = self._in.get(peer)
        probe = box.probe if box is not None else None
        if probe is not None:
            aid, ref = probe
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                with box.cv:
                    if box.probe is probe:
                        box.probe = None
                try:
                    pid = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                    err = PeerDiedError(peer, f"peer {peer} died: {str(e).splitlines()[0]}")
                    self._incarnation_gone(peer, (aid, None), err)
                    return
                with box.cv:
                    if box.bound is None and box.claims:
                        box.bound = (aid, pid)
        entry = inflight.get(peer)
        if entry is None:
            try:
                actor = ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
            except ValueError:
                err = PeerDiedError(peer, f"peer {peer} is dead (no live actor of that name)")
                self._peer_dead(peer, err)
                return
            inflight[peer] = (actor._actor_id.hex(), actor._px_ping.remote(), now)
            return
        aid, ref, sent = entry
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            if now - sent > CONFIG.peer_timeout_s:
                del inflight[peer]
                err = PeerDiedError(
                    peer, f"peer {peer} did not answer a liveness probe in {CONFIG.peer_timeout_s}s"
                )
                self._incarnation_gone(peer, (aid, None), err)
            return
        del inflight[peer]
        try:
            pid = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            err = PeerDiedError(peer, f"peer {peer} died: {str(e).splitlines()[0]}")
            self._incarnation_gone(peer, (aid, None), err)
            return
        self._check_incarnation(peer, (aid, pid))

    def _check_incarnation(self, peer: str, live: Ident) -> None:
        """Fail operations bound to an incarnation of ``peer`` other than ``live`` (a restart)."""
        stale: set[Ident] = set()
        conn = self._out.get(peer)
        if conn is not None and conn.info is not None and not _same_process(conn.info.ident, live):
            stale.add(conn.info.ident)
        box = self._in.get(peer)
        if box is not None:
            with box.cv:
                if box.bound is not None and not _same_process(box.bound, live):
                    stale.add(box.bound)
                if box.info is not None and not _same_process(box.info.ident, live):
                    stale.add(box.info.ident)
        for gone in stale:
            err = PeerDiedError(
                peer,
                f"peer {peer} died and was restarted (process {gone[1]} of actor "
                f"{gone[0][:12]} is gone; now process {live[1]}): its pending messages are lost",
            )
            self._incarnation_gone(peer, gone, err)

    # ------------------------------------------------------------------ outgoing
    def _out_conn(self, peer: str) -> _OutConn:
        with self._lock:
            conn = self._out.get(peer)
            if conn is None:
                conn = self._out[peer] = _OutConn(self, peer)
            return conn

    def _connect(self, conn: _OutConn) -> None:
        """Open and authenticate the connection to ``conn.peer``.

        Fails at once (``PeerDiedError``) when the peer is dead; waits at most
        ``connect_timeout_s`` for a live peer to announce its current endpoint.
        """
        peer = conn.peer
        info = self._await_endpoint(peer)
        try:
            sock = socket.create_connection((info.ip, info.port), timeout=30)
        except OSError as e:
            raise PeerDiedError(
                peer, f"could not connect to {peer} at {info.ip}:{info.port}: {e}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            auth.client_handshake(sock, self._secret, peer)
            hello = self.info.to_json()
            sock.sendall(_HELLO_LEN.pack(len(hello)) + hello)
        except BaseException:
            _close(sock)
            raise
        sock.settimeout(CONFIG.peer_check_interval_s)
        conn.poller = select.poll()
        conn.poller.register(sock, select.POLLIN)
        conn.sock, conn.info, conn.pgs = sock, info, {}

    def _await_endpoint(self, peer: str) -> PeerInfo:
        """The announced endpoint of the live incarnation of ``peer`` (see ``_connect``)."""
        deadline = time.monotonic() + CONFIG.connect_timeout_s
        is_driver = peer.startswith(DRIVER_PREFIX)
        probe: tuple[str, Any, float] | None = None
        live: Ident | None = None
        delay = 0.001
        while True:
            info = _kv_get(peer)
            if info is not None and (not info.is_actor or is_driver):
                return info
            if info is None and is_driver:
                raise PeerNotFoundError(peer, f"no endpoint named {peer!r}")
            now = time.monotonic()
            if probe is None:
                try:
                    actor = ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
                except ValueError:
                    raise PeerDiedError(
                        peer, f"peer {peer} is dead (no live actor of that name)"
                    ) from None
                probe = (actor._actor_id.hex(), actor._px_ping.remote(), now)
            aid, ref, sent = probe
            # A live actor answers within milliseconds: block briefly on the first answer.
            ready, _ = ray.wait([ref], timeout=0 if live is not None else 0.2)
            if ready:
                try:
                    live = (aid, ray.get(ref))
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                    raise PeerDiedError(
                        peer, f"peer {peer} died: {str(e).splitlines()[0]}"
                    ) from None
                if now - sent > CONFIG.peer_check_interval_s:
                    probe = None  # ask again: the actor may die or be replaced while we wait
            elif now - sent > CONFIG.peer_timeout_s:
                raise PeerDiedError(
                    peer, f"peer {peer} did not answer a liveness probe in {CONFIG.peer_timeout_s}s"
                )
            if live is not None and info is not None and _same_process(info.ident, live):
                return info
            if now > deadline:
                raise CommError(
                    peer,
                    f"{peer} is alive but did not announce its communication endpoint within "
                    f"{CONFIG.connect_timeout_s}s (PHALANX_COMM_CONNECT_TIMEOUT_S)",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def is_current(self, peer: str, incarnation: str) -> bool:
        """Whether ``incarnation`` is the endpoint ``peer`` announces now (not a dead one)."""
        cur = _kv_get(peer)
        if cur is None or cur.incarnation != incarnation:
            return False
        if not cur.is_actor:
            return True
        try:
            actor = ray.get_actor(peer, namespace=ACTOR_NAMESPACE)
        except ValueError:
            return False
        return actor._actor_id.hex() == cur.actor_id

    def _send_message(self, conn: _OutConn, msg: Outgoing) -> None:
        with conn.lock:
            if conn.sock is not None and _closed_by_peer(conn.sock, conn.poller):
                conn.reset()  # that incarnation is gone: this message goes to the current one
            if conn.sock is None:
                self._connect(conn)
        sock, info = conn.sock, conn.info
        same_node = info.node_id == self.info.node_id
        check = lambda: self._check_alive(conn.peer)  # noqa: E731
        specs, inline, bulk, shm_blobs, shm_index = [], [], [], [], []
        blobs = [dataclasses.replace(b) for b in msg.blobs]  # one message may go to many peers
        for i, b in enumerate(blobs):
            same_gpu = False
            if b.device == "cuda" and same_node:
                uuid_ = str(_torch().cuda.get_device_properties(b.data.device).uuid)
                same_gpu = uuid_ in info.gpu_uuids
            b.transport = select_transport(
                b.device, b.nbytes, same_node=same_node, same_gpu=same_gpu, config=CONFIG
            )
            if b.transport == SHM:
                shm_blobs.append(b)
                shm_index.append(i)
        segment = None
        shared = msg.shared.get(conn.peer)
        if shared is not None and (not same_node or not all(i in shared[1] for i in shm_index)):
            shm.unlink(shared[0].path)  # written for a same-node peer that this is not
            shared = None
        if shm_blobs and shared is not None:  # one copy written for several readers
            segment = shared[0]
            for i, b in zip(shm_index, shm_blobs):
                b.extra = shared[1][i]
        elif shm_blobs:
            try:
                flat = [blob_bytes(b) for b in shm_blobs]
                segment, offsets = conn.pool.write(flat)
                for b, off in zip(shm_blobs, offsets):
                    b.extra = off
            except OSError:
                for b in shm_blobs:
                    b.transport = INLINE if b.nbytes <= CONFIG.inline_max_bytes else GLOO
        inline_len = 0
        for b in blobs:
            if b.transport == INLINE:
                inline.append(_mv(b.data) if b.is_tensor else b.data)
                inline_len += b.nbytes
            elif b.transport in (GLOO, NCCL):
                bulk.append(b)
            elif b.transport == CUDA_IPC:
                b.extra = cuda_ipc.share_copy(b.data)
            specs.append(b.spec())
        for backend in {b.transport for b in bulk}:
            if backend not in conn.pgs:
                self._init_pg(conn, backend, check)
        meta = pickle.dumps((msg.kind, msg.skeleton, specs, segment))
        views = [memoryview(_PREFIX.pack(len(meta), inline_len)), memoryview(meta), *inline]
        _send_views(sock, views, check)
        for b in bulk:
            pg = conn.pgs[b.transport]
            data = b.data if b.is_tensor else _torch().frombuffer(b.data, dtype=_torch().uint8)
            work = pg.send([_flat_u8(data) if b.transport == GLOO else data], 1, 0)
            if b.transport == GLOO:
                self._wait_bulk(conn, info, work)
            else:
                work.wait()

    def _wait_bulk(self, conn: _OutConn, info: PeerInfo, work: Any) -> None:
        """Wait for a gloo send, failing it if the receiving process dies meanwhile.

        Gloo does not notice a receiver killed mid-transfer (its wait would block for the
        process group's 30 min timeout), and a timed gloo wait breaks the pair, so the
        wait runs in a helper thread while this one checks the peer every
        ``peer_check_interval_s``. On a death the helper thread and the process group are
        abandoned with the connection (the next send opens new ones).
        """
        done = threading.Event()
        failure: list[BaseException] = []

        def wait() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the sending thread
                failure.append(e)
            finally:
                done.set()

        threading.Thread(target=wait, name=f"px-bulk-{conn.peer}", daemon=True).start()
        while not done.wait(CONFIG.peer_check_interval_s):
            try:
                live = self._live_ident(conn.peer, CONFIG.peer_timeout_s)
                if not _same_process(info.ident, live):
                    raise PeerDiedError(
                        conn.peer,
                        f"peer {conn.peer} died and was restarted during a send to it",
                    )
            except PeerDiedError as err:
                if not done.is_set():
                    self._incarnation_gone(conn.peer, info.ident, err)
                    raise
        if failure:
            raise failure[0]

    def _init_pg(self, conn: _OutConn, backend: str, check: Callable[[], None]) -> None:
        """Create the process group of this direction (this side is rank 0 and hosts the store)."""
        store = host_store(self.info.ip, CONFIG.connect_timeout_s)
        key = f"{self.name}->{conn.peer}/{backend}/{uuid.uuid4().hex}"
        meta = pickle.dumps(("pg", key, [], (backend, self.info.ip, store.port)))
        _send_views(conn.sock, [memoryview(_PREFIX.pack(len(meta), 0)), memoryview(meta)], check)
        conn.pgs[backend] = _make_pg(backend, store, key, 0, self.info.ip)
        conn.pgs[backend + "_store"] = store

    # ------------------------------------------------------------------ incoming
    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="px-recv", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not auth.server_handshake(sock, self._secret):
            logger.warning("phalanx endpoint %s: refused an unauthenticated connection", self.name)
            _close(sock)
            return
        try:
            sock.settimeout(auth.HANDSHAKE_TIMEOUT_S)
            head = bytearray(_HELLO_LEN.size)
            _recv_exact(sock, memoryview(head))
            (size,) = _HELLO_LEN.unpack(head)
            if size > _MAX_HELLO:
                raise ValueError(f"hello of {size} bytes")
            hello = bytearray(size)
            _recv_exact(sock, memoryview(hello))
            info = PeerInfo.from_json(bytes(hello))
            sock.settimeout(None)
        except (OSError, ConnectionError, ValueError, TypeError):
            _close(sock)
            return
        box = self.inbox(info.name)
        box.attach(sock, info)
        try:
            while not self.closed:
                self._read_message(box, sock, info)
        except Exception as e:  # noqa: BLE001 - any reader failure breaks this connection
            if box.sock is sock and not self.closed:
                err = (
                    e
                    if isinstance(e, CommError)
                    else PeerDiedError(
                        info.name, f"connection from {info.name} broke: {type(e).__name__}: {e}"
                    )
                )
                self._actors.pop(info.name, None)
                box.fail(err)
            _close(sock)

    def _read_message(self, box: _Inbox, sock: socket.socket, info: PeerInfo) -> None:
        prefix = bytearray(_PREFIX.size)
        _recv_exact(sock, memoryview(prefix))
        meta_len, inline_len = _PREFIX.unpack(prefix)
        meta = bytearray(meta_len)
        _recv_exact(sock, memoryview(meta))
        kind, skeleton, specs, segment = pickle.loads(meta)
        if kind == "pg":
            backend, ip, port = segment
            if ip != info.ip:  # only a store on the authenticated peer's own address
                raise AuthenticationError(
                    info.name,
                    f"{info.name} asked to join a store at {ip}, not at its own {info.ip}",
                )
            store = join_store(ip, port, CONFIG.connect_timeout_s)
            box.pgs[backend] = _make_pg(backend, store, skeleton, 1, self.info.ip)
            box.pgs[backend + "_store"] = store
            return
        seg = box.segments.open(segment) if segment is not None else None
        if kind == "raw":
            self._read_raw(box, sock, specs[0], seg)
            return
        values, error = [], None
        for spec in specs:
            try:
                values.append(self._read_blob(box, sock, spec, seg, None))
            except (OSError, ConnectionError):
                raise
            except Exception as e:  # noqa: BLE001 - e.g. CUDA IPC unusable here
                error = error or e
                values.append(None)
        if error is None:
            try:
                value = decode(skeleton, values, specs)
            except Exception as e:  # noqa: BLE001 - e.g. a class this process cannot import
                error = e
        if error is not None:
            box.deliver(
                False,
                CommError(
                    info.name,
                    f"could not rebuild the message from {info.name}: {type(error).__name__}: {error}",
                ),
            )
        else:
            box.deliver(True, value)

    def _read_raw(self, box: _Inbox, sock: socket.socket, spec: tuple, seg: Any) -> None:
        _, _, dtype, shape, _, _, _ = spec
        claim = box.wait_claim()
        buf = None
        mismatch = None
        if claim is not None and claim.kind == "tensor":
            buf = claim.buffer
            numel = 1
            for s in shape:
                numel *= s
            if buf.dtype != _dtype(dtype) or buf.numel() != numel:
                mismatch = _mismatch(buf, _dtype(dtype), shape)
                buf = None
        value = self._read_blob(box, sock, spec, seg, buf)
        if mismatch is not None:
            box.deliver(False, mismatch)
        else:
            box.deliver(True, value)

    def _read_blob(self, box: _Inbox, sock: socket.socket, spec: tuple, seg: Any, into: Any) -> Any:
        """Receive one blob; into ``into`` (a tensor of matching dtype/numel) when given."""
        is_tensor, transport, dtype, shape, nbytes, device, extra = spec
        torch = _torch() if (is_tensor or transport != INLINE) else None
        if transport == INLINE:
            if not is_tensor:
                out = bytearray(nbytes)
                _recv_exact(sock, memoryview(out))
                return out
            dest = (
                into
                if into is not None and into.device.type == "cpu"
                else torch.empty(shape, dtype=_dtype(dtype))
            )
            _recv_exact(sock, _mv(dest))
            if into is not None and dest is not into:
                into.copy_(dest.view(into.shape))
                return into
            return dest
        if transport == SHM:
            if not is_tensor:
                return memoryview(seg[extra : extra + nbytes].numpy())
            view = shm.view_as(seg, extra, _dtype(dtype), shape)
            if into is not None:
                into.copy_(view.view(into.shape))
                return into
            return view
        if transport == CUDA_IPC:
            shared = cuda_ipc.open_handle(extra)
            if into is not None:
                into.copy_(shared.view(into.shape))
                return into
            return shared
        pg = box.pgs.get(transport)
        if pg is None:
            raise CommError(box.peer, f"no {transport} process group from {box.peer}")
        if transport == GLOO:
            if into is not None and into.device.type == "cpu":
                dest = into
            else:
                dest = box.buffers.take(nbytes)
                if is_tensor:
                    dest = dest.view(_dtype(dtype)).view(shape)
            pg.recv([_flat_u8(dest)], 0, 0).wait()
        else:  # NCCL
            dest = (
                into
                if into is not None
                else torch.empty(
                    shape, dtype=_dtype(dtype), device=f"cuda:{torch.cuda.current_device()}"
                )
            )
            pg.recv([dest], 0, 0).wait()
        if into is not None and dest is not into:
            into.copy_(dest.view(into.shape))
            return into
        return dest if is_tensor else memoryview(dest.numpy())


def _make_pg(backend: str, store: Any, key: str, rank: int, ip: str) -> Any:
    """The two-rank process group of one direction (see ``comm/process_group.py``)."""
    timeout_s = max(CONFIG.connect_timeout_s, 1800)
    return make_process_group(backend, store, rank, 2, prefix=key, ip=ip, timeout_s=timeout_s)


def _not_found_text(peer: str) -> str:
    group, _, rank = peer.rpartition(":")
    if group and rank.isdigit():
        try:
            ray.get_actor(f"{group}:0", namespace=ACTOR_NAMESPACE)
        except ValueError:
            return f"no worker group named {group!r} (looking for worker {peer})"
        return f"worker group {group!r} has no rank {rank}"
    return f"no worker or channel named {peer!r}"


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
