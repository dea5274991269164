"""Fault tolerance for any worker group: health, restarts with state restore, async requests.

A group carries a :class:`RestartPolicy` (``launch(..., restart_policy=RestartPolicy())``).
Each rank has a health state::

    healthy --(actor died)--> unhealthy --(restart allowed)--> restarting --> healthy
                                  |                                |
                                  |                                +--(restore failed)--> unhealthy
                                  +--(no restart left)--> dead (for good)

Only a dead actor makes a worker unhealthy. An exception in user code is that rank's
error and leaves it healthy; a timeout leaves it healthy too (the hang report says where
it is stuck). Deaths are seen within milliseconds by one driver thread that waits on a
long-lived "watch" call per worker (it runs in the host's control concurrency group), and
also when a call's result says the actor died. A restart recreates the actor on the same
placement slot with the same rank, actor name and environment, restores the worker's
state (``set_state``) and the latest weights (the group's restart hooks) and only then
lets calls reach it again.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from phalanx._base.errors import WorkerDiedError

if TYPE_CHECKING:
    from phalanx.group.group import WorkerGroup

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 60.0  # a watch call returns after this long and is sent again


class WorkerHealth(str, enum.Enum):
    """Health of one rank of a group."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    DEAD = "dead"


@dataclass(frozen=True)
class RestartPolicy:
    """How a group reacts when a worker's actor dies.

    Defaults aim at fast recovery (about a second or two on a laptop-class machine):

    - ``max_restarts_per_worker=5``: a rank that keeps dying is given up after 5 restart
      attempts (it becomes ``dead``), so a crash loop cannot go on forever.
    - ``max_restarts_total=None``: no limit over the whole group besides the per-rank one.
    - ``delay_s=0.0``: restart at once. RLlib waits 60 s by default; a recreated actor
      here is ready in ~1 s, and the per-rank limit already stops thrashing.
    - ``health_probe_timeout_s=30.0``: how long a ping, a ``set_state`` restore or the
      start of a recreated actor may take before the rank counts as unhealthy.
    - ``ignore_failures=False``: a call that meets a dead worker raises an error naming the
      rank. With ``True`` broadcast-style calls go on with the workers left (sharded or
      per-worker data calls never drop a shard: they restart the rank first or raise).

    ``RestartPolicy.never()`` is the policy of a group launched without one: health is
    tracked, nothing is restarted, a dead rank raises.
    """

    max_restarts_per_worker: int = 5
    max_restarts_total: int | None = None
    delay_s: float = 0.0
    health_probe_timeout_s: float = 30.0
    ignore_failures: bool = False

    def __post_init__(self) -> None:
        for name in ("max_restarts_per_worker", "max_restarts_total"):
            v = getattr(self, name)
            if v is None and name == "max_restarts_total":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        for name in ("delay_s", "health_probe_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.health_probe_timeout_s <= 0:
            raise ValueError(
                f"health_probe_timeout_s must be > 0, got {self.health_probe_timeout_s}"
            )
        if not isinstance(self.ignore_failures, bool):
            raise TypeError("ignore_failures must be a bool")

    @classmethod
    def never(cls, ignore_failures: bool = False) -> RestartPolicy:
        """Track health, never restart."""
        return cls(max_restarts_per_worker=0, max_restarts_total=0, ignore_failures=ignore_failures)

    @property
    def restarts_enabled(self) -> bool:
        return self.max_restarts_per_worker > 0 and self.max_restarts_total != 0


@dataclass(frozen=True)
class HealthEvent:
    """One health transition of one rank (``group.health_events()``)."""

    rank: int
    old: WorkerHealth
    new: WorkerHealth
    reason: str
    time: float


@dataclass
class AsyncSubmission:
    """What ``foreach_worker_async`` did: the ranks it sent to and those over budget.

    ``int(submission)`` is the number of requests sent (what RLlib returns).
    """

    tag: str | None
    sent: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    @property
    def num_sent(self) -> int:
        return len(self.sent)

    def __int__(self) -> int:
        return len(self.sent)

    def __index__(self) -> int:
        return len(self.sent)


class FaultState:
    """Per-group health, restart and in-flight bookkeeping (private to the group)."""

    def __init__(self, group: WorkerGroup, policy: RestartPolicy):
        self.group_ref = weakref.ref(group)
        self.policy = policy
        self.cond = threading.Condition(threading.RLock())
        self.health: list[WorkerHealth] = []
        # Ranks not healthy: the call path tests only this set's truthiness.
        self.not_healthy: set[int] = set()
        self.attempts: list[int] = []
        self.attempts_total = 0
        self.recoveries = 0
        self.recovered_since_probe: set[int] = set()
        self.events: list[HealthEvent] = []
        self.states: dict[int, Any] = {}
        self.restarting: dict[int, threading.Thread] = {}
        self.closed = False
        # async requests: ref -> (tag, rank); ready results held back by a raised error.
        self.in_flight: dict[ray.ObjectRef, tuple[str | None, int]] = {}
        self.held: list[tuple[str | None, int, Any]] = []

    # -- setup ----------------------------------------------------------------------------
    def reset(self, world: int) -> None:
        with self.cond:
            self.health = [WorkerHealth.HEALTHY] * world
            self.not_healthy = set()
            self.attempts = [0] * world
            self.closed = False

    def start_watching(self) -> None:
        g = self.group_ref()
        if g is None:
            return
        for rank, actor in enumerate(g._actors):
            _MONITOR.watch(self, rank, actor)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.in_flight.clear()
            self.held.clear()
            self.cond.notify_all()
        _MONITOR.forget(self)

    @property
    def gone(self) -> bool:
        """The group was shut down or garbage-collected."""
        return self.closed or self.group_ref() is None

    # -- health ---------------------------------------------------------------------------
    def _set(self, rank: int, new: WorkerHealth, reason: str) -> None:
        old = self.health[rank]
        if old == new:
            return
        self.health[rank] = new
        if new == WorkerHealth.HEALTHY:
            self.not_healthy.discard(rank)
        else:
            self.not_healthy.add(rank)
        self.events.append(HealthEvent(rank, old, new, reason, time.time()))
        logger.info("rank %d: %s -> %s (%s)", rank, old.value, new.value, reason)
        self.cond.notify_all()

    def can_restart(self, rank: int) -> bool:
        p = self.policy
        if not p.restarts_enabled or self.attempts[rank] >= p.max_restarts_per_worker:
            return False
        return p.max_restarts_total is None or self.attempts_total < p.max_restarts_total

    def observe_death(self, rank: int, actor_id: Any, reason: str) -> None:
        """The actor ``actor_id`` of ``rank`` died; restart it if the policy allows."""
        g = self.group_ref()
        with self.cond:
            if self.closed or g is None or rank >= len(g._actors):
                return
            if g._actors[rank]._actor_id != actor_id:
                return  # an older incarnation; the rank was already replaced
            if self.health[rank] in (WorkerHealth.RESTARTING, WorkerHealth.DEAD):
                return
            if rank in self.restarting:
                return
            self._set(rank, WorkerHealth.UNHEALTHY, reason)
            self._schedule_or_bury(rank, reason)

    def _schedule_or_bury(self, rank: int, reason: str) -> None:
        if self.can_restart(rank):
            t = threading.Thread(
                target=self._restart, args=(rank,), name=f"phalanx-restart-{rank}", daemon=True
            )
            self.restarting[rank] = t
            t.start()
        else:
            self._set(rank, WorkerHealth.DEAD, f"no restart left after: {reason}")

    def suspect(self, rank: int) -> None:
        """A call on ``rank`` failed as if its actor died: check with a ping."""
        g = self.group_ref()
        if g is None or self.closed or self.health[rank] != WorkerHealth.HEALTHY:
            return
        actor = g._actors[rank]
        deadline = time.monotonic() + min(5.0, self.policy.health_probe_timeout_s)
        while time.monotonic() < deadline:
            try:
                ray.get(actor._px_ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
                return
            except ActorDiedError as e:
                self.observe_death(rank, actor._actor_id, f"actor died: {_first_line(e)}")
                return
            except RayActorError:
                time.sleep(0.05)  # "temporarily unavailable": ask again
            except GetTimeoutError:
                return

    # -- restart --------------------------------------------------------------------------
    def _restart(self, rank: int) -> None:
        try:
            if self.policy.delay_s:
                time.sleep(self.policy.delay_s)
            self._restart_once(rank)
        finally:
            with self.cond:
                if self.restarting.get(rank) is threading.current_thread():
                    del self.restarting[rank]
                self.cond.notify_all()

    def _restart_once(self, rank: int) -> None:
        g = self.group_ref()
        with self.cond:
            if self.closed or g is None:
                return
            self.attempts[rank] += 1
            self.attempts_total += 1
            self._set(rank, WorkerHealth.RESTARTING, f"restart attempt {self.attempts[rank]}")
        timeout = max(self.policy.health_probe_timeout_s, 1.0)
        try:
            actor, meta = g._respawn(rank, timeout=g._launch_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to start counts against the rank
            with self.cond:
                reason = f"restart failed: {_first_line(e)}"
                self._set(rank, WorkerHealth.UNHEALTHY, reason)
                if not self.closed:
                    self._schedule_or_bury(rank, reason)
            return
        with self.cond:
            if self.closed:  # the group shut down meanwhile: do not leak the new actor
                ray.kill(actor, no_restart=True)
                return
            g._actors[rank] = actor
            g._worker_metadata[rank].update(meta)
        _MONITOR.watch(self, rank, actor)
        try:
            self._restore(g, rank, actor, timeout)
        except Exception as e:  # noqa: BLE001 - a failed restore keeps the rank out of calls
            with self.cond:
                self._set(rank, WorkerHealth.UNHEALTHY, f"restore failed: {_first_line(e)}")
            return
        with self.cond:
            self.recoveries += 1
            self.recovered_since_probe.add(rank)
            self._set(rank, WorkerHealth.HEALTHY, "restarted and restored")

    def _restore(self, g: WorkerGroup, rank: int, actor: Any, timeout: float) -> None:
        with self.cond:
            has_state = rank in self.states
            state = self.states.get(rank)
        if has_state and "set_state" in g._methods:
            ray.get(actor._px_call.remote("set_state", state), timeout=timeout)
        g.run_restart_hooks([rank])

    # -- waiting before a call -----------------------------------------------------------
    def in_restore_thread(self, rank: int) -> bool:
        return self.restarting.get(rank) is threading.current_thread()

    def ensure_ready(
        self, ranks: list[int], method: str, skip: bool
    ) -> tuple[list[int], list[int]]:
        """Make ``ranks`` callable: wait for running restarts, restart unhealthy ranks.

        Returns ``(ready, skipped)``. A rank that cannot be made healthy is skipped when
        ``skip`` is true, else a ``WorkerDiedError`` naming it is raised.
        """
        g = self.group_ref()
        deadline = time.monotonic() + g._launch_timeout_s + self.policy.health_probe_timeout_s
        ready, skipped = [], []
        for rank in ranks:
            if rank not in self.not_healthy or self.in_restore_thread(rank):
                ready.append(rank)
                continue
            with self.cond:
                while True:
                    h = self.health[rank]
                    if h == WorkerHealth.HEALTHY or self.closed:
                        break
                    if rank in self.restarting:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.cond.wait(min(left, 1.0))
                        continue
                    if h == WorkerHealth.UNHEALTHY and self.can_restart(rank):
                        self._schedule_or_bury(rank, "unhealthy at dispatch")
                        continue
                    break
                h = self.health[rank]
            if h == WorkerHealth.HEALTHY:
                ready.append(rank)
            elif skip:
                skipped.append(rank)
            else:
                raise WorkerDiedError(
                    g.name,
                    rank,
                    method,
                    "",
                    "WorkerUnavailable",
                    f"rank {rank} is {h.value} ({self._last_reason(rank)}); "
                    f"restarts used {self.attempts[rank]}/{self.policy.max_restarts_per_worker}",
                )
        return ready, skipped

    def _last_reason(self, rank: int) -> str:
        for e in reversed(self.events):
            if e.rank == rank:
                return e.reason
        return "no event"

    def wait_healthy(self, ranks: list[int], timeout: float) -> bool:
        """Block until every rank in ``ranks`` is healthy (True) or the time is up."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                if all(self.health[r] == WorkerHealth.HEALTHY for r in ranks):
                    return True
                # A dead rank, or an unhealthy one with no restart running, stays so.
                settled = all(
                    self.health[r] == WorkerHealth.HEALTHY or r not in self.restarting
                    for r in ranks
                )
                left = deadline - time.monotonic()
                if left <= 0 or settled or self.closed:
                    return False
                self.cond.wait(min(left, 0.5))

    def mark_healthy(self, ranks: list[int]) -> None:
        """Unhealthy ranks that just answered a call are healthy again."""
        with self.cond:
            for r in ranks:
                if self.health[r] == WorkerHealth.UNHEALTHY and r not in self.restarting:
                    self._set(r, WorkerHealth.HEALTHY, "answered a call (mark_healthy)")

    def see_states(self, ranks: list[int], states: list[Any]) -> None:
        """Remember the ``get_state()`` results the group returned: restored after a restart."""
        with self.cond:
            for r, st in zip(ranks, states):
                self.states[r] = st

    # -- probing ----------------------------------------------------------------------------
    def probe(self, timeout: float) -> list[int]:
        """Ping unhealthy ranks; restore (or restart) them; return every rank back since last."""
        g = self.group_ref()
        with self.cond:
            targets = [r for r, h in enumerate(self.health) if h == WorkerHealth.UNHEALTHY]
        for rank in targets:
            actor = g._actors[rank]
            alive = True
            try:
                ray.get(actor._px_ping.remote(), timeout=timeout)
            except (RayActorError, GetTimeoutError):
                alive = False
            if alive:
                try:
                    self._restore(g, rank, actor, timeout)
                except Exception as e:  # noqa: BLE001
                    logger.warning("rank %d: restore on probe failed: %s", rank, e)
                    continue
                with self.cond:
                    self.recovered_since_probe.add(rank)
                    self._set(rank, WorkerHealth.HEALTHY, "probe: alive and restored")
            else:
                with self.cond:
                    if rank not in self.restarting:
                        self._schedule_or_bury(rank, "probe: no answer")
        if targets:
            self.wait_healthy(targets, g._launch_timeout_s + timeout)
        with self.cond:
            back = sorted(self.recovered_since_probe)
            self.recovered_since_probe.clear()
        return back


class _Monitor:
    """One driver thread that notices dead actors of every group as soon as Ray does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watches: dict[ray.ObjectRef, tuple[FaultState, int, Any]] = {}
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()

    def watch(self, state: FaultState, rank: int, actor: Any) -> None:
        try:
            ref = actor._px_watch.remote(WATCH_PERIOD_S)
        except Exception as e:  # noqa: BLE001
            logger.debug("cannot watch rank %d: %s", rank, e)
            return
        with self.lock:
            self.watches[ref] = (state, rank, actor)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="phalanx-health-monitor", daemon=True
                )
                self.thread.start()
        self.wake.set()

    def forget(self, state: FaultState) -> None:
        with self.lock:
            for ref in [r for r, (s, _, _) in self.watches.items() if s is state]:
                del self.watches[ref]

    def _run(self) -> None:
        failures = 0
        while True:
            with self.lock:
                # A group dropped without shutdown: let its actors go (we hold handles).
                for ref in [r for r, (st, _, _) in self.watches.items() if st.gone]:
                    del self.watches[ref]
                refs = list(self.watches)
            if not refs:
                self.wake.wait(1.0)
                self.wake.clear()
                continue
            if not ray.is_initialized():
                with self.lock:
                    self.watches.clear()
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.25, fetch_local=False)
                failures = 0
            except Exception as e:  # noqa: BLE001 - Ray shut down (and maybe restarted) under us
                failures += 1
                if failures >= 5:  # refs of an earlier Ray session: nothing left to watch
                    logger.warning("health monitor: dropping %d watches: %s", len(refs), e)
                    with self.lock:
                        self.watches.clear()
                time.sleep(0.25)
                continue
            for ref in ready:
                with self.lock:
                    entry = self.watches.pop(ref, None)
                if entry is None:
                    continue
                state, rank, actor = entry
                if state.gone:
                    continue
                try:
                    exiting = ray.get(ref, timeout=1.0)
                except RayActorError as e:
                    state.observe_death(rank, actor._actor_id, f"actor died: {_first_line(e)}")
                    continue
                except Exception:  # noqa: BLE001
                    exiting = False
                if exiting:
                    state.observe_death(rank, actor._actor_id, "worker process exited")
                else:
                    self.watch(state, rank, actor)


_MONITOR = _Monitor()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def call_with_id(worker: Any, func: Callable[..., Any], rank: int, *args: Any, **kw: Any) -> Any:
    """``foreach_worker_with_id``: run ``func(worker_id, worker)`` on the worker."""
    if isinstance(func, str):
        return getattr(worker, func)(rank, *args, **kw)
    return func(rank, worker, *args, **kw)


def call_each(worker: Any, func: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``foreach_worker`` with one function per worker: run ``func(worker)``."""
    if isinstance(func, str):
        return getattr(worker, func)(*args, **kw)
    return func(worker, *args, **kw)


__all__ = ["RestartPolicy", "WorkerHealth", "HealthEvent", "AsyncSubmission"]
