"""RLlib's face of a group: ``foreach_worker*``, async requests, health counts and probes.

Names and defaults are those of RLlib's ``EnvRunnerGroup`` and ``FaultTolerantActorManager``
(``foreach_actor``, ``fetch_ready_async_reqs``, ``probe_unhealthy_actors``,
``set_actor_state``), whose methods ``WorkerGroup`` keeps and hands to the
:class:`RllibFace` it holds. Worker ids are the group's 0-based ranks. Every call goes
through the group's one dispatch (:meth:`CallPath.call`) and its collector; the keyword
arguments the ``foreach`` forms share travel in one :class:`ForeachOptions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx._base.checks import check_int, check_rank, check_timeout
from phalanx.group import dispatch
from phalanx.group.call_path import CallPath
from phalanx.group.fault import WorkerHealth
from phalanx.group.futures import GroupHandle
from phalanx.group.requests import AsyncSubmission, as_results
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
    """RLlib's calls, async requests and health changes over one group's call path.

    Args:
        path: the group's call path.
    """

    def __init__(self, path: CallPath) -> None:
        self._path = path

    # ------------------------------------------------------------------ foreach
    def foreach(
        self, func: Any, opts: ForeachOptions
    ) -> tuple[RemoteCallResults, GroupHandle | None, list[int]]:
        """Start a ``foreach`` call and collect what finishes within the timeout:
        ``(outcomes, handle or None when no rank was selected, ranks still running)``."""
        path = self._path
        timeout = check_timeout(opts.timeout_seconds, "timeout_seconds")
        path.check_live()
        ranks, func = self._select(func, opts.healthy_only, opts.remote_worker_ids)
        plan = dispatch.foreach(
            func, ranks, opts.kwargs, with_id=opts.with_id, check_method=path.check_method
        )
        if not ranks:
            return RemoteCallResults(), None, []
        health = path.broadcast_health() if opts.healthy_only else "any"
        handle = path.call(plan.method or plan.label, plan.calls, fn=plan.fn, health=health)
        results, pending = path.collector.ready(
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
        path = self._path
        return dispatch.foreach_select(
            path.ranks,
            path.world_size,
            func,
            healthy_only=healthy_only,
            not_healthy=path.fault.not_healthy,
            remote_worker_ids=remote_worker_ids,
        )

    def foreach_values(self, func: Any, opts: ForeachOptions) -> list[Any]:
        """The plain-values form of ``foreach`` (RLlib's ``foreach_worker``)."""
        results, handle, pending = self.foreach(func, opts)
        if handle is None:
            return []
        if opts.return_obj_refs:
            return [r.get() for r in results]
        collector = self._path.collector
        out = [v for _, v in collector.values(handle.method, results)]
        if opts.timeout_seconds is not None:
            collector.after_timeout(
                handle.method, handle.ranks, handle.refs, pending, float(opts.timeout_seconds)
            )
        return out

    # ------------------------------------------------------------------ async requests
    def foreach_async(
        self,
        func: Funcs,
        tag: str | None,
        opts: ForeachOptions,
        budget: int,
    ) -> AsyncSubmission:
        """``foreach_worker_async``: at most ``budget`` requests of ``tag`` per worker in
        flight (``opts``: its kwargs, healthy_only and remote_worker_ids)."""
        path = self._path
        budget = check_int(budget, "max_in_flight_per_worker", minimum=1)
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag must be a str or None, got {type(tag).__name__}")
        path.check_live()
        ranks, func = self._select(func, opts.healthy_only, opts.remote_worker_ids)
        counts = path.requests.counts(tag)
        send = [r for r in ranks if counts.get(r, 0) < budget]
        over = [r for r in ranks if counts.get(r, 0) >= budget]
        if isinstance(func, list):
            func = [f for f, r in zip(func, ranks) if r in set(send)]
        sub = AsyncSubmission(tag=tag, skipped=over)
        if send:
            plan = dispatch.foreach(
                func, send, opts.kwargs, with_id=False, check_method=path.check_method
            )
            handle = path.call(
                plan.method or plan.label, plan.calls, fn=plan.fn, health=path.broadcast_health()
            )
            sub.skipped = sorted([*over, *handle.skipped])
            sub.sent = list(handle.ranks)
            path.requests.add(tag, handle.method, handle.ranks, handle.refs)
        if sub.skipped:
            logger.warning(
                "group %s: foreach_worker_async(tag=%r) skipped ranks %s (over the in-flight "
                "budget of %d or unavailable)",
                path.name,
                tag,
                sub.skipped,
                budget,
            )
        return sub

    def fetch_values(
        self, tags: Any, timeout_seconds: Any, return_obj_refs: bool, mark_healthy: bool
    ) -> list[tuple[int, Any]]:
        """``fetch_ready_async_reqs``: ``(worker_id, result)`` of the done requests; the
        first failure raises unless the policy ignores failures."""
        path = self._path
        outcomes = self.fetch(tags, timeout_seconds, return_obj_refs, mark_healthy)
        if not path.fault.policy.ignore_failures:
            for i, (_, c) in enumerate(outcomes):
                if not c.ok:
                    path.requests.hold(outcomes[:i] + outcomes[i + 1 :])
                    raise c.get()
        return path.collector.values("async", as_results(outcomes))

    def fetch(
        self, tags: Any, timeout_seconds: Any, return_obj_refs: bool, mark_healthy: bool
    ) -> list:
        """The ``(tag, outcome)`` of every done request of ``tags``."""
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        return self._path.requests.fetch(
            self._path.collector,
            tags,
            timeout,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )

    # ------------------------------------------------------------------ health
    def probe_unhealthy_workers(self, timeout_seconds: Any) -> list[int]:
        """Restore or restart the unhealthy ranks; the ranks that came back."""
        timeout = self._probe_timeout(timeout_seconds)
        self._path.check_live()
        return self._path.fault.probe(timeout)

    def _probe_timeout(self, timeout_seconds: Any) -> float:
        if timeout_seconds is None:
            return self._path.fault.policy.health_probe_timeout_s
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        if timeout == 0:
            raise ValueError("timeout_seconds must be > 0 or None, got 0")
        return timeout

    def is_actor_healthy(self, actor_id: int) -> bool:
        """Whether rank ``actor_id`` is in service."""
        rank = check_rank(actor_id, self._path.world_size, "actor_id")
        return self._path.fault.health()[rank] == WorkerHealth.HEALTHY

    def set_actor_state(self, actor_id: int, healthy: bool) -> None:
        """Put rank ``actor_id`` in or out of service (out: its async requests dropped)."""
        path = self._path
        rank = check_rank(actor_id, path.world_size, "actor_id")
        if not isinstance(healthy, bool):
            raise TypeError(f"healthy must be a bool, got {type(healthy).__name__}")
        path.check_live()
        path.fault.set_in_service(rank, healthy, "set_actor_state")
        if not healthy:
            path.requests.drop_rank(rank)

    def take_out_of_service(self, rank: int, reason: str, running: Any) -> None:
        """A failure only the caller saw: ``rank`` out of service, restarted per policy."""
        self._path.fault.fail(check_rank(rank, self._path.world_size, "rank"), reason, running)

    def probe_unhealthy_actors(self, timeout_seconds: Any, mark_healthy: bool) -> list[int]:
        """Ping every rank out of service (not being restarted); the ranks that answered."""
        fault = self._path.fault
        timeout = self._probe_timeout(timeout_seconds)
        self._path.check_live()
        restarting = set(fault.restarting())
        out = [
            r
            for r, h in enumerate(fault.health())
            if h != WorkerHealth.HEALTHY and r not in restarting
        ]
        if not out:
            return []
        opts = ForeachOptions(healthy_only=False, remote_worker_ids=out, timeout_seconds=timeout)
        answered = [r.actor_id for r in self.foreach(_ping, opts)[0] if r.ok]
        if mark_healthy:
            for rank in answered:
                fault.set_in_service(rank, True, "answered a probe (mark_healthy)")
        return answered


__all__ = ["ForeachOptions", "RllibFace"]
