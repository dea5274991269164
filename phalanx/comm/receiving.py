"""The receiving half of an endpoint: the listener, the handshake, the reader threads.

Security. The listener is bound to the address Ray uses for the node (or to
``PHALANX_COMM_BIND_ADDRESS``, which ``px.Cluster(_node_ip_address=...)`` sets), never to
all interfaces, on a random port announced in Ray's KV store. Every connection first
passes the HMAC challenge-response of ``auth.py`` with the Ray session's secret; one that
fails it is closed before anything it sent is unpickled. At most ``max_handshakes``
connections are in their handshake at once (each gets a thread for at most the handshake
timeout); more are closed at once. Refused connections are logged at most once a minute,
with their count, so a stranger cannot flood the log. When the process runs out of file
descriptors (EMFILE/ENFILE) the listener backs off and keeps accepting.

A reader thread per authenticated connection reads frames (``frames.py``; a frame over
``max_frame_bytes`` breaks the connection) into the peer's inbox. A ``"pg"`` message (join
a TCP store to build a process group) comes only over an authenticated connection and only
for a store on the sending peer's own announced address.
"""

from __future__ import annotations

import errno
import logging
import pickle
import socket
import threading
import time
from typing import Any

from phalanx.comm import auth, cuda_ipc, shm
from phalanx.comm.config import CONFIG
from phalanx.comm.errors import AuthenticationError, CommError, PeerDiedError
from phalanx.comm.frames import (
    HELLO_LEN,
    MAX_HELLO,
    PREFIX,
    check_frame,
    close_socket,
    recv_bytes,
    recv_exact,
)
from phalanx.comm.inbox import Inbox, mismatch
from phalanx.comm.peers import PeerInfo
from phalanx.comm.process_group import join_store, make_pair_group
from phalanx.comm.wire import (
    CUDA_IPC,
    GLOO,
    INLINE,
    SHM,
    byte_view,
    decode,
    dtype_of,
    flat_u8,
    torch_module,
)

logger = logging.getLogger(__name__)
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
REFUSED_LOG_INTERVAL_S = 60.0


class Receiving:
    """The receiving half of ``Endpoint`` (see the module docstring)."""

    name: str
    closed: bool
    info: PeerInfo
    secret: bytes
    listener: socket.socket

    def __init__(self) -> None:
        self.handshakes = threading.BoundedSemaphore(CONFIG.max_handshakes)
        self.refused = 0  # refused connections not yet logged
        self.refused_logged_at = -REFUSED_LOG_INTERVAL_S
        self.refused_lock = threading.Lock()

    def accept_loop(self) -> None:
        delay = 0.01
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError as e:
                if self.closed or e.errno not in _OUT_OF_FDS:
                    return
                self._note_refused(f"out of file descriptors ({errno.errorcode[e.errno]})")
                time.sleep(delay)  # connections in their handshake time out and free fds
                delay = min(delay * 2, 1.0)
                continue
            delay = 0.01
            if not self.handshakes.acquire(blocking=False):
                close_socket(sock)
                self._note_refused(f"more than {CONFIG.max_handshakes} handshakes at once")
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock,), name="px-recv", daemon=True
                ).start()
            except RuntimeError:  # no thread could be started
                self.handshakes.release()
                close_socket(sock)
                self._note_refused("could not start a thread")

    def _note_refused(self, why: str) -> None:
        """Count a refused connection; log the count at most once per interval."""
        with self.refused_lock:
            self.refused += 1
            now = time.monotonic()
            if now - self.refused_logged_at < REFUSED_LOG_INTERVAL_S:
                return
            count, self.refused, self.refused_logged_at = self.refused, 0, now
        logger.warning(
            "phalanx endpoint %s: refused %d connection(s) (last: %s); the next such warning "
            "comes in %.0f s at the earliest",
            self.name,
            count,
            why,
            REFUSED_LOG_INTERVAL_S,
        )

    def _handshake(self, sock: socket.socket) -> PeerInfo | None:
        """Authenticate the client and read its hello; None (socket closed) if it fails."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not auth.server_handshake(sock, self.secret):
                close_socket(sock)
                self._note_refused("an unauthenticated connection")
                return None
            sock.settimeout(auth.HANDSHAKE_TIMEOUT_S)
            head = bytearray(HELLO_LEN.size)
            recv_exact(sock, memoryview(head))
            (size,) = HELLO_LEN.unpack(head)
            if size > MAX_HELLO:
                raise ValueError(f"hello of {size} bytes")
            hello = bytearray(size)
            recv_exact(sock, memoryview(hello))
            info = PeerInfo.from_json(bytes(hello))
            sock.settimeout(None)
            return info
        except (OSError, ConnectionError, ValueError, TypeError):
            close_socket(sock)
            return None
        finally:
            self.handshakes.release()

    def _serve(self, sock: socket.socket) -> None:
        info = self._handshake(sock)
        if info is None:
            return
        box = self.inbox(info.name)
        done = threading.Event()
        older = box.attach(sock, info, done)
        try:
            while older is not None and not older.wait(1.0):  # keep the sender's order
                if self.closed:
                    return
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
                self.actors.pop(info.name, None)
                box.fail(err)
            close_socket(sock)
        finally:
            done.set()

    def _read_message(self, box: Inbox, sock: socket.socket, info: PeerInfo) -> None:
        prefix = bytearray(PREFIX.size)
        recv_exact(sock, memoryview(prefix))
        meta_len, inline_len = PREFIX.unpack(prefix)
        check_frame(meta_len, inline_len, CONFIG.max_frame_bytes)
        kind, skeleton, specs, segment = pickle.loads(recv_bytes(sock, meta_len))
        if kind == "pg":
            backend, ip, port, *options = segment  # options: since CollectiveGroupOptions
            if ip != info.ip:  # only a store on the authenticated peer's own address
                raise AuthenticationError(
                    info.name,
                    f"{info.name} asked to join a store at {ip}, not at its own {info.ip}",
                )
            store = join_store(ip, port, CONFIG.connect_timeout_s)
            box.pgs[backend] = make_pair_group(
                backend, store, skeleton, 1, self.info.ip, CONFIG.connect_timeout_s, *options[:1]
            )
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

    def _read_raw(self, box: Inbox, sock: socket.socket, spec: tuple, seg: Any) -> None:
        _, _, dtype, shape, _, _, _ = spec
        claim = box.wait_claim()
        buf = None
        wrong = None
        if claim is not None and claim.kind == "tensor":
            buf = claim.buffer
            numel = 1
            for s in shape:
                numel *= s
            if buf.dtype != dtype_of(dtype) or buf.numel() != numel:
                wrong = mismatch(buf, dtype_of(dtype), shape)
                buf = None
        value = self._read_blob(box, sock, spec, seg, buf)
        if wrong is not None:
            box.deliver(False, wrong)
        else:
            box.deliver(True, value)

    def _read_blob(self, box: Inbox, sock: socket.socket, spec: tuple, seg: Any, into: Any) -> Any:
        """Receive one blob; into ``into`` (a tensor of matching dtype/numel) when given."""
        is_tensor, transport, dtype, shape, nbytes, device, extra = spec
        torch = torch_module() if (is_tensor or transport != INLINE) else None
        if transport == INLINE:
            if not is_tensor:
                return recv_bytes(sock, nbytes)
            dest = (
                into
                if into is not None and into.device.type == "cpu"
                else torch.empty(shape, dtype=dtype_of(dtype))
            )
            recv_exact(sock, byte_view(dest))
            return _into(into, dest)
        if transport == SHM:
            if not is_tensor:
                return memoryview(seg[extra : extra + nbytes].numpy())
            return _into(into, shm.view_as(seg, extra, dtype_of(dtype), shape))
        if transport == CUDA_IPC:
            return _into(into, cuda_ipc.open_handle(extra))
        pg = box.pgs.get(transport)
        if pg is None:
            raise CommError(box.peer, f"no {transport} process group from {box.peer}")
        if transport == GLOO:
            if into is not None and into.device.type == "cpu":
                dest = into
            else:
                dest = box.buffers.take(nbytes)
                if is_tensor:
                    dest = dest.view(dtype_of(dtype)).view(shape)
            pg.recv([flat_u8(dest)], 0, 0).wait()
        else:  # NCCL
            dest = (
                into
                if into is not None
                else torch.empty(
                    shape, dtype=dtype_of(dtype), device=f"cuda:{torch.cuda.current_device()}"
                )
            )
            pg.recv([dest], 0, 0).wait()
        if into is None and not is_tensor:
            return memoryview(dest.numpy())
        return _into(into, dest)


def _into(into: Any, dest: Any) -> Any:
    """``dest``, copied into the caller's buffer ``into`` when one was given."""
    if into is None or dest is into:
        return dest
    into.copy_(dest.view(into.shape))
    return into
