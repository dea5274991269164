"""Results of group calls: the RLinf-style handle and NeMo-RL's ``MultiWorkerFuture``.

Both wrap plain Ray object refs (or ``ObjectRefGenerator`` for generator methods); a
handle can be waited on with a timeout, polled with ``done()``, or awaited in asyncio.
Both collect through the group's one result path (``group.collector``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import ray

from phalanx._base.checks import check_timeout
from phalanx._base.timing import reduce_durations
from phalanx.group.collect import Collector
from phalanx.observe import trace as _trace

DEFAULT_CALL_TIMEOUT_S = 600.0
# A rank whose process stops answering its health probe (which runs beside the call, in
# the control concurrency group) for this long fails a wait without explicit timeout: a
# stopped or wedged worker is reported within about a minute, while a call that is merely
# long (a training step of minutes) keeps running up to ``call_timeout_s``.
DEFAULT_CALL_SILENCE_S = 60.0


class _GroupBound:
    """The default ``timeout`` of a wait: the group's ``call_timeout_s``."""

    def __repr__(self) -> str:
        return "<the group's call_timeout_s>"


GROUP_BOUND: Any = _GroupBound()


def _seconds_env(name: str, default: float | None) -> float | None:
    """``$name`` as seconds > 0, or None for ``none``; ``default`` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() == "none":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be seconds > 0 or 'none', got {raw!r}")
    return value


def default_call_timeout() -> float | None:
    """A new group's ``call_timeout_s``: ``$PHALANX_CALL_TIMEOUT_S`` (seconds > 0, or
    ``none`` for no bound), else ``DEFAULT_CALL_TIMEOUT_S``."""
    return _seconds_env("PHALANX_CALL_TIMEOUT_S", DEFAULT_CALL_TIMEOUT_S)


def call_silence_bound() -> float | None:
    """How long a wait without an explicit timeout lets a called rank leave its health
    probe unanswered before it fails naming that rank: ``$PHALANX_CALL_SILENCE_S``
    (seconds > 0, or ``none``), else ``DEFAULT_CALL_SILENCE_S``. Read at each wait."""
    return _seconds_env("PHALANX_CALL_SILENCE_S", DEFAULT_CALL_SILENCE_S)


def _bound(timeout: Any, group: Any) -> float | None:
    if timeout is GROUP_BOUND:
        return getattr(group, "call_timeout_s", None)
    return check_timeout(timeout)


def _silence(timeout: Any) -> float | None:
    """The health-probe bound of a wait: only when no timeout was given."""
    return call_silence_bound() if timeout is GROUP_BOUND else None


class GroupHandle:
    """The result of one call on a group (RLinf's handle).

    ``wait()`` returns one result per called rank, in rank order (without the ranks in
    ``skipped``: left out because they were dead, with ``ignore_failures``).

    Args:
        group: the group that made the call.
        method: the method's name.
        ranks: the called ranks.
        refs: one Ray ref (or generator) per called rank.
    """

    __slots__ = ("group", "method", "ranks", "refs", "skipped", "_durations")

    def __init__(self, group: Any, method: str, ranks: list[int], refs: list[Any]):
        self.group = group
        self.method = method
        self.ranks = ranks
        self.refs = refs
        self.skipped: list[int] = []
        self._durations: dict[str, float] | None = None

    def wait(self, timeout: float | None = GROUP_BOUND) -> list[Any]:
        """Block until every called rank returned (or ``timeout`` seconds passed).

        With no ``timeout`` the group's ``call_timeout_s`` bounds the wait (600 s unless
        set), and a called rank that leaves its health probe unanswered for
        ``PHALANX_CALL_SILENCE_S`` (60 s) fails it: a stopped worker cannot hang the caller;
        ``None`` waits without a bound. A timeout raises ``HangTimeoutError`` naming the ranks that did not answer,
        with their stacks where they could be taken. ``timeout=0`` polls: the results if every rank finished, else a
        ``GroupTimeoutError`` naming the ranks still running (no hang report is written).
        A negative timeout is a ``ValueError``.

        Args:
            timeout: seconds to wait (``None``: no bound; 0 polls).

        Returns:
            The results in rank order.

        Raises:
            WorkerError: a rank's method raised (``WorkerDiedError`` when its process died).
            HangTimeoutError: the time ran out.
            GroupTimeoutError: ``timeout=0`` and some ranks are still running.
            ValueError: ``timeout`` is negative.
        """
        if _trace.ON:
            with _trace.traced_wait(self):
                return self._wait(timeout)
        return self._wait(timeout)

    def _wait(self, timeout: Any) -> list[Any]:
        silence = _silence(timeout)
        timeout = _bound(timeout, self.group)
        values, dropped = self.group.collector.wait_all(
            self.method, self.ranks, self.refs, timeout, silence_s=silence
        )
        if dropped:
            self.skipped = sorted({*self.skipped, *dropped})
        return values

    def done(self) -> bool:
        """True when every called rank has finished (successfully or not).

        Returns:
            True when every called rank finished.
        """
        plain = [r for r in self.refs if isinstance(r, ray.ObjectRef)]
        if len(plain) != len(self.refs):
            return all(getattr(g, "is_finished", lambda: False)() for g in self.refs)
        ready, _ = ray.wait(plain, num_returns=len(plain), timeout=0, fetch_local=False)
        return len(ready) == len(plain)

    async def async_wait(self) -> list[Any]:
        """Await the results without blocking the event loop.

        Returns:
            The results in rank order.
        """
        if all(isinstance(r, ray.ObjectRef) for r in self.refs):
            await asyncio.wait([asyncio.wrap_future(r.future()) for r in self.refs])
        return await asyncio.get_running_loop().run_in_executor(None, self.wait, None)

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.async_wait().__await__()

    def consume_durations(self, reduce: str = "max") -> dict[str, float]:
        """Timer totals recorded by the called ranks since their last consume, reduced across ranks.

        Args:
            reduce: how to combine the ranks' totals: ``"max"``, ``"mean"``, ``"min"`` or ``"sum"``.

        Returns:
            A dict from timer tag to seconds.
        """
        if self._durations is None:
            actors = self.group.actors
            per_rank = ray.get(
                [actors[r]._px_pop_durations.remote() for r in self.ranks], timeout=60
            )
            self._durations = reduce_durations(per_rank, reduce)
        return dict(self._durations)

    def __repr__(self) -> str:
        return f"GroupHandle({self.group.name}.{self.method}, ranks={self.ranks})"


@dataclass
class MultiWorkerFuture:
    """NeMo-RL's container of futures with the workers called and the workers to return from.

    ``method`` names the call in errors (set by the group; for a future built from bare
    refs the group looks it up).

    Attributes:
        futures: one Ray ref per called worker.
        return_from_workers: the workers whose results ``get_results`` returns (all if None).
        called_workers: the workers called, in the order of ``futures``.
        method: the method's name.
    """

    futures: list[Any]
    return_from_workers: list[int] | None = None
    called_workers: list[int] | None = None
    method: str | None = None

    def _selected(self) -> list[tuple[int, Any]]:
        called = (
            self.called_workers
            if self.called_workers is not None
            else list(range(len(self.futures)))
        )
        pairs = list(zip(called, self.futures))
        if self.return_from_workers is None:
            return pairs
        wanted = set(self.return_from_workers)
        return [(w, f) for w, f in pairs if w in wanted]

    def get_results(
        self,
        worker_group: Any,
        return_generators_as_proxies: bool = False,
        timeout: float | None = GROUP_BOUND,
    ) -> list[Any]:
        """Results of the workers in ``return_from_workers`` (all called workers if None).

        With no ``timeout``, ``worker_group.call_timeout_s`` bounds the wait (``None``: no
        bound), as for ``GroupHandle.wait``.

        For generator methods, items of all selected workers are concatenated in worker
        order, or with ``return_generators_as_proxies`` the generators are returned as is.

        Args:
            worker_group: the group that made the call.
            return_generators_as_proxies: return generator methods' generators as they are.
            timeout: seconds to wait (``None``: no bound).

        Returns:
            The results of the selected workers, in worker order.

        Raises:
            WorkerError: a worker's method raised.
            HangTimeoutError: the time ran out.
        """
        selected = self._selected()
        if return_generators_as_proxies:
            return [f for _, f in selected]
        ranks = [w for w, _ in selected]
        refs = [f for _, f in selected]
        collector = getattr(worker_group, "collector", None)
        if not isinstance(collector, Collector):
            collector = Collector(None, None, name=getattr(worker_group, "name", "group"))
        method = self.method or collector.label_of(self.futures)
        results, _ = collector.wait_all(
            method, ranks, refs, _bound(timeout, worker_group), silence_s=_silence(timeout)
        )
        if any(isinstance(r, ray.ObjectRefGenerator) for r in refs):
            return [item for items in results for item in items]
        return results


__all__ = ["GroupHandle", "MultiWorkerFuture", "call_silence_bound", "default_call_timeout"]
