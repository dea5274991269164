"""Fault tolerance for any worker group: health, restarts with state restore.

A group carries a :class:`RestartPolicy` (``launch(..., restart_policy=RestartPolicy())``).
Each rank has a health state (its process)::

    healthy --(actor died)--> unhealthy --(restart allowed)--> restarting --> healthy
                                  |                                |
                                  |                                +--(restore failed)--> unhealthy
                                  +--(no restart left)--> dead (for good)

The rule for a plain group: **only a dead process makes a worker unhealthy.** An exception
raised by the worker's code is that call's error (a :class:`~phalanx.WorkerError` naming the
rank, with the remote traceback); the worker answered, so it stays healthy and keeps its
state. A timeout leaves it healthy too (the hang report says where it is stuck).

RLlib's rule (``RestartPolicy.rllib()``, what ``EnvRunnerGroup`` launches its runners
with) adds two things, both here:

- *an exception is a failure* (``restart_on_error``): the rank is restarted (its process
  replaced) if the policy allows, else it stays up but out of service;
- *out of service until probed* (``until_probed``): a rank that failed - its process
  died, its code raised, or its caller reported a stalled call (``FaultState.fail`` with
  the call still ``running``) - leaves ``healthy_worker_ids`` and every ``healthy_only``
  call, and stays out even after its new process is up, until a probe
  (``probe_unhealthy_workers``) restores it (``set_state`` and the restart hooks: latest
  weights) or a ``mark_healthy`` call that it answers brings it back. Each return to
  service counts as one restart (RLlib's count); restarts done while the group starts
  count at once. A rank whose stalled call still runs is not pinged until the call ends.

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

from phalanx._base.checks import check_int, check_number
from phalanx._base.errors import WorkerDiedError
from phalanx.group.monitor import MONITOR, first_line

logger = logging.getLogger(__name__)

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

    Defaults aim at fast recovery (about a second or two on a laptop-class machine).

    Attributes:
        max_restarts_per_worker: (default ``5``) a rank that keeps dying is given up after 5 restart
            attempts (it becomes ``dead``), so a crash loop cannot go on forever.
        restart_window_s: (default ``None``) the per-rank limit counts over the group's whole life.
            With a number, only attempts in the last ``restart_window_s`` seconds count
            (``max_restarts_per_worker`` restarts per window), as long jobs need.
        max_restarts_total: (default ``None``) no limit over the whole group besides the per-rank one.
        delay_s: (default ``0.0``) restart at once. RLlib waits 60 s by default; a recreated actor
            is ready once its process starts, and the per-rank limit already stops thrashing.
        health_probe_timeout_s: (default ``30.0``) how long a ping, a ``set_state`` restore or the
            start of a recreated actor may take before the rank counts as unhealthy.
        ignore_failures: (default ``False``) a call that meets a dead worker raises an error naming the
            rank. With ``True`` broadcast-style calls go on with the workers left (sharded or
            per-worker data calls never drop a shard: they restart the rank first or raise).
        restart_on_error: (default ``False``) an exception raised by the worker's code leaves it
            healthy. ``True`` is RLlib's rule: the worker is marked unhealthy and restarted
            (or left out, with ``ignore_failures``) as if it had died.
        until_probed: (default ``False``) ``True`` is RLlib's service rule (see the module
            docstring): a failed rank stays out of service until a probe brings it back, and
            restarts are counted when that happens.
        capture_state_from: (default ``"get_state"``) results of this worker method, returned by any
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
    until_probed: bool = False

    def __post_init__(self) -> None:
        check_int(self.max_restarts_per_worker, "max_restarts_per_worker", minimum=0)
        if self.max_restarts_total is not None:
            check_int(self.max_restarts_total, "max_restarts_total", minimum=0)
        check_number(self.delay_s, "delay_s", minimum=0)
        if check_number(self.health_probe_timeout_s, "health_probe_timeout_s") <= 0:
            raise ValueError(
                f"health_probe_timeout_s must be > 0, got {self.health_probe_timeout_s}"
            )
        w = self.restart_window_s
        if w is not None and check_number(w, "restart_window_s") <= 0:
            raise ValueError(f"restart_window_s must be > 0, got {w}")
        for name in ("ignore_failures", "restart_on_error", "until_probed"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool")
        if self.capture_state_from is not None and not isinstance(self.capture_state_from, str):
            raise TypeError("capture_state_from must be a worker method name or None")

    @classmethod
    def never(cls, ignore_failures: bool = False) -> RestartPolicy:
        """Track health, never restart.

        Args:
            ignore_failures: leave failed workers out instead of raising.

        Returns:
            The policy.
        """
        return cls(max_restarts_per_worker=0, max_restarts_total=0, ignore_failures=ignore_failures)

    @classmethod
    def rllib(
        cls,
        *,
        restart: bool = True,
        max_restarts: int = 1000,
        delay_s: float = 0.0,
        health_probe_timeout_s: float = 30.0,
        ignore_failures: bool = False,
    ) -> RestartPolicy:
        """RLlib's failure rule (its ``EnvRunnerGroup`` and ``FaultTolerantActorManager``):
        any error takes a worker out of service until a probe; with ``restart`` its
        process is replaced at once (up to ``max_restarts`` times), else a probe that it
        answers brings it back. Only states given to ``register_state`` are restored.

        Args:
            restart: replace a failed worker's process.
            max_restarts: the most restarts per worker.
            delay_s: seconds between a failure and its restart.
            health_probe_timeout_s: seconds a probe waits.
            ignore_failures: leave failed workers out instead of raising.

        Returns:
            The policy.
        """
        return cls(
            max_restarts_per_worker=max_restarts if restart else 0,
            max_restarts_total=None if restart else 0,
            delay_s=delay_s,
            health_probe_timeout_s=health_probe_timeout_s,
            ignore_failures=ignore_failures,
            restart_on_error=True,
            capture_state_from=None,
            until_probed=True,
        )

    @property
    def restarts_enabled(self) -> bool:
        """Whether this policy restarts any worker."""
        return self.max_restarts_per_worker > 0 and self.max_restarts_total != 0


@dataclass(frozen=True)
class HealthEvent:
    """One health transition of one rank (``group.health_events()``).

    Attributes:
        rank: the rank.
        old: its health before.
        new: its health after.
        reason: why it changed.
        time: when (``time.time()``).
    """

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
        # Out of service until probed (``until_probed``): rank -> the ref of its stalled
        # call still running, or None.
        self._out_of_service: dict[int, Any] = {}
        self._death_listeners: list[Callable[[int, str], None]] = []
        self._closed = False

    # -- setup ----------------------------------------------------------------------------
    def reset(self, world: int, startup_restarts: dict[int, int] | None = None) -> None:
        """Every rank healthy; ``startup_restarts`` are restarts already done in start-up."""
        with self._cond:
            self._health = [WorkerHealth.HEALTHY] * world
            self.not_healthy = set()
            self._out_of_service = {}
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
            MONITOR.watch(self, rank, members.actor(rank))

    def close(self) -> None:
        """The group shuts down: stop watching; restarts under way give up."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        MONITOR.forget(self)

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

    def in_service(self) -> list[int]:
        """Ranks that are healthy and not out of service (``until_probed``)."""
        with self._cond:
            return [r for r in range(len(self._health)) if r not in self.not_healthy]

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

    # -- death listeners ------------------------------------------------------------------
    def add_death_listener(self, listener: Callable[[int, str], None]) -> Callable[[], None]:
        """Call ``listener(rank, reason)`` each time a rank's actor is seen dead (once per
        death, after its health changed); returns a function that removes it.

        It runs on the thread that saw the death (the health monitor's, or a caller's whose
        call met the dead actor), so it must return at once: work that takes time belongs
        on a thread of its own. An exception it raises is logged and dropped.
        """
        if not callable(listener):
            raise TypeError(f"listener must be callable, got {type(listener).__name__}")
        with self._cond:
            self._death_listeners.append(listener)

        def remove() -> None:
            with self._cond:
                if listener in self._death_listeners:
                    self._death_listeners.remove(listener)

        return remove

    def _tell_death(
        self, rank: int, reason: str, listeners: list[Callable[[int, str], None]]
    ) -> None:
        for listener in listeners:
            try:
                listener(rank, reason)
            except Exception:  # noqa: BLE001 - a listener never stops the thread that saw it
                logger.exception("rank %d: a death listener raised", rank)

    # -- health ---------------------------------------------------------------------------
    def _set(self, rank: int, new: WorkerHealth, reason: str) -> None:
        old = self._health[rank]
        if old == new:
            return
        self._health[rank] = new
        if new != WorkerHealth.HEALTHY:
            self.not_healthy.add(rank)
            if self.policy.until_probed:
                self._out_of_service.setdefault(rank, None)
        elif rank not in self._out_of_service:
            self.not_healthy.discard(rank)
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
            listeners = list(self._death_listeners)
        self._tell_death(rank, reason, listeners)

    def fail(self, rank: int, reason: str, running: Any = None) -> None:
        """``rank`` failed although its process answered (``restart_on_error``), or its
        call ``running`` stalled: take it out of service and restart it if the policy
        allows. Under ``until_probed`` a rank that cannot be restarted stays up, out of
        service, until it answers a probe (after ``running`` ended)."""
        with self._cond:
            if self._closed or self._health[rank] != WorkerHealth.HEALTHY:
                return
            if self.policy.until_probed:
                self._out_of_service[rank] = running
                self.not_healthy.add(rank)
                if not self.can_restart(rank):
                    logger.info("rank %d: out of service until probed (%s)", rank, reason)
                    self._cond.notify_all()
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
                self.observe_death(rank, actor._actor_id, f"actor died: {first_line(e)}")
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
                reason = f"restart failed: {first_line(e)}"
                self._set(rank, WorkerHealth.UNHEALTHY, reason)
                if not self._closed:
                    self._schedule_or_bury(rank, reason)
            return
        with self._cond:
            if self._closed:  # the group shut down meanwhile: do not leak the new actor
                members.discard(spawned)
                return
            actor = members.install(rank, spawned)
        MONITOR.watch(self, rank, actor)
        try:
            self._restore(members, rank, actor, timeout)
        except Exception as e:  # noqa: BLE001 - a failed restore keeps the rank out of calls
            with self._cond:
                self._set(rank, WorkerHealth.UNHEALTHY, f"restore failed: {first_line(e)}")
            return
        with self._cond:
            if rank in self._out_of_service:
                self._out_of_service[rank] = None  # its stalled call died with the old process
            else:
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
        """Unhealthy (or out of service) ranks that just answered a call are back."""
        with self._cond:
            for r in ranks:
                if self._health[r] == WorkerHealth.UNHEALTHY and r not in self._restarting:
                    self._set(r, WorkerHealth.HEALTHY, "answered a call (mark_healthy)")
                if r in self._out_of_service and self._health[r] == WorkerHealth.HEALTHY:
                    self._back(r)

    def set_in_service(self, rank: int, healthy: bool, reason: str) -> None:
        """Put ``rank`` in service (healthy) or out of it (unhealthy, no restart scheduled);
        a rank being restarted is left to its restart."""
        with self._cond:
            if self._closed or rank in self._restarting:
                return
            self._set(rank, WorkerHealth.HEALTHY if healthy else WorkerHealth.UNHEALTHY, reason)
            if healthy and rank in self._out_of_service:
                self._back(rank)

    def _back(self, rank: int) -> None:
        """``rank`` is back in service: one restart in RLlib's count."""
        del self._out_of_service[rank]
        self.not_healthy.discard(rank)
        self._recoveries += 1
        self._recovered_since_probe.add(rank)
        self._cond.notify_all()

    # -- probing ----------------------------------------------------------------------------
    def probe(self, timeout: float) -> list[int]:
        """Ping unhealthy ranks; restore (or restart) them; wait up to ``timeout`` for
        restarts under way; under ``until_probed`` restore and bring back every rank out
        of service that answers; return every rank back since the last probe."""
        members = self._members_ref()
        if members is None:
            return []
        deadline = time.monotonic() + timeout
        with self._cond:
            waiting = [
                r
                for r, h in enumerate(self._health)
                if h == WorkerHealth.RESTARTING or r in self._restarting
            ]
            targets = [
                r
                for r, h in enumerate(self._health)
                if h == WorkerHealth.UNHEALTHY and r not in waiting
            ]
        for rank in targets:
            actor = members.actor(rank)
            if not self._answers(actor, max(0.1, deadline - time.monotonic())):
                with self._cond:
                    if rank not in self._restarting:
                        self._schedule_or_bury(rank, "probe: no answer")
            elif self.policy.until_probed:
                with self._cond:  # brought back below, with the others out of service
                    self._set(rank, WorkerHealth.HEALTHY, "probe: alive")
            elif self._restored(members, rank, actor, timeout):
                with self._cond:
                    self._recovered_since_probe.add(rank)
                    self._set(rank, WorkerHealth.HEALTHY, "probe: alive and restored")
        if targets or waiting:
            self.wait_healthy([*targets, *waiting], max(0.0, deadline - time.monotonic()))
        if self.policy.until_probed:
            self._probe_out(members)
        with self._cond:
            back = sorted(self._recovered_since_probe)
            self._recovered_since_probe.clear()
        return back

    def _probe_out(self, members: Members) -> None:
        """Restore and bring back the healthy ranks out of service that answer a ping
        (a rank whose stalled call still runs is left for a later probe)."""
        limit = self.policy.health_probe_timeout_s
        with self._cond:
            out = [
                (r, ref)
                for r, ref in self._out_of_service.items()
                if self._health[r] == WorkerHealth.HEALTHY and r not in self._restarting
            ]
        for rank, running in out:
            if running is not None and not ray.wait([running], timeout=0, fetch_local=False)[0]:
                continue
            actor = members.actor(rank)
            if self._answers(actor, limit) and self._restored(members, rank, actor, limit):
                with self._cond:
                    if rank in self._out_of_service:
                        self._back(rank)

    @staticmethod
    def _answers(actor: Any, timeout: float) -> bool:
        try:
            ray.get(actor._px_ping.remote(), timeout=timeout)
            return True
        except (RayActorError, GetTimeoutError):
            return False

    def _restored(self, members: Members, rank: int, actor: Any, timeout: float) -> bool:
        try:
            self._restore(members, rank, actor, timeout)
            return True
        except Exception as e:  # noqa: BLE001 - it stays out; the next probe tries again
            logger.warning("rank %d: restore on probe failed: %s", rank, e)
            return False


__all__ = [
    "STARTUP_RESTART",
    "FaultState",
    "HealthEvent",
    "Members",
    "RestartPolicy",
    "WorkerHealth",
]
