"""Fault tolerance for any worker group: health, restarts with state restore.

A group carries a :class:`RestartPolicy` (``launch(..., restart_policy=RestartPolicy())``).
Each rank has a health state::

    healthy --(actor died)--> unhealthy --(restart allowed)--> restarting --> healthy
                                  |                                |
                                  |                                +--(restore failed)--> unhealthy
                                  +--(no restart left)--> dead (for good)

The rule for a plain group: **only a dead process makes a worker unhealthy.** An exception
raised by the worker's code is that call's error (a :class:`~phalanx.WorkerError` naming the
rank, with the remote traceback); the worker answered, so it stays healthy and keeps its
state. A timeout leaves it healthy too (the hang report says where it is stuck). A group
that wants RLlib's rule instead (an exception is a worker failure: the worker is marked
unhealthy and restarted or ignored per policy) sets ``RestartPolicy(restart_on_error=True)``;
``EnvRunnerGroup`` does.

Deaths are seen within milliseconds by one driver thread that waits on a long-lived
"watch" call per worker (it runs in the host's control concurrency group), and also when
a call's result says the actor died. A restart recreates the actor on the same placement
slot with the same rank, actor name and environment, restores the worker's state
(``set_state``) and the latest weights (the group's restart hooks) and only then lets calls
reach it again.

The group's members are reached through the :class:`Members` interface (actor of a rank,
respawn, install); this module never reads a group's attributes.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from phalanx._base.errors import WorkerDiedError

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 60.0  # a watch call returns after this long and is sent again
# The reason of the health event each start-up restart leaves (one event per restart).
STARTUP_RESTART = "died during start-up; started again"


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
    - ``restart_window_s=None``: the per-rank limit counts over the group's whole life.
      With a number, only attempts in the last ``restart_window_s`` seconds count
      (``max_restarts_per_worker`` restarts per window), as long jobs need.
    - ``max_restarts_total=None``: no limit over the whole group besides the per-rank one.
    - ``delay_s=0.0``: restart at once. RLlib waits 60 s by default; a recreated actor
      here is ready in ~1 s, and the per-rank limit already stops thrashing.
    - ``health_probe_timeout_s=30.0``: how long a ping, a ``set_state`` restore or the
      start of a recreated actor may take before the rank counts as unhealthy.
    - ``ignore_failures=False``: a call that meets a dead worker raises an error naming the
      rank. With ``True`` broadcast-style calls go on with the workers left (sharded or
      per-worker data calls never drop a shard: they restart the rank first or raise).
    - ``restart_on_error=False``: an exception raised by the worker's code leaves it
      healthy. ``True`` is RLlib's rule: the worker is marked unhealthy and restarted
      (or left out, with ``ignore_failures``) as if it had died.
    - ``capture_state_from="get_state"``: results of this worker method, returned by any
      call style, are kept per rank and given to ``set_state`` after that rank restarts
      (``None``: only states given to ``group.register_state`` are restored).

    The policy also covers start-up: a worker whose process dies in ``__init__`` is
    started again (counted against its restarts) instead of failing the launch.
    ``RestartPolicy.never()`` is the policy of a group launched without one: health is
    tracked, nothing is restarted, a dead rank raises.
    """

    max_restarts_per_worker: int = 5
    max_restarts_total: int | None = None
    delay_s: float = 0.0
    health_probe_timeout_s: float = 30.0
    ignore_failures: bool = False
    restart_window_s: float | None = None
    restart_on_error: bool = False
    capture_state_from: str | None = "get_state"

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
        w = self.restart_window_s
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise TypeError(
                    f"restart_window_s must be a number or None, got {type(w).__name__}"
                )
            if w <= 0:
                raise ValueError(f"restart_window_s must be > 0, got {w}")
        for name in ("ignore_failures", "restart_on_error"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool")
        if self.capture_state_from is not None and not isinstance(self.capture_state_from, str):
            raise TypeError("capture_state_from must be a worker method name or None")

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


class Members(Protocol):
    """What the restart machinery needs of a group's members (``launch.Roster`` is one)."""

    name: str
    launch_timeout_s: float

    def actor(self, rank: int) -> Any: ...

    def respawn(self, rank: int, timeout: float) -> Any: ...

    def install(self, rank: int, spawned: Any) -> Any: ...

    def discard(self, spawned: Any) -> None: ...

    def has_method(self, name: str) -> bool: ...


class FaultState:
    """Per-group health and restarts. The group and its collect path use only its methods."""

    def __init__(
        self,
        members: Members,
        policy: RestartPolicy,
        on_restored: Callable[[list[int]], None],
    ):
        self._members_ref = weakref.ref(members)
        self._on_restored = on_restored
        self.policy = policy
        self._cond = threading.Condition(threading.RLock())
        self._health: list[WorkerHealth] = []
        # Ranks not healthy: the call path tests only this set's truthiness.
        self.not_healthy: set[int] = set()
        self._attempts: list[list[float]] = []  # per rank: times of restart attempts
        self._attempts_total = 0
        self._recoveries = 0
        self._recovered_since_probe: set[int] = set()
        self._events: list[HealthEvent] = []
        self._states: dict[int, Any] = {}
        self._restarting: dict[int, threading.Thread] = {}
        self._closed = False

    # -- setup ----------------------------------------------------------------------------
    def reset(self, world: int, startup_restarts: dict[int, int] | None = None) -> None:
        """Every rank healthy; ``startup_restarts`` are restarts already done in start-up."""
        with self._cond:
            self._health = [WorkerHealth.HEALTHY] * world
            self.not_healthy = set()
            now = time.monotonic()
            self._attempts = [[] for _ in range(world)]
            for rank, n in (startup_restarts or {}).items():
                self._attempts[rank].extend([now] * n)
                self._attempts_total += n
                self._recoveries += n
                self._events.extend(
                    HealthEvent(
                        rank,
                        WorkerHealth.RESTARTING,
                        WorkerHealth.HEALTHY,
                        STARTUP_RESTART,
                        time.time(),
                    )
                    for _ in range(n)
                )
            self._closed = False

    def start_watching(self) -> None:
        members = self._members_ref()
        if members is None:
            return
        for rank in range(len(self._health)):
            _MONITOR.watch(self, rank, members.actor(rank))

    def close(self) -> None:
        """The group shuts down: stop watching; restarts under way give up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        _MONITOR.forget(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def gone(self) -> bool:
        """The group was shut down or garbage-collected."""
        return self._closed or self._members_ref() is None

    # -- reading --------------------------------------------------------------------------
    def health(self) -> list[WorkerHealth]:
        with self._cond:
            return list(self._health)

    def events(self) -> list[HealthEvent]:
        with self._cond:
            return list(self._events)

    @property
    def recoveries(self) -> int:
        return self._recoveries

    def restarting(self) -> list[int]:
        with self._cond:
            return sorted(self._restarting)

    def restart_attempts(self, rank: int) -> int:
        """Restart attempts of ``rank`` that count against the policy now."""
        with self._cond:
            return len(self._counted(rank))

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` holds (re-checked on every health change)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout=timeout)

    # -- state to restore -----------------------------------------------------------------
    def remember_states(self, ranks: list[int], states: list[Any]) -> None:
        """The states restored (``set_state``) after these ranks restart."""
        with self._cond:
            for r, st in zip(ranks, states):
                self._states[r] = st

    # -- health ---------------------------------------------------------------------------
    def _set(self, rank: int, new: WorkerHealth, reason: str) -> None:
        old = self._health[rank]
        if old == new:
            return
        self._health[rank] = new
        if new == WorkerHealth.HEALTHY:
            self.not_healthy.discard(rank)
        else:
            self.not_healthy.add(rank)
        self._events.append(HealthEvent(rank, old, new, reason, time.time()))
        logger.info("rank %d: %s -> %s (%s)", rank, old.value, new.value, reason)
        self._cond.notify_all()

    def _counted(self, rank: int) -> list[float]:
        window = self.policy.restart_window_s
        if window is None:
            return self._attempts[rank]
        since = time.monotonic() - window
        return [t for t in self._attempts[rank] if t >= since]

    def can_restart(self, rank: int) -> bool:
        p = self.policy
        if not p.restarts_enabled or len(self._counted(rank)) >= p.max_restarts_per_worker:
            return False
        return p.max_restarts_total is None or self._attempts_total < p.max_restarts_total

    def observe_death(self, rank: int, actor_id: Any, reason: str) -> None:
        """The actor ``actor_id`` of ``rank`` died; restart it if the policy allows."""
        members = self._members_ref()
        with self._cond:
            if self._closed or members is None or rank >= len(self._health):
                return
            if members.actor(rank)._actor_id != actor_id:
                return  # an older incarnation; the rank was already replaced
            if self._health[rank] in (WorkerHealth.RESTARTING, WorkerHealth.DEAD):
                return
            if rank in self._restarting:
                return
            self._set(rank, WorkerHealth.UNHEALTHY, reason)
            self._schedule_or_bury(rank, reason)

    def fail(self, rank: int, reason: str) -> None:
        """``rank`` failed although its process answered (``restart_on_error``): take it out
        of service and restart it if the policy allows."""
        with self._cond:
            if self._closed or self._health[rank] != WorkerHealth.HEALTHY:
                return
            self._set(rank, WorkerHealth.UNHEALTHY, reason)
            self._schedule_or_bury(rank, reason)

    def _schedule_or_bury(self, rank: int, reason: str) -> None:
        if self.can_restart(rank):
            t = threading.Thread(
                target=self._restart, args=(rank,), name=f"phalanx-restart-{rank}", daemon=True
            )
            self._restarting[rank] = t
            t.start()
        else:
            self._set(rank, WorkerHealth.DEAD, f"no restart left after: {reason}")

    def suspect(self, rank: int) -> None:
        """A call on ``rank`` failed as if its actor died: check with a ping."""
        members = self._members_ref()
        if members is None or self._closed or self._health[rank] != WorkerHealth.HEALTHY:
            return
        actor = members.actor(rank)
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
            with self._cond:
                if self._restarting.get(rank) is threading.current_thread():
                    del self._restarting[rank]
                self._cond.notify_all()

    def _restart_once(self, rank: int) -> None:
        members = self._members_ref()
        with self._cond:
            if self._closed or members is None:
                return
            self._attempts[rank].append(time.monotonic())
            self._attempts_total += 1
            n = len(self._attempts[rank])
            self._set(rank, WorkerHealth.RESTARTING, f"restart attempt {n}")
        timeout = max(self.policy.health_probe_timeout_s, 1.0)
        try:
            spawned = members.respawn(rank, timeout=members.launch_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to start counts against the rank
            with self._cond:
                reason = f"restart failed: {_first_line(e)}"
                self._set(rank, WorkerHealth.UNHEALTHY, reason)
                if not self._closed:
                    self._schedule_or_bury(rank, reason)
            return
        with self._cond:
            if self._closed:  # the group shut down meanwhile: do not leak the new actor
                members.discard(spawned)
                return
            actor = members.install(rank, spawned)
        _MONITOR.watch(self, rank, actor)
        try:
            self._restore(members, rank, actor, timeout)
        except Exception as e:  # noqa: BLE001 - a failed restore keeps the rank out of calls
            with self._cond:
                self._set(rank, WorkerHealth.UNHEALTHY, f"restore failed: {_first_line(e)}")
            return
        with self._cond:
            self._recoveries += 1
            self._recovered_since_probe.add(rank)
            self._set(rank, WorkerHealth.HEALTHY, "restarted and restored")

    def _restore(self, members: Members, rank: int, actor: Any, timeout: float) -> None:
        with self._cond:
            has_state = rank in self._states
            state = self._states.get(rank)
        if has_state and members.has_method("set_state"):
            ray.get(actor._px_call.remote("set_state", state), timeout=timeout)
        self._on_restored([rank])

    # -- waiting before a call -----------------------------------------------------------
    def in_restore_thread(self, rank: int) -> bool:
        return self._restarting.get(rank) is threading.current_thread()

    def ensure_ready(
        self, ranks: list[int], method: str, skip: bool
    ) -> tuple[list[int], list[int]]:
        """Make ``ranks`` callable: wait for running restarts, restart unhealthy ranks.

        Returns ``(ready, skipped)``. A rank that cannot be made healthy is skipped when
        ``skip`` is true, else a ``WorkerDiedError`` naming it is raised.
        """
        members = self._members_ref()
        wait_s = (members.launch_timeout_s if members else 0.0) + self.policy.health_probe_timeout_s
        deadline = time.monotonic() + wait_s
        ready, skipped = [], []
        for rank in ranks:
            if rank not in self.not_healthy or self.in_restore_thread(rank):
                ready.append(rank)
                continue
            with self._cond:
                while True:
                    h = self._health[rank]
                    if h == WorkerHealth.HEALTHY or self._closed:
                        break
                    if rank in self._restarting:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(min(left, 1.0))
                        continue
                    if h == WorkerHealth.UNHEALTHY and self.can_restart(rank):
                        self._schedule_or_bury(rank, "unhealthy at dispatch")
                        continue
                    break
                h = self._health[rank]
            if h == WorkerHealth.HEALTHY:
                ready.append(rank)
            elif skip:
                skipped.append(rank)
            else:
                raise WorkerDiedError(
                    members.name if members else "?",
                    rank,
                    method,
                    "",
                    "WorkerUnavailable",
                    f"rank {rank} is {h.value} ({self._last_reason(rank)}); "
                    f"restarts used {self.restart_attempts(rank)}/"
                    f"{self.policy.max_restarts_per_worker}",
                )
        return ready, skipped

    def _last_reason(self, rank: int) -> str:
        for e in reversed(self._events):
            if e.rank == rank:
                return e.reason
        return "no event"

    def wait_healthy(self, ranks: list[int], timeout: float) -> bool:
        """Block until every rank in ``ranks`` is healthy (True) or the time is up."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if all(self._health[r] == WorkerHealth.HEALTHY for r in ranks):
                    return True
                # A dead rank, or an unhealthy one with no restart running, stays so.
                settled = all(
                    self._health[r] == WorkerHealth.HEALTHY or r not in self._restarting
                    for r in ranks
                )
                left = deadline - time.monotonic()
                if left <= 0 or settled or self._closed:
                    return False
                self._cond.wait(min(left, 0.5))

    def mark_healthy(self, ranks: list[int]) -> None:
        """Unhealthy ranks that just answered a call are healthy again."""
        with self._cond:
            for r in ranks:
                if self._health[r] == WorkerHealth.UNHEALTHY and r not in self._restarting:
                    self._set(r, WorkerHealth.HEALTHY, "answered a call (mark_healthy)")

    # -- probing ----------------------------------------------------------------------------
    def probe(self, timeout: float) -> list[int]:
        """Ping unhealthy ranks; restore (or restart) them; wait up to ``timeout`` for
        restarts under way; return every rank back since the last probe."""
        members = self._members_ref()
        if members is None:
            return []
        deadline = time.monotonic() + timeout
        with self._cond:
            targets = [r for r, h in enumerate(self._health) if h == WorkerHealth.UNHEALTHY]
            waiting = [r for r, h in enumerate(self._health) if h == WorkerHealth.RESTARTING]
        for rank in targets:
            actor = members.actor(rank)
            alive = True
            try:
                ray.get(actor._px_ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError):
                alive = False
            if alive:
                try:
                    self._restore(members, rank, actor, timeout)
                except Exception as e:  # noqa: BLE001
                    logger.warning("rank %d: restore on probe failed: %s", rank, e)
                    continue
                with self._cond:
                    self._recovered_since_probe.add(rank)
                    self._set(rank, WorkerHealth.HEALTHY, "probe: alive and restored")
            else:
                with self._cond:
                    if rank not in self._restarting:
                        self._schedule_or_bury(rank, "probe: no answer")
        if targets or waiting:
            self.wait_healthy([*targets, *waiting], max(0.0, deadline - time.monotonic()))
        with self._cond:
            back = sorted(self._recovered_since_probe)
            self._recovered_since_probe.clear()
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


def stop_watching(state: FaultState) -> None:
    """Stop the health monitor's watch of ``state``'s workers (benchmarks' baseline)."""
    _MONITOR.forget(state)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


__all__ = [
    "STARTUP_RESTART",
    "FaultState",
    "HealthEvent",
    "Members",
    "RestartPolicy",
    "WorkerHealth",
]
