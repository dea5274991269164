"""The sending half of an endpoint: one outgoing connection per peer, bulk transports.

Messages from A to B travel over a connection A opened to B and only A writes to, so the
two directions never wait on each other and no rendezvous order is needed. Sends to one
peer run in posting order. Bulk tensor bytes go through shared memory on one node, a
lazily created gloo (CPU) or NCCL (CUDA) process group per direction across nodes, or
CUDA IPC on the same GPU. Connecting fails at once when the peer is dead and waits at
most ``connect_timeout_s`` (default 30 s) for a live peer to announce its endpoint.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pickle
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from phalanx.comm import auth, cuda_ipc, shm
from phalanx.comm.config import CONFIG
from phalanx.comm.errors import CommError, PeerDiedError, PeerNotFoundError
from phalanx.comm.frames import (
    HELLO_LEN,
    close_socket,
    closed_by_peer,
    frame_views,
    send_views,
)
from phalanx.comm.peers import (
    DRIVER_PREFIX,
    Ident,
    PeerInfo,
    announced,
    no_answer,
    ping,
    ping_result,
    same_process,
)
from phalanx.comm.process_group import host_store, make_pair_group
from phalanx.comm.wire import (
    CUDA_IPC,
    GLOO,
    INLINE,
    NCCL,
    SHM,
    Outgoing,
    blob_bytes,
    byte_view,
    select_transport,
)


def _new_pool() -> shm.SegmentPool:
    return shm.SegmentPool(max_slots=CONFIG.pool_slots, max_bytes=CONFIG.pool_bytes)


class OutConn:
    """The connection this endpoint opened to one peer; sends run in posting order.

    ``run(conn, msg)`` sends one message (the endpoint's ``send_message``); ``broken(peer,
    exc)`` turns a transport failure into the error the send reports.
    """

    def __init__(
        self,
        peer: str,
        run: Callable[[OutConn, Outgoing], None],
        broken: Callable[[str, BaseException], CommError],
    ):
        self.peer = peer
        self.send_one = run
        self.broken = broken
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
            self.send_one(self, msg)
        except BaseException as e:  # noqa: BLE001 - reported through the future
            transport = isinstance(e, (OSError, ConnectionError, RuntimeError))
            fut.set_exception(
                self.broken(self.peer, e) if transport and not isinstance(e, CommError) else e
            )
            return
        fut.set_result(None)

    def fail(self, err: CommError) -> None:
        with self.cv:
            queued, self.queue = list(self.queue), deque()
        for _, fut in queued:
            if not fut.done():
                fut.set_exception(err)
        # Never wait here for a send that is connecting (the monitor calls this): close the
        # socket; that sender finds it closed and resets the connection itself.
        if self.lock.acquire(blocking=False):
            try:
                self.reset()
            finally:
                self.lock.release()
        else:
            close_socket(self.sock)

    def reset(self) -> None:
        """Drop the connection and what belongs to it (the caller holds ``lock``)."""
        close_socket(self.sock)
        self.sock = None
        self.poller = None
        self.pgs = {}
        self.pool.close()
        self.pool = _new_pool()


class Sending:
    """The sending half of ``Endpoint`` (see the module docstring)."""

    name: str
    info: PeerInfo
    secret: bytes
    lock: threading.RLock

    def __init__(self) -> None:
        self.out_conns: dict[str, OutConn] = {}

    def out_conn(self, peer: str) -> OutConn:
        with self.lock:
            conn = self.out_conns.get(peer)
            if conn is None:
                conn = self.out_conns[peer] = OutConn(peer, self.send_message, self.broken)
            return conn

    def send_message(self, conn: OutConn, msg: Outgoing) -> None:
        with conn.lock:
            if conn.sock is not None and closed_by_peer(conn.sock, conn.poller):
                conn.reset()  # that incarnation is gone: this message goes to the current one
            if conn.sock is None:
                self._connect(conn)
        sock, info = conn.sock, conn.info
        same_node = info.node_id == self.info.node_id
        check = lambda: self.check_alive(conn.peer)  # noqa: E731
        blobs = [dataclasses.replace(b) for b in msg.blobs]  # one message may go to many peers
        shm_index = []
        for i, b in enumerate(blobs):
            same_gpu = False
            if b.device == "cuda" and same_node:
                uuid_ = cuda_ipc.gpu_uuid(b.data.device)
                same_gpu = uuid_ in info.gpu_uuids
            b.transport = select_transport(
                b.device, b.nbytes, same_node=same_node, same_gpu=same_gpu, config=CONFIG
            )
            if b.transport == SHM:
                shm_index.append(i)
        segment = self._place_shm(conn, msg, blobs, shm_index, same_node)
        specs, inline, bulk = [], [], []
        for b in blobs:
            if b.transport == INLINE:
                inline.append(byte_view(b.data) if b.is_tensor else b.data)
            elif b.transport in (GLOO, NCCL):
                bulk.append(b)
            elif b.transport == CUDA_IPC:
                b.extra = cuda_ipc.share_copy(b.data)
            specs.append(b.spec())
        for backend in {b.transport for b in bulk}:
            if backend not in conn.pgs:
                self._init_pg(conn, backend, check, msg.options)
        meta = pickle.dumps((msg.kind, msg.skeleton, specs, segment))
        send_views(sock, frame_views(meta, inline), check)
        for b in bulk:
            pg = conn.pgs[b.transport]
            data = b.data if b.is_tensor and b.transport != GLOO else blob_bytes(b)
            work = pg.send([data], 1, 0)
            if b.transport == GLOO:
                self._wait_bulk(conn, info, work)
            else:
                work.wait()

    def _place_shm(
        self, conn: OutConn, msg: Outgoing, blobs: list, shm_index: list[int], same_node: bool
    ) -> Any:
        """Write the shared-memory blobs (or reuse a broadcast's copy); their segment.

        When ``/dev/shm`` cannot take them they travel inline or through gloo instead.
        """
        shared = msg.shared.get(conn.peer)
        if shared is not None and (not same_node or not all(i in shared[1] for i in shm_index)):
            shm.unlink(shared[0].path)  # written for a same-node peer that this is not
            shared = None
        if not shm_index:
            return None
        if shared is not None:  # one copy written for several readers
            for i in shm_index:
                blobs[i].extra = shared[1][i]
            return shared[0]
        try:
            segment, offsets = conn.pool.write([blob_bytes(blobs[i]) for i in shm_index])
        except OSError:
            for i in shm_index:
                blobs[i].transport = INLINE if blobs[i].nbytes <= CONFIG.inline_max_bytes else GLOO
            return None
        for i, off in zip(shm_index, offsets):
            blobs[i].extra = off
        return segment

    def _wait_bulk(self, conn: OutConn, info: PeerInfo, work: Any) -> None:
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
                live = self.live_ident(conn.peer, CONFIG.peer_timeout_s)
                if not same_process(info.ident, live):
                    raise PeerDiedError(
                        conn.peer,
                        f"peer {conn.peer} died and was restarted during a send to it",
                    )
            except PeerDiedError as err:
                if not done.is_set():
                    self.incarnation_gone(conn.peer, info.ident, err)
                    raise
        if failure:
            raise failure[0]

    def _init_pg(
        self, conn: OutConn, backend: str, check: Callable[[], None], options: Any
    ) -> None:
        """Create the process group of this direction (this side is rank 0 and hosts the store)."""
        store = host_store(self.info.ip, CONFIG.connect_timeout_s)
        key = f"{self.name}->{conn.peer}/{backend}/{uuid.uuid4().hex}"
        meta = pickle.dumps(("pg", key, [], (backend, self.info.ip, store.port, options)))
        send_views(conn.sock, frame_views(meta), check)
        conn.pgs[backend] = make_pair_group(
            backend, store, key, 0, self.info.ip, CONFIG.connect_timeout_s, options
        )
        conn.pgs[backend + "_store"] = store

    def _connect(self, conn: OutConn) -> None:
        """Open and authenticate the connection to ``conn.peer`` (see the module docstring)."""
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
            auth.client_handshake(sock, self.secret, peer)
            hello = self.info.to_json()
            sock.sendall(HELLO_LEN.pack(len(hello)) + hello)
        except BaseException:
            close_socket(sock)
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
            info = announced(peer)
            if info is not None and (not info.is_actor or is_driver):
                return info
            if info is None and is_driver:
                raise PeerNotFoundError(peer, f"no endpoint named {peer!r}")
            now = time.monotonic()
            if probe is None:
                probe = (*ping(peer), now)
            aid, ref, sent = probe
            # A live actor answers within milliseconds: block briefly on the first answer.
            ready, _ = ray.wait([ref], timeout=0 if live is not None else 0.2)
            if ready:
                live = (aid, ping_result(peer, ref))
                if now - sent > CONFIG.peer_check_interval_s:
                    probe = None  # ask again: the actor may die or be replaced while we wait
            elif now - sent > CONFIG.peer_timeout_s:
                raise no_answer(peer, CONFIG.peer_timeout_s)
            if live is not None and info is not None and same_process(info.ident, live):
                return info
            if now > deadline:
                raise CommError(
                    peer,
                    f"{peer} is alive but did not announce its communication endpoint within "
                    f"{CONFIG.connect_timeout_s}s (PHALANX_COMM_CONNECT_TIMEOUT_S)",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
