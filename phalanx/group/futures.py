"""Results of group calls: the RLinf-style handle and NeMo-RL's ``MultiWorkerFuture``.

Both wrap plain Ray object refs (or ``ObjectRefGenerator`` for generator methods); a
handle can be waited on with a timeout, polled with ``done()``, or awaited in asyncio.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from phalanx._base import trace as _trace
from phalanx._base.errors import GroupTimeoutError, WorkerDiedError, WorkerError
from phalanx._base.timing import reduce_durations

if TYPE_CHECKING:
    from phalanx.group.group import WorkerGroup


def _unwrap(group: str, method: str, rank: int, err: BaseException) -> BaseException:
    """Turn Ray's wrappers into phalanx errors naming group, rank and method."""
    if isinstance(err, RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, WorkerError):
            return cause
        if isinstance(cause, RayActorError):
            err = cause
        else:
            return WorkerError(
                group,
                rank,
                method,
                str(err),
                type(cause).__name__ if cause else "RayTaskError",
                str(cause),
            )
    if isinstance(err, RayActorError):
        return WorkerDiedError(group, rank, method, "", type(err).__name__, _short(err))
    return err


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def get_results(
    group: str, method: str, ranks: list[int], refs: list[Any], timeout: float | None
) -> list[Any]:
    """``ray.get`` with errors that name the rank, and a timeout that names the stragglers."""
    plain = [r for r in refs if not isinstance(r, ray.ObjectRefGenerator)]
    if len(plain) == len(refs):
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            done = set(ready)
            pending = [rk for rk, r in zip(ranks, refs) if r not in done]
            raise GroupTimeoutError(group, method, pending, timeout) from None
        except (RayTaskError, RayActorError):
            pass  # find the first failing rank below, in rank order
        # Fetch every rank (so no error goes unreported as "unhandled"), raise the first.
        first: BaseException | None = None
        results = []
        for rank, ref in zip(ranks, refs):
            try:
                results.append(ray.get(ref, timeout=timeout))
            except (RayTaskError, RayActorError) as e:
                first = first or _unwrap(group, method, rank, e)
        if first is not None:
            raise first
        return results
    # Generator methods: each rank's items, in order.
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for rank, gen in zip(ranks, refs):
        items = []
        for item_ref in gen:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                items.append(ray.get(item_ref, timeout=left))
            except GetTimeoutError:
                raise GroupTimeoutError(group, method, [rank], timeout) from None
            except (RayTaskError, RayActorError) as e:
                raise _unwrap(group, method, rank, e) from None
        out.append(items)
    return out


class GroupHandle:
    """The result of one call on a group (RLinf's handle).

    ``wait()`` returns one result per called rank, in rank order.
    """

    __slots__ = ("group", "method", "ranks", "refs", "skipped", "_durations")

    def __init__(self, group: WorkerGroup, method: str, ranks: list[int], refs: list[Any]):
        self.group = group
        self.method = method
        self.ranks = ranks
        self.refs = refs
        # Ranks left out because they were dead (fault tolerance with ignore_failures).
        self.skipped: list[int] = []
        self._durations: dict[str, float] | None = None

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Block until every called rank returned (or ``timeout`` seconds passed)."""
        if _trace.ON:
            with _trace.traced_wait(self):
                return self.group._collect(self, timeout)
        return self.group._collect(self, timeout)

    def done(self) -> bool:
        """True when every called rank has finished (successfully or not)."""
        plain = [r for r in self.refs if isinstance(r, ray.ObjectRef)]
        if len(plain) != len(self.refs):
            return all(getattr(g, "is_finished", lambda: False)() for g in self.refs)
        ready, _ = ray.wait(plain, num_returns=len(plain), timeout=0, fetch_local=False)
        return len(ready) == len(plain)

    async def async_wait(self) -> list[Any]:
        """Await the results without blocking the event loop."""
        if all(isinstance(r, ray.ObjectRef) for r in self.refs):
            await asyncio.wait([asyncio.wrap_future(r.future()) for r in self.refs])
        return await asyncio.get_running_loop().run_in_executor(None, self.wait, None)

    def __await__(self) -> Generator[Any, None, list[Any]]:
        return self.async_wait().__await__()

    def consume_durations(self, reduce: str = "max") -> dict[str, float]:
        """Timer totals recorded by the called ranks since their last consume, reduced across ranks."""
        if self._durations is None:
            per_rank = self.group._pop_durations(self.ranks)
            self._durations = reduce_durations(per_rank, reduce)
        return dict(self._durations)

    def __repr__(self) -> str:
        return f"GroupHandle({self.group.name}.{self.method}, ranks={self.ranks})"


@dataclass
class MultiWorkerFuture:
    """NeMo-RL's container of futures with the workers called and the workers to return from."""

    futures: list[Any]
    return_from_workers: list[int] | None = None
    called_workers: list[int] | None = None

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
        worker_group: WorkerGroup,
        return_generators_as_proxies: bool = False,
        timeout: float | None = None,
    ) -> list[Any]:
        """Results of the workers in ``return_from_workers`` (all called workers if None).

        For generator methods, items of all selected workers are concatenated in worker
        order, or with ``return_generators_as_proxies`` the generators are returned as is.
        """
        selected = self._selected()
        if return_generators_as_proxies:
            return [f for _, f in selected]
        ranks = [w for w, _ in selected]
        refs = [f for _, f in selected]
        name = getattr(worker_group, "name", "group")
        try:
            results = get_results(name, "<future>", ranks, refs, timeout)
        except GroupTimeoutError as e:
            hang = getattr(worker_group, "_hang_error", None)  # adds the stuck ranks' stacks
            if hang is None:
                raise
            raise hang("<future>", ranks, refs, e.pending_ranks, e.timeout) from None
        if any(isinstance(r, ray.ObjectRefGenerator) for r in refs):
            return [item for items in results for item in items]
        return results
