"""The messages that arrived from one peer and the receives that wait for them.

A reader thread delivers messages in arrival order; receives claim them in posting order,
so a ``recv`` may come before or after its ``send``. A peer can instead be given a
handler (a channel client or server) that gets every message as it arrives.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from phalanx.comm import shm
from phalanx.comm.buffers import BufferPool
from phalanx.comm.config import CONFIG
from phalanx.comm.errors import CommError
from phalanx.comm.frames import close_socket
from phalanx.comm.peers import Ident, PeerInfo
from phalanx.comm.wire import torch_module

logger = logging.getLogger(__name__)


class Claim:
    """A posted receive: what it expects (``obj`` or ``tensor`` into ``buffer``) and its future."""

    __slots__ = ("kind", "buffer", "future")

    def __init__(self, kind: str, buffer: Any):
        self.kind = kind
        self.buffer = buffer
        self.future: concurrent.futures.Future = concurrent.futures.Future()


def mismatch(buf: Any, dtype: Any, shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"recv_tensor: buffer is {tuple(buf.shape)} {buf.dtype}, the sender sent {shape} {dtype}"
    )


class Inbox:
    """Messages from one peer, numbered in arrival order; receives claim numbers in order.

    ``is_closed`` says whether the endpoint closed; ``retire`` takes Ray object refs this
    inbox lets go of from a reader thread (the liveness monitor frees them while Ray runs:
    freeing one while Ray shuts down would end the process).
    """

    def __init__(self, peer: str, is_closed: Callable[[], bool], retire: Callable[[Any], None]):
        self.peer = peer
        self.is_closed = is_closed
        self.retire = retire
        self.cv = threading.Condition()
        self.claims: dict[int, Claim] = {}
        self.arrived: dict[int, tuple[bool, Any]] = {}
        self.next_claim = 0
        self.next_msg = 0
        self.handler: Callable[[str, Any], None] | None = None
        self.error: CommError | None = None
        self.sock: socket.socket | None = None
        self.reader_done: threading.Event | None = None  # set when the reader of ``sock`` ends
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
            claim = Claim(kind, buffer)
            if idx in self.arrived:
                ok, value = self.arrived.pop(idx)
                self._resolve(claim, ok, value)
                return claim.future
            if not self.claims:  # idle -> waiting: bind to the incarnation alive now
                self.retire(self.probe)
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
    def _resolve(claim: Claim, ok: bool, value: Any) -> None:
        if not ok:
            claim.future.set_exception(value)
            return
        if claim.kind == "tensor" and value is not claim.buffer:
            buf = claim.buffer
            if not isinstance(value, torch_module().Tensor):
                claim.future.set_exception(
                    ValueError(
                        f"recv_tensor: the message is a {type(value).__name__}, not a tensor"
                    )
                )
                return
            if value.dtype != buf.dtype or value.numel() != buf.numel():
                claim.future.set_exception(mismatch(buf, value.dtype, tuple(value.shape)))
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
            self._call_handler(value)
            return
        self._resolve(claim, ok, value)

    def _call_handler(self, value: Any) -> None:
        try:
            self.handler(self.peer, value)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the reader
            logger.exception("message handler for %s failed", self.peer)

    def wait_claim(self) -> Claim | None:
        """The claim of the next message (blocks until posted); None in handler mode."""
        with self.cv:
            while True:
                if self.handler is not None:
                    return None
                if self.next_msg in self.claims:
                    return self.claims[self.next_msg]
                if self.error is not None or self.is_closed():
                    raise self.error or CommError(self.peer, "endpoint closed")
                self.cv.wait(1.0)

    def fail(self, err: CommError) -> None:
        with self.cv:
            self.error = err
            claims, self.claims = self.claims, {}
            if claims:  # failed receives consumed no message: the next one takes the next
                self.next_claim = self.next_msg
            self.retire(self.probe)
            self.bound, self.probe = None, None
            self.cv.notify_all()
        for c in claims.values():
            if not c.future.done():
                c.future.set_exception(err)
        if self.handler is not None:
            self._call_handler(err)

    def attach(
        self, sock: socket.socket, info: PeerInfo, done: threading.Event
    ) -> threading.Event | None:
        """Make ``sock`` the peer's connection (``done`` is set when its reader ends).

        A newer connection of the same process follows one its sender closed (after a
        failure or a silence): the older one is still read to its end, so what the sender
        wrote into it is delivered, in order. Returns the event of that older reader, which
        the new one waits for. A connection of another incarnation (a restarted peer)
        replaces the old one at once: the dead process's messages are dropped.
        """
        with self.cv:
            old, old_done = self.sock, self.reader_done
            same = self.info is not None and self.info.incarnation == info.incarnation
            if self.info is not None and not same:
                self.pgs = {}
                self.segments.clear()
            self.sock, self.info, self.error = sock, info, None
            self.reader_done = done
            self.cv.notify_all()
        if old is None or old is sock:
            return None
        if same and old_done is not None and not old_done.is_set():
            return old_done
        close_socket(old)
        return None
