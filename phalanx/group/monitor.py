"""The health monitor: one driver thread that sees every group's dead actors at once.

Each watched worker has one long-lived "watch" call in flight (it runs in the host's
control concurrency group and returns after ``WATCH_PERIOD_S``, or at once when the
worker's process is exiting); the thread waits on all of them together and tells the
rank's fault state (:class:`~phalanx.group.fault.FaultState`, ``observe_death``) when one
says its actor died.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError

from phalanx._base import ray_gate

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 60.0  # a watch call returns after this long and is sent again


class Watched(Protocol):
    """What the monitor needs of a fault state."""

    @property
    def gone(self) -> bool: ...

    def observe_death(self, rank: int, actor_id: Any, reason: str) -> None: ...


class _Monitor:
    """One driver thread that notices dead actors of every group as soon as Ray does.

    It makes its Ray calls through ``ray_gate``: ``ray.shutdown()`` first stops it (its
    watches are let go while Ray still runs) and waits until it is out of Ray, as a thread
    inside ``ray.wait`` while Ray tears down crashes the process.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: dict[ray.ObjectRef, tuple[Watched, int, Any]] = {}
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()
        self.stopping = False

    def watch(self, state: Watched, rank: int, actor: Any) -> None:
        try:
            ref = actor._px_watch.remote(WATCH_PERIOD_S)
        except Exception as e:  # noqa: BLE001
            logger.debug("cannot watch rank %d: %s", rank, e)
            return
        with self.lock:
            self.watches[ref] = (state, rank, actor)
            if self.thread is None or not self.thread.is_alive():
                self.stopping = False
                ray_gate.install()
                ray_gate.on_shutdown(self.stop)
                self.thread = threading.Thread(
                    target=self._run, name="phalanx-health-monitor", daemon=True
                )
                self.thread.start()
        self.wake.set()

    def forget(self, state: Watched) -> None:
        with self.lock:
            for ref in [r for r, (s, _, _) in self.watches.items() if s is state]:
                del self.watches[ref]

    def stop(self) -> None:
        """Drop every watch and end the thread (Ray is about to shut down)."""
        with self.lock:
            self.stopping = True
            self.watches.clear()
            thread = self.thread
        self.wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(ray_gate.DRAIN_TIMEOUT_S)

    def _run(self) -> None:
        failures = 0
        while not self.stopping:
            with ray_gate.ray_calls() as ray_up:
                if not ray_up:
                    return  # Ray is down or going down; its refs stay with the dict
                failures = self._round(failures)

    def _round(self, failures: int) -> int:
        """One wait on every watch (Ray is up); returns the count of failed waits in a row."""
        with self.lock:
            # A group dropped without shutdown: let its actors go (we hold handles).
            for ref in [r for r, (st, _, _) in self.watches.items() if st.gone]:
                del self.watches[ref]
            refs = list(self.watches)
        if not refs:
            self.wake.wait(0.25)
            self.wake.clear()
            return failures
        try:
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.25, fetch_local=False)
        except Exception as e:  # noqa: BLE001 - Ray shut down (and maybe restarted) under us
            failures += 1
            if failures >= 5:  # refs of an earlier Ray session: nothing left to watch
                logger.warning("health monitor: dropping %d watches: %s", len(refs), e)
                with self.lock:
                    self.watches.clear()
            self.wake.wait(0.25)
            return failures
        for ref in ready:
            with self.lock:
                entry = None if self.stopping else self.watches.pop(ref, None)
            if entry is None:
                continue
            state, rank, actor = entry
            if state.gone:
                continue
            try:
                exiting = ray.get(ref, timeout=1.0)
            except RayActorError as e:
                state.observe_death(rank, actor._actor_id, f"actor died: {first_line(e)}")
                continue
            except Exception:  # noqa: BLE001
                exiting = False
            if exiting:
                state.observe_death(rank, actor._actor_id, "worker process exited")
            else:
                self.watch(state, rank, actor)
        return 0


MONITOR = _Monitor()


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (health events' reasons)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


__all__ = ["MONITOR", "WATCH_PERIOD_S", "first_line"]
