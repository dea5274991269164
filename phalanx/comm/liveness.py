"""Liveness of peers: the monitor thread, incarnation checks, failing what waits on the dead.

Each endpoint announces an incarnation (actor id, pid and a random id). A peer that exits
closes its sockets, which fails the operations waiting on it at once; the monitor thread
also probes peers with pending operations every ``peer_check_interval_s``: a peer that is
dead fails them with ``PeerDiedError``, one whose actor does not answer for
``peer_timeout_s`` with ``PeerTimeoutError`` (later operations try again), one whose actor
is now another incarnation (restarted under the same name) with ``PeerDiedError`` naming
it. A receive binds to the incarnation alive when it is posted, so a sender killed and
restarted while a ``recv`` waits is reported, and later receives wait on the new one.

Ray object refs (pings) are freed only by this thread and only while Ray runs: freeing one
while ``ray.shutdown()`` tears the core worker down ends the process, so the monitor makes
its Ray calls through ``ray_gate`` (``ray.shutdown`` waits until it is out of them) and
stops touching Ray (keeping what it holds) once Ray is shutting down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from phalanx._base import ray_gate
from phalanx.comm.config import CONFIG
from phalanx.comm.errors import CommError, PeerDiedError, PeerNotFoundError
from phalanx.comm.frames import close_socket
from phalanx.comm.inbox import Inbox
from phalanx.comm.peers import (
    DRIVER_PREFIX,
    Ident,
    actor_now,
    announced,
    is_pingable,
    no_answer,
    not_found_text,
    ping,
    ping_result,
    same_process,
)

logger = logging.getLogger(__name__)
_KEPT_AFTER_SHUTDOWN: list[Any] = []  # refs held when Ray shut down: never freed
# A monitor ping in flight: (actor id, ref, sent at, why the previous ping failed or None)
_Ping = tuple[str, Any, float, CommError | None]


class Liveness:
    """The peer-liveness half of ``Endpoint`` (see the module docstring)."""

    name: str
    closed: bool
    lock: threading.RLock
    inboxes: dict[str, Inbox]
    out_conns: dict[str, Any]

    def __init__(self) -> None:
        self.actors: dict[str, Any] = {}
        self.retired_refs: list[Any] = []
        self.retired_lock = threading.Lock()
        self.monitor_wake = threading.Event()  # set to end the monitor's wait early
        self.monitor_thread: threading.Thread | None = None

    def retire(self, obj: Any) -> None:
        """Hand a Ray object ref (or a tuple holding one) to the monitor to free."""
        if obj is not None:
            with self.retired_lock:
                self.retired_refs.append(obj)

    def check_peer_exists(self, peer: str) -> None:
        """Raise ``PeerNotFoundError`` naming ``peer`` when no such worker/channel exists."""
        if peer == self.name:
            return
        if peer.startswith(DRIVER_PREFIX):
            if announced(peer) is None:
                raise PeerNotFoundError(peer, f"no endpoint named {peer!r}")
            return
        if peer not in self.actors:
            try:
                self.actors[peer] = actor_now(peer)
            except PeerDiedError:
                raise PeerNotFoundError(peer, not_found_text(peer)) from None

    def broken(self, peer: str, exc: BaseException) -> CommError:
        """Turn a transport failure into a ``PeerDiedError`` and fail the pair's pending work."""
        err = PeerDiedError(peer, f"connection to {peer} failed: {type(exc).__name__}: {exc}")
        self.peer_dead(peer, err)
        return err

    def peer_dead(self, peer: str, err: CommError) -> None:
        self.actors.pop(peer, None)
        conn = self.out_conns.get(peer)
        if conn is not None:
            conn.fail(err)
        box = self.inboxes.get(peer)
        if box is not None:
            box.fail(err)
            close_socket(box.sock)

    def incarnation_gone(self, peer: str, gone: Ident, err: CommError) -> None:
        """Fail what is bound to the process ``gone`` of ``peer``; leave a newer one alone."""
        self.actors.pop(peer, None)
        conn = self.out_conns.get(peer)
        if conn is not None and conn.info is not None and same_process(conn.info.ident, gone):
            conn.fail(err)
        box = self.inboxes.get(peer)
        if box is None:
            return
        with box.cv:
            stale_sock = box.info is not None and same_process(box.info.ident, gone)
            bound_here = box.bound is None or same_process(box.bound, gone)
            waiting = bool(box.claims) or box.handler is not None
        if waiting and (bound_here or stale_sock):
            box.fail(err)  # first: the reader of a closed socket reports a vaguer error
        if stale_sock:
            close_socket(box.sock)

    def probe_for(self, box: Inbox) -> tuple[str, Any] | None:
        """Name the peer's incarnation for a receive posted now (slow path: no connection).

        Sends a ping to the actor registered under the peer's name now; the monitor reads
        its answer. Raises ``PeerDiedError`` when no actor has that name any more.
        """
        if not is_pingable(box.peer, self.name) or not box.needs_probe():
            return None
        return ping(box.peer)

    def live_ident(self, peer: str, timeout: float) -> Ident:
        """The (actor id, pid) of the actor registered as ``peer`` now; ``PeerDiedError`` if none."""
        aid, ref = ping(peer)
        return aid, ping_result(peer, ref, timeout)

    def check_alive(self, peer: str) -> None:
        """Raise ``PeerDiedError`` if Ray says ``peer``'s actor is dead or gone."""
        if is_pingable(peer, self.name):
            self.live_ident(peer, CONFIG.peer_timeout_s)

    def is_current(self, peer: str, incarnation: str) -> bool:
        """Whether ``incarnation`` is the endpoint ``peer`` announces now (not a dead one)."""
        cur = announced(peer)
        if cur is None or cur.incarnation != incarnation:
            return False
        if not cur.is_actor:
            return True
        try:
            return actor_now(peer)._actor_id.hex() == cur.actor_id
        except PeerDiedError:
            return False

    def monitor_loop(self) -> None:
        """Probe peers that pending operations wait on; fail those that died or restarted."""
        inflight: dict[str, _Ping] = {}
        while not self.closed:
            self.monitor_wake.wait(CONFIG.peer_check_interval_s)
            with ray_gate.ray_calls() as ray_up:
                if not ray_up:
                    with self.retired_lock:
                        _KEPT_AFTER_SHUTDOWN.extend([inflight, self.retired_refs])
                        self.retired_refs = []
                    return
                self._monitor_round(inflight)

    def start_monitor(self) -> None:
        """Start the monitor thread; ``ray.shutdown()`` ends it first (``ray_gate``)."""
        ray_gate.install()
        ray_gate.on_shutdown(self.stop_monitor)
        self.monitor_thread = threading.Thread(
            target=self.monitor_loop, name="px-monitor", daemon=True
        )
        self.monitor_thread.start()

    def stop_monitor(self) -> None:
        """Wake the monitor so it sees Ray shutting down, and wait until it ended."""
        self.monitor_wake.set()
        thread = self.monitor_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(ray_gate.DRAIN_TIMEOUT_S)

    def _monitor_round(self, inflight: dict[str, _Ping]) -> None:
        """Free retired refs, probe the peers waited on (Ray is up: see ``ray_gate``)."""
        with self.retired_lock:
            self.retired_refs.clear()
        with self.lock:
            waiting = {p for p, b in self.inboxes.items() if b.pending()}
            waiting |= {p for p, c in self.out_conns.items() if c.pending()}
        now = time.monotonic()
        for peer in waiting:
            if not is_pingable(peer, self.name):
                continue
            try:
                self._probe_step(peer, inflight, now)
            except Exception:  # noqa: BLE001 - Ray shutting down, keep going
                logger.debug("liveness probe of %s failed", peer, exc_info=True)
        for peer in list(inflight):
            if peer not in waiting:
                del inflight[peer]

    def _probe_step(self, peer: str, inflight: dict[str, _Ping], now: float) -> None:
        """One monitor round for ``peer``: resolve the receive-time probe, compare incarnations."""
        box = self.inboxes.get(peer)
        probe = box.probe if box is not None else None
        if probe is not None:
            aid, ref = probe
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                with box.cv:
                    if box.probe is probe:
                        box.probe = None
                try:
                    pid = ping_result(peer, ref)
                except PeerDiedError as err:
                    self.incarnation_gone(peer, (aid, None), err)
                    return
                with box.cv:
                    if box.bound is None and box.claims:
                        box.bound = (aid, pid)
        entry = inflight.get(peer)
        if entry is None:
            self._send_ping(peer, inflight, now, None)
            return
        aid, ref, sent, died = entry
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            if now - sent > CONFIG.peer_timeout_s:
                del inflight[peer]
                err = died or no_answer(peer, CONFIG.peer_timeout_s)
                self.incarnation_gone(peer, (aid, None), err)
            return
        del inflight[peer]
        try:
            pid = ping_result(peer, ref)
        except PeerDiedError as err:
            if died is not None:  # the confirming ping failed too: no process of it is left
                self.incarnation_gone(peer, (aid, None), err)
            else:
                # Ray restarts an actor under the same id, so a ping sent before a restart
                # reports the old process's death after the new one may already serve a
                # receive: ask the actor registered now which process is alive first.
                self._send_ping(peer, inflight, now, err)
            return
        self._check_incarnation(peer, (aid, pid))

    def _send_ping(
        self, peer: str, inflight: dict[str, _Ping], now: float, died: CommError | None
    ) -> None:
        """Ping the actor registered as ``peer`` now (``died``: why the last ping failed)."""
        try:
            aid, ref = ping(peer)
        except PeerDiedError as err:
            self.peer_dead(peer, err)
            return
        inflight[peer] = (aid, ref, now, died)

    def _check_incarnation(self, peer: str, live: Ident) -> None:
        """Fail operations bound to an incarnation of ``peer`` other than ``live`` (a restart)."""
        stale: set[Ident] = set()
        conn = self.out_conns.get(peer)
        if conn is not None and conn.info is not None and not same_process(conn.info.ident, live):
            stale.add(conn.info.ident)
        box = self.inboxes.get(peer)
        if box is not None:
            with box.cv:
                if box.bound is not None and not same_process(box.bound, live):
                    stale.add(box.bound)
                if box.info is not None and not same_process(box.info.ident, live):
                    stale.add(box.info.ident)
        for gone in stale:
            err = PeerDiedError(
                peer,
                f"peer {peer} died and was restarted (process {gone[1]} of actor "
                f"{gone[0][:12]} is gone; now process {live[1]}): its pending messages are lost",
            )
            self.incarnation_gone(peer, gone, err)
