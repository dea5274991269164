"""Async request bookkeeping of a group (RLlib's ``foreach_worker_async`` /
``fetch_ready_async_reqs``): what is in flight, per tag and rank, and what was fetched
but not yet handed out.

Results come back through the group's :class:`~phalanx.group.collect.Collector`, like
every other call. Nothing is dropped silently: a request over the in-flight budget is
listed in the :class:`AsyncSubmission`; when a fetch raises the first failure, every other
outcome of that fetch (results and further errors) is held for the next fetch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from phalanx._base.checks import check_tags
from phalanx.group.collect import Collector
from phalanx.group.results import CallResult, RemoteCallResults, ResultOrError


@dataclass
class AsyncSubmission:
    """What ``foreach_worker_async`` did: the ranks it sent to and those over budget.

    ``int(submission)`` is the number of requests sent (what RLlib returns).

    Attributes:
        tag: the requests' tag.
        sent: the ranks sent a request.
        skipped: the ranks at their in-flight limit, sent none.
    """

    tag: str | None
    sent: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    def __int__(self) -> int:
        return len(self.sent)

    def __index__(self) -> int:
        return len(self.sent)


class AsyncRequests:
    """In-flight async requests of one group and results held between fetches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[Any, tuple[str | None, int, str]] = {}  # ref -> tag, rank, label
        self._held: list[tuple[str | None, CallResult]] = []

    def counts(self, tag: str | None) -> dict[int, int]:
        """Requests of ``tag`` in flight, per rank."""
        out: dict[int, int] = {}
        with self._lock:
            for t, r, _ in self._in_flight.values():
                if t == tag:
                    out[r] = out.get(r, 0) + 1
        return out

    def add(self, tag: str | None, label: str, ranks: list[int], refs: list[Any]) -> None:
        with self._lock:
            for rank, ref in zip(ranks, refs):
                self._in_flight[ref] = (tag, rank, label)

    def num_in_flight(self, tags: str | list[str] | None = None) -> int:
        wanted = check_tags(tags)
        with self._lock:
            return sum(1 for t, _, _ in self._in_flight.values() if wanted is None or t in wanted)

    def fetch(
        self,
        collector: Collector,
        tags: str | list[str] | None,
        timeout: float | None,
        *,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[str | None, CallResult]]:
        """Outcomes of the held results and of the requests (of ``tags``) done within
        ``timeout`` seconds (``None``: wait for every one in flight; 0: only those done)."""
        wanted = check_tags(tags)
        with self._lock:
            got = [(t, c) for t, c in self._held if wanted is None or t in wanted]
            self._held = [(t, c) for t, c in self._held if not (wanted is None or t in wanted)]
            mine = [
                (ref, t, r, label)
                for ref, (t, r, label) in self._in_flight.items()
                if wanted is None or t in wanted
            ]
        if not mine:
            return got
        # Requests of different methods are collected together, labelled one by one.
        wait_s = 0.0 if got else timeout
        refs = [m[0] for m in mine]
        done, _ = collector.ready(
            "async",
            [m[2] for m in mine],
            refs,
            wait_s,
            return_obj_refs=True,
            mark_healthy=False,
        )
        finished = {c.get() for c in done}
        ok_ranks = []
        for ref, tag, rank, label in mine:
            if ref not in finished:
                continue
            with self._lock:
                self._in_flight.pop(ref, None)
            if return_obj_refs:
                got.append((tag, CallResult(rank, ResultOrError(ref))))
                continue
            outcome = collector.outcome(label, rank, ref)
            got.append((tag, CallResult(rank, outcome)))
            if outcome.ok:
                ok_ranks.append(rank)
        if mark_healthy and ok_ranks:
            collector.mark_healthy(ok_ranks)
        return got

    def drop_rank(self, rank: int) -> None:
        """Forget ``rank``'s requests in flight (it was taken out of service)."""
        with self._lock:
            self._in_flight = {k: v for k, v in self._in_flight.items() if v[1] != rank}

    def hold(self, outcomes: list[tuple[str | None, CallResult]]) -> None:
        """Keep ``outcomes`` for the next fetch (ahead of newer ones)."""
        with self._lock:
            self._held[:0] = outcomes

    def clear(self) -> None:
        with self._lock:
            self._in_flight.clear()
            self._held.clear()


def as_results(outcomes: list[tuple[str | None, CallResult]]) -> RemoteCallResults:
    """The outcomes of a fetch as RLlib's result container."""
    return RemoteCallResults([c for _, c in outcomes])


__all__ = ["AsyncRequests", "AsyncSubmission"]
