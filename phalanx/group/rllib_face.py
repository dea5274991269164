"""RLlib's face of a group: ``foreach_worker*``, async requests, health counts and probes.

Names and defaults are those of RLlib's ``EnvRunnerGroup`` and ``FaultTolerantActorManager``
(``foreach_actor``, ``fetch_ready_async_reqs``, ``probe_unhealthy_actors``,
``set_actor_state``). Worker ids are the group's 0-based ranks. Every call goes through
the group's one dispatch (``WorkerGroup._call``) and its collector; the keyword arguments
the ``foreach`` forms share travel in one :class:`ForeachOptions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx._base.checks import check_int, check_rank, check_timeout
from phalanx.group import dispatch
from phalanx.group.collect import Collector
from phalanx.group.fault import FaultState, WorkerHealth
from phalanx.group.futures import GroupHandle
from phalanx.group.requests import AsyncRequests, AsyncSubmission, as_results
from phalanx.group.results import RemoteCallResults

logger = logging.getLogger(__name__)

Funcs = Callable[[Any], Any] | str | list[Callable[[Any], Any] | str]
FuncsWithId = Callable[[int, Any], Any] | str | list[Callable[[int, Any], Any] | str]


@dataclass
class ForeachOptions:
    """The keyword arguments of RLlib's ``foreach_*`` calls, as one value."""

    kwargs: dict[str, Any] | None = None
    healthy_only: bool = True
    remote_worker_ids: list[int] | None = None
    timeout_seconds: float | None = None
    return_obj_refs: bool = False
    mark_healthy: bool = False
    with_id: bool = False


def _ping(worker: Any) -> None:
    """What ``probe_unhealthy_actors`` runs on a worker: an answer proves it serves calls."""
    return None


class RllibFace:
    """Mixin of ``WorkerGroup``: RLlib's methods over the group's call path and fault state.

    The group provides the attributes annotated here (its roster, fault state, collector,
    request book, and the dispatch ``_call``).
    """

    name: str
    world_size: int
    max_requests_in_flight_per_worker: int
    _all_ranks: list[int]
    _fault: FaultState
    _collector: Collector
    _requests: AsyncRequests
    _call: Callable[..., GroupHandle]
    _check_live: Callable[[], None]
    _check_method: Callable[[str], None]
    _broadcast_health: Callable[[], str]

    # ------------------------------------------------------------------ foreach
    def _foreach(
        self, func: Any, opts: ForeachOptions
    ) -> tuple[RemoteCallResults, GroupHandle | None, list[int]]:
        """Start a ``foreach`` call and collect what finishes within the timeout:
        ``(outcomes, handle or None when no rank was selected, ranks still running)``."""
        timeout = check_timeout(opts.timeout_seconds, "timeout_seconds")
        self._check_live()
        ranks, func = self._select(func, opts.healthy_only, opts.remote_worker_ids)
        plan = dispatch.foreach(
            func, ranks, opts.kwargs, with_id=opts.with_id, check_method=self._check_method
        )
        if not ranks:
            return RemoteCallResults(), None, []
        health = self._broadcast_health() if opts.healthy_only else "any"
        handle = self._call(plan.method or plan.label, plan.calls, fn=plan.fn, health=health)
        results, pending = self._collector.ready(
            handle.method,
            handle.ranks,
            handle.refs,
            timeout,
            return_obj_refs=opts.return_obj_refs,
            mark_healthy=opts.mark_healthy,
        )
        return results, handle, pending

    def _select(
        self, func: Any, healthy_only: bool, remote_worker_ids: list[int] | None
    ) -> tuple[list[int], Any]:
        return dispatch.foreach_select(
            self._all_ranks,
            self.world_size,
            func,
            healthy_only=healthy_only,
            not_healthy=self._fault.not_healthy,
            remote_worker_ids=remote_worker_ids,
        )

    def _foreach_values(self, func: Any, opts: ForeachOptions) -> list[Any]:
        """The plain-values form of ``_foreach`` (RLlib's ``foreach_worker``)."""
        results, handle, pending = self._foreach(func, opts)
        if handle is None:
            return []
        if opts.return_obj_refs:
            return [r.get() for r in results]
        out = [v for _, v in self._collector.values(handle.method, results)]
        if opts.timeout_seconds is not None:
            self._collector.after_timeout(
                handle.method, handle.ranks, handle.refs, pending, float(opts.timeout_seconds)
            )
        return out

    def foreach_worker(
        self,
        func: Funcs,
        *,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[Any]:
        """Run ``func(worker)`` (or the method named ``func``) on each selected worker.

        ``healthy_only`` skips workers not healthy (with a list of functions, one per
        selected worker, the skipped workers' functions are dropped); ``remote_worker_ids``
        selects ranks. Results come back in rank order. A failed call raises its error,
        unless the policy ignores failures (it is then left out and logged). With
        ``timeout_seconds`` a call still running then produces a hang report and a
        :class:`~phalanx.group.hang.HangTimeoutError` (with ``ignore_failures``: the finished
        results, and a warning naming the report); ``timeout_seconds=0`` returns what is
        ready at once, without a report. ``return_obj_refs`` returns the finished calls'
        refs; ``mark_healthy``: unhealthy workers that answer are healthy again.

        Args:
            func: a function of the worker, a method name, or a list of them, one per worker.
            kwargs: keyword arguments of ``func``.
            healthy_only: skip workers not healthy.
            remote_worker_ids: the ranks to call (every rank if None).
            timeout_seconds: seconds to wait (no bound if None; 0 returns what is ready).
            return_obj_refs: return the finished calls' Ray refs.
            mark_healthy: unhealthy workers that answer are healthy again.

        Returns:
            The results in rank order.

        Raises:
            WorkerError: a call raised (unless the policy ignores failures).
            HangTimeoutError: a call was still running after ``timeout_seconds``.
        """
        opts = ForeachOptions(
            kwargs, healthy_only, remote_worker_ids, timeout_seconds, return_obj_refs, mark_healthy
        )
        return self._foreach_values(func, opts)

    def foreach_worker_with_id(
        self,
        func: FuncsWithId,
        *,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Like ``foreach_worker`` with ``func(worker_id, worker)``; the id is the rank.

        Args:
            func: a function of ``(worker_id, worker)``, or a list of them.
            healthy_only, remote_worker_ids, timeout_seconds: as for ``foreach_worker``.
            return_obj_refs, mark_healthy, kwargs: the same.

        Returns:
            The results in rank order.

        Raises:
            WorkerError: a call raised (unless the policy ignores failures).
        """
        opts = ForeachOptions(
            kwargs, healthy_only, remote_worker_ids, timeout_seconds, return_obj_refs, mark_healthy
        )
        opts.with_id = True
        return self._foreach_values(func, opts)

    def foreach_actor(
        self,
        func: Funcs,
        *,
        healthy_only: bool = True,
        remote_actor_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteCallResults:
        """RLlib's ``FaultTolerantActorManager.foreach_actor``: every finished call's outcome
        (``.actor_id``, ``.ok``, ``.get()``: the result or the error), errors included,
        never raised; calls still running after ``timeout_seconds`` are left out.

        Health follows the group's rule: a dead worker is marked unhealthy; an exception
        does so only with ``RestartPolicy(restart_on_error=True)`` (RLlib's rule).

        Args:
            func: a function of the worker, a method name, or a list of them, one per worker.
            healthy_only: skip workers not healthy.
            remote_actor_ids: the ranks to call (every rank if None).
            timeout_seconds: seconds to wait (no bound if None).
            return_obj_refs: return the results' Ray refs instead of their values.
            mark_healthy: workers out of service that answered are healthy again.
            kwargs: keyword arguments of ``func``.

        Returns:
            The ``RemoteCallResults`` of the finished calls.
        """
        opts = ForeachOptions(
            kwargs, healthy_only, remote_actor_ids, timeout_seconds, return_obj_refs, mark_healthy
        )
        return self._foreach(func, opts)[0]

    # ------------------------------------------------------------------ async requests
    def foreach_worker_async(
        self,
        func: Funcs,
        *,
        tag: str | None = None,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        max_in_flight_per_worker: int | None = None,
    ) -> AsyncSubmission:
        """Start ``func`` on each selected worker without waiting; collect the results
        with ``fetch_ready_async_reqs``.

        A worker that already has ``max_in_flight_per_worker`` requests of this ``tag``
        in flight (default ``group.max_requests_in_flight_per_worker``) is not sent one;
        the returned :class:`~phalanx.group.requests.AsyncSubmission` lists it as skipped
        (and a warning is logged). ``int(submission)`` is the number of requests sent.

        Args:
            func: a function of the worker, a method name, or a list of them.
            tag: the requests' tag, for ``fetch_ready_async_reqs``.
            kwargs: keyword arguments of ``func``.
            healthy_only: skip workers not healthy.
            remote_worker_ids: the ranks to call (every rank if None).
            max_in_flight_per_worker: the most requests of ``tag`` one worker has in flight.

        Returns:
            The ``AsyncSubmission``: the ranks sent a request and those skipped.

        Raises:
            TypeError: ``tag`` is not a str or None.
        """
        budget = (
            self.max_requests_in_flight_per_worker
            if max_in_flight_per_worker is None
            else max_in_flight_per_worker
        )
        budget = check_int(budget, "max_in_flight_per_worker", minimum=1)
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag must be a str or None, got {type(tag).__name__}")
        self._check_live()
        ranks, func = self._select(func, healthy_only, remote_worker_ids)
        counts = self._requests.counts(tag)
        send = [r for r in ranks if counts.get(r, 0) < budget]
        over = [r for r in ranks if counts.get(r, 0) >= budget]
        if isinstance(func, list):
            func = [f for f, r in zip(func, ranks) if r in set(send)]
        sub = AsyncSubmission(tag=tag, skipped=over)
        if send:
            plan = dispatch.foreach(
                func, send, kwargs, with_id=False, check_method=self._check_method
            )
            handle = self._call(
                plan.method or plan.label, plan.calls, fn=plan.fn, health=self._broadcast_health()
            )
            sub.skipped = sorted([*over, *handle.skipped])
            sub.sent = list(handle.ranks)
            self._requests.add(tag, handle.method, handle.ranks, handle.refs)
        if sub.skipped:
            logger.warning(
                "group %s: foreach_worker_async(tag=%r) skipped ranks %s (over the in-flight "
                "budget of %d or unavailable)",
                self.name,
                tag,
                sub.skipped,
                budget,
            )
        return sub

    def foreach_actor_async(
        self,
        func: Funcs,
        tag: str | None = None,
        *,
        healthy_only: bool = True,
        remote_actor_ids: list[int] | None = None,
    ) -> int:
        """RLlib's ``FaultTolerantActorManager.foreach_actor_async``: the number of requests sent.

        Args:
            func: a function of the worker, a method name, or a list of them.
            tag: the requests' tag, for ``fetch_ready_async_reqs``.
            healthy_only: skip workers not healthy.
            remote_actor_ids: the ranks to call (every rank if None).

        Returns:
            The number of requests sent.
        """
        return int(
            self.foreach_worker_async(
                func, tag=tag, healthy_only=healthy_only, remote_worker_ids=remote_actor_ids
            )
        )

    def num_in_flight_async_reqs(self, tags: str | list[str] | None = None) -> int:
        """Async requests sent and not yet fetched (of ``tags``, default all).

        Args:
            tags: the tags to count (every tag if None).

        Returns:
            The number of requests.
        """
        return self._requests.num_in_flight(tags)

    def fetch_ready_async_reqs(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[int, Any]]:
        """``(worker_id, result)`` of the async requests (of ``tags``) that are done.

        Waits up to ``timeout_seconds`` for the requests in flight (``None``: until every
        one has finished; 0: only what is ready now). A request whose worker raised (or
        died) raises its error, unless the policy ignores failures (then it is logged and
        left out). When a fetch raises, every other outcome of it (results and further
        errors) is held and handed out by the next fetch.

        Args:
            tags: the tags whose requests to fetch (every tag if None).
            timeout_seconds: seconds to wait for requests in flight.
            return_obj_refs: return the results' Ray refs instead of their values.
            mark_healthy: workers out of service that answered are healthy again.

        Returns:
            A list of ``(worker_id, result)``.

        Raises:
            WorkerError: a request's worker raised or died (unless the policy ignores failures).
        """
        outcomes = self._fetch(tags, timeout_seconds, return_obj_refs, mark_healthy)
        if not self._fault.policy.ignore_failures:
            for i, (_, c) in enumerate(outcomes):
                if not c.ok:
                    self._requests.hold(outcomes[:i] + outcomes[i + 1 :])
                    raise c.get()
        return self._collector.values("async", as_results(outcomes))

    def fetch_ready_async_results(
        self,
        *,
        tags: str | list[str] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> RemoteCallResults:
        """RLlib's ``FaultTolerantActorManager.fetch_ready_async_reqs`` form: the outcomes
        of the done requests (``.actor_id``, ``.ok``, ``.get()``), errors included.

        Args:
            tags, timeout_seconds, return_obj_refs, mark_healthy: as for
                ``fetch_ready_async_reqs``.

        Returns:
            The ``RemoteCallResults`` of the done requests.
        """
        return as_results(self._fetch(tags, timeout_seconds, return_obj_refs, mark_healthy))

    def _fetch(
        self, tags: Any, timeout_seconds: Any, return_obj_refs: bool, mark_healthy: bool
    ) -> list:
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        return self._requests.fetch(
            self._collector,
            tags,
            timeout,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )

    # ------------------------------------------------------------------ health
    def healthy_worker_ids(self) -> list[int]:
        """Ranks whose worker is healthy (RLlib's worker ids; phalanx ids are 0-based ranks).

        Returns:
            The healthy ranks, in order.
        """
        return self._fault.in_service()

    def num_healthy_workers(self) -> int:
        """The number of healthy workers.

        Returns:
            The number.
        """
        return len(self.healthy_worker_ids())

    def num_healthy_remote_workers(self) -> int:
        """Same as ``num_healthy_workers``: every phalanx worker is remote.

        Returns:
            The number of healthy workers.
        """
        return self.num_healthy_workers()

    def num_remote_workers(self) -> int:
        """The number of workers (all are remote).

        Returns:
            The number.
        """
        return self.world_size

    def num_remote_worker_restarts(self) -> int:
        """How many times a worker was restarted and came back healthy.

        Returns:
            The number of restarts.
        """
        return self._fault.recoveries

    def probe_unhealthy_workers(self, timeout_seconds: float | None = None) -> list[int]:
        """Ping unhealthy workers, restore or restart them; return the ranks that came back.

        A restart already under way is waited for (up to ``timeout_seconds``). Ranks
        restarted in the background since the last probe are included, so a caller that
        re-syncs what came back (as RLlib's algorithms do) misses none.

        Args:
            timeout_seconds: seconds to wait for the pings and restarts.

        Returns:
            The ranks that came back.
        """
        timeout = self._probe_timeout(timeout_seconds)
        self._check_live()
        return self._fault.probe(timeout)

    def _probe_timeout(self, timeout_seconds: Any) -> float:
        if timeout_seconds is None:
            return self._fault.policy.health_probe_timeout_s
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        if timeout == 0:
            raise ValueError("timeout_seconds must be > 0 or None, got 0")
        return timeout

    def is_actor_healthy(self, actor_id: int) -> bool:
        """RLlib's ``FaultTolerantActorManager.is_actor_healthy``: whether rank ``actor_id``
        is in service.

        Args:
            actor_id: the rank.

        Returns:
            Whether it is healthy.

        Raises:
            ValueError: ``actor_id`` is out of range.
        """
        rank = check_rank(actor_id, self.world_size, "actor_id")
        return self._fault.health()[rank] == WorkerHealth.HEALTHY

    def set_actor_state(self, actor_id: int, healthy: bool) -> None:
        """RLlib's ``FaultTolerantActorManager.set_actor_state``: put rank ``actor_id`` in or
        out of service. Out of service, its async requests in flight are dropped (as in
        RLlib) and it is not restarted; a rank being restarted is left to its restart.

        Args:
            actor_id: the rank.
            healthy: True puts it in service, False out.

        Raises:
            ValueError: ``actor_id`` is out of range.
            TypeError: ``healthy`` is not a bool.
        """
        rank = check_rank(actor_id, self.world_size, "actor_id")
        if not isinstance(healthy, bool):
            raise TypeError(f"healthy must be a bool, got {type(healthy).__name__}")
        self._check_live()
        self._fault.set_in_service(rank, healthy, "set_actor_state")
        if not healthy:
            self._requests.drop_rank(rank)

    def take_out_of_service(self, rank: int, reason: str, running: Any = None) -> None:
        """A failure only the caller saw (its call on ``rank`` stalled): out of service and
        restarted per policy, as if it raised; ``running`` (the stalled call's ref) must
        end before a probe pings the rank (``RestartPolicy.until_probed``).

        Args:
            rank: the rank that stalled.
            reason: why, for the health events.
            running: the stalled call's Ray ref.

        Raises:
            ValueError: ``rank`` is out of range.
        """
        self._fault.fail(check_rank(rank, self.world_size, "rank"), reason, running)

    def probe_unhealthy_actors(
        self, timeout_seconds: float | None = None, mark_healthy: bool = False
    ) -> list[int]:
        """RLlib's ``FaultTolerantActorManager.probe_unhealthy_actors``: ping every rank out
        of service (not one being restarted) and return those that answered.

        They stay out of service unless ``mark_healthy`` (RLlib's rule: the caller restores
        their state first, then calls ``set_actor_state``). ``timeout_seconds=None`` waits
        up to the policy's ``health_probe_timeout_s`` (RLlib: no bound).

        Args:
            timeout_seconds: seconds to wait for the pings.
            mark_healthy: put the ranks that answered back in service.

        Returns:
            The ranks that answered.
        """
        timeout = self._probe_timeout(timeout_seconds)
        self._check_live()
        restarting = set(self._fault.restarting())
        out = [
            r
            for r, h in enumerate(self._fault.health())
            if h != WorkerHealth.HEALTHY and r not in restarting
        ]
        if not out:
            return []
        opts = ForeachOptions(healthy_only=False, remote_worker_ids=out, timeout_seconds=timeout)
        answered = [r.actor_id for r in self._foreach(_ping, opts)[0] if r.ok]
        if mark_healthy:
            for rank in answered:
                self._fault.set_in_service(rank, True, "answered a probe (mark_healthy)")
        return answered


__all__ = ["ForeachOptions", "RllibFace"]
