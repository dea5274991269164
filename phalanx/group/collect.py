"""The one result path of a group: every call style's results come back through here.

``GroupHandle.wait``, ``MultiWorkerFuture.get_results``, ``foreach_worker*`` and
``fetch_ready_async_reqs`` all use a :class:`Collector`, so errors, dead workers,
timeouts, ``ignore_failures`` and hang reports are handled once:

- an exception raised by the worker's code becomes a ``WorkerError`` naming group, rank
  and the call's method (the label the call was made with, never a helper's name);
- a dead worker becomes a ``WorkerDiedError``, and the rank is marked suspect at once (a
  ping confirms the death and the restart policy takes over);
- a whole-group wait fails the moment a death is seen, not when the other ranks finish;
- a wait that times out raises ``HangTimeoutError`` with the stuck ranks' stacks and the
  results of the ranks that finished (``timeout=0`` is a poll: no report is written);
- with ``ignore_failures`` the dead workers' results are left out and named;
- results of the method named by the policy's ``capture_state_from`` are remembered for
  restoring state after a restart (result hooks, keyed by method).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from phalanx._base.checks import check_timeout
from phalanx._base.errors import GroupTimeoutError, WorkerError
from phalanx.group import hang
from phalanx.group.fault import FaultState
from phalanx.group.results import RemoteCallResults, ResultOrError, is_death, unwrap_error

logger = logging.getLogger(__name__)

ResultHook = Callable[[list[int], list[Any]], None]
_LABELS_KEPT = 4096
PROBE_INTERVAL_S = 1.0  # how often a wait probes the ranks still running (silence bound)


class Collector:
    """Collects the results of one group's calls (see the module docstring).

    ``members`` is what hang reports read (name, actors, worker metadata: the group's
    public API); ``fault`` is the group's health state, or None for plain collection.
    """

    def __init__(self, members: hang.Members | None, fault: FaultState | None, name: str = ""):
        self._members = members
        self._fault = fault
        self._name = name
        self._hooks: dict[str, list[ResultHook]] = {}
        self._labels: OrderedDict[Any, str] = OrderedDict()
        self._silenced: set[int] = set()  # marked unhealthy for an unanswered health probe

    @property
    def name(self) -> str:
        return self._members.name if self._members is not None else self._name

    # -- result hooks and labels --------------------------------------------------------
    def add_result_hook(self, method: str, hook: ResultHook) -> Callable[[], None]:
        """Run ``hook(ranks, values)`` with the results of every call of ``method``."""
        hooks = self._hooks.setdefault(method, [])
        hooks.append(hook)

        def remove() -> None:
            if hook in hooks:
                hooks.remove(hook)

        return remove

    def _seen(self, method: str, ranks: list[int], values: list[Any]) -> None:
        if self._silenced and self._fault is not None:
            back = [r for r in ranks if r in self._silenced]
            if back:  # a rank that fell silent answered after all (it was only stopped)
                self._silenced.difference_update(back)
                self._fault.mark_healthy(back)
        hooks = self._hooks.get(method)
        if hooks and ranks:
            for hook in list(hooks):
                hook(ranks, values)

    def note_label(self, refs: list[Any], method: str) -> None:
        """Remember which method produced ``refs`` (for futures built from bare refs)."""
        for ref in refs:
            self._labels[ref] = method
        while len(self._labels) > _LABELS_KEPT:
            self._labels.popitem(last=False)

    def label_of(self, refs: list[Any]) -> str:
        for ref in refs:
            label = self._labels.get(ref)
            if label is not None:
                return label
        return "call"

    # -- one rank's outcome -------------------------------------------------------------
    def outcome(self, method: str, rank: int, ref: Any) -> ResultOrError:
        """The result of a finished call, or its error (deaths and failures acted on)."""
        try:
            return ResultOrError(ray.get(ref))
        except (RayTaskError, RayActorError) as e:
            return ResultOrError(error=self._failure(method, rank, e))

    def _failure(self, method: str, rank: int, e: BaseException) -> BaseException:
        err = unwrap_error(self.name, method, rank, e)
        if isinstance(err, WorkerError) and err.method != method:
            err = type(err)(
                err.group, rank, method, err.remote_traceback, err.cause_type, err.message
            )
        fault = self._fault
        if fault is not None:
            if is_death(err):
                fault.suspect(rank)
            elif fault.policy.restart_on_error:
                fault.fail(rank, f"{method}() raised {getattr(err, 'cause_type', '')}")
        return err

    def _droppable(self, err: BaseException) -> bool:
        """May ``ignore_failures`` leave this error's rank out of a whole-call wait?
        Deaths, and with ``restart_on_error`` any failure; a plain exception is raised."""
        policy = self._fault.policy if self._fault is not None else None
        return is_death(err) or bool(policy and policy.restart_on_error)

    def mark_healthy(self, ranks: list[int]) -> None:
        """Unhealthy ranks that answered are healthy again (RLlib's ``mark_healthy``)."""
        if self._fault is not None and ranks:
            self._fault.mark_healthy(ranks)

    @property
    def _ignore(self) -> bool:
        return self._fault is not None and self._fault.policy.ignore_failures

    # -- whole-call waits (GroupHandle.wait, MultiWorkerFuture.get_results) ----------------
    def wait_all(
        self,
        method: str,
        ranks: list[int],
        refs: list[Any],
        timeout: float | None,
        silence_s: float | None = None,
    ) -> tuple[list[Any], list[int]]:
        """Every called rank's result in order, and the ranks left out (dead, ignored).

        With ``silence_s``, a pending rank whose process leaves its health probe
        unanswered that long fails the wait (``HangTimeoutError`` naming it).
        """
        timeout = check_timeout(timeout)
        if not all(isinstance(r, ray.ObjectRef) for r in refs):
            return self._wait_streams(method, ranks, refs, timeout), []
        try:
            if silence_s is not None and self._members is not None:
                values = self._get_probing(method, ranks, refs, timeout, silence_s)
            else:
                values = ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            done = set(ready)
            pending = [rk for rk, r in zip(ranks, refs) if r not in done]
            raise self.timeout_error(method, ranks, refs, pending, timeout or 0.0) from None
        except (RayTaskError, RayActorError):
            return self._wait_failed(method, ranks, refs, timeout)
        self._seen(method, ranks, values)
        return values, []

    def _get_probing(
        self, method: str, ranks: list[int], refs: list[Any], timeout: float | None,
        silence_s: float,
    ) -> list[Any]:  # fmt: skip
        """``ray.get(refs, timeout)``, probing the pending ranks every second meanwhile;
        raises the hang error naming the ranks silent for ``silence_s``."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        actors = self._members.actors
        heard = dict.fromkeys(ranks, start)  # when each rank last answered a probe
        probes: dict[int, Any] = {}
        while True:
            now = time.monotonic()
            step = PROBE_INTERVAL_S if deadline is None else min(PROBE_INTERVAL_S, deadline - now)
            try:
                return ray.get(refs, timeout=max(step, 0.0))
            except GetTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            done = set(ready)
            pending = [rk for rk, r in zip(ranks, refs) if r not in done]
            now = time.monotonic()
            for rank in pending:
                probe = probes.get(rank)
                if probe is not None and ray.wait([probe], timeout=0, fetch_local=False)[0]:
                    heard[rank] = now
                    probe = None
                if probe is None:
                    probes[rank] = actors[rank]._px_ping.remote()
            silent = [rk for rk in pending if now - heard[rk] >= silence_s]
            if silent:
                self._mark_silent(method, silent, silence_s)
                raise self.timeout_error(
                    method, ranks, refs, pending, round(now - start, 1), silent=silent,
                    silence_s=silence_s,
                )  # fmt: skip

    def _mark_silent(self, method: str, ranks: list[int], silence_s: float) -> None:
        """Ranks that left their health probe unanswered are unhealthy (as RLlib marks an
        actor that fails its ping): the next call restarts them unless one of their calls
        answers first."""
        if self._fault is None:
            return
        for rank in ranks:
            self._silenced.add(rank)
            self._fault.set_in_service(
                rank, False, f"did not answer a health probe for {silence_s:g}s during {method}()"
            )

    def _wait_failed(
        self, method: str, ranks: list[int], refs: list[Any], timeout: float | None
    ) -> tuple[list[Any], list[int]]:
        """Some rank failed: act on each outcome as it arrives; a death raises at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes: dict[int, ResultOrError] = {}
        remaining = list(range(len(refs)))
        while remaining:
            ready, _ = ray.wait([refs[i] for i in remaining], num_returns=len(remaining), timeout=0)
            done = set(ready)
            for i in [i for i in remaining if refs[i] in done]:
                out = outcomes[i] = self.outcome(method, ranks[i], refs[i])
                if not out.ok and is_death(out.get()) and not self._ignore:
                    raise out.get()
            remaining = [i for i in remaining if i not in outcomes]
            if not remaining:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                pending = [ranks[i] for i in remaining]
                finished = {ranks[i]: o.get() for i, o in outcomes.items()}
                raise self.timeout_error(method, ranks, refs, pending, timeout or 0.0, finished)
            ray.wait([refs[i] for i in remaining], num_returns=1, timeout=left, fetch_local=False)
        errors = [(ranks[i], outcomes[i].get()) for i in range(len(refs)) if not outcomes[i].ok]
        if not errors:
            values = [outcomes[i].get() for i in range(len(refs))]
            self._seen(method, ranks, values)
            return values, []
        if not self._ignore or not all(self._droppable(e) for _, e in errors):
            raise errors[0][1]
        dropped = [r for r, _ in errors]
        kept = [(ranks[i], outcomes[i].get()) for i in range(len(refs)) if outcomes[i].ok]
        logger.warning(
            "group %s: %s() lost ranks %s (%s); ignoring failures, %d results",
            self.name,
            method,
            dropped,
            "; ".join(str(e).splitlines()[0] for _, e in errors),
            len(kept),
        )
        self._seen(method, [r for r, _ in kept], [v for _, v in kept])
        return [v for _, v in kept], dropped

    def _wait_streams(
        self, method: str, ranks: list[int], gens: list[Any], timeout: float | None
    ) -> list[list[Any]]:
        """Generator methods: each rank's items, in order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for rank, gen in zip(ranks, gens):
            items = []
            for item_ref in gen:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    items.append(ray.get(item_ref, timeout=left))
                except GetTimeoutError:
                    raise GroupTimeoutError(self.name, method, [rank], timeout or 0.0) from None
                except (RayTaskError, RayActorError) as e:
                    raise self._failure(method, rank, e) from None
            out.append(items)
        return out

    # -- partial collection (foreach_worker*, async fetches) --------------------------------
    def ready(
        self,
        method: str,
        ranks: list[int],
        refs: list[Any],
        timeout: float | None,
        *,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> tuple[RemoteCallResults, list[int]]:
        """Wait up to ``timeout`` (None: until all finish) and take what finished.

        Returns the finished calls' outcomes, in call order, and the ranks still running.
        ``return_obj_refs`` gives the finished refs instead of fetching them;
        ``mark_healthy`` brings unhealthy ranks that answered back into service.
        """
        results = RemoteCallResults()
        if not refs:
            return results, []
        ready_refs, _ = ray.wait(
            refs, num_returns=len(refs), timeout=timeout, fetch_local=not return_obj_refs
        )
        done = set(ready_refs)
        pending = [rk for rk, r in zip(ranks, refs) if r not in done]
        for rank, ref in zip(ranks, refs):
            if ref not in done:
                continue
            if return_obj_refs:
                results.add_result(rank, ResultOrError(ref))
            else:
                results.add_result(rank, self.outcome(method, rank, ref))
        ok = [r for r in results if r.ok]
        if not return_obj_refs:
            self._seen(method, [r.actor_id for r in ok], [r.get() for r in ok])
        if mark_healthy:
            self.mark_healthy([r.actor_id for r in ok])
        return results, pending

    def values(self, method: str, results: RemoteCallResults) -> list[tuple[int, Any]]:
        """The plain-values form: ``(rank, value)`` of each success. A failed call raises
        its error, unless the policy ignores failures (then it is logged and left out)."""
        errors = results.errors
        if errors and not self._ignore:
            raise errors[0].get()
        for r in errors:
            logger.warning(
                "group %s: ignoring failure of %s() on rank %d: %s",
                self.name,
                method,
                r.actor_id,
                str(r.get()).splitlines()[0],
            )
        return [(r.actor_id, r.get()) for r in results if r.ok]

    def after_timeout(
        self,
        method: str,
        ranks: list[int],
        refs: list[Any],
        pending: list[int],
        timeout: float,
    ) -> None:
        """A partial collection left ``pending`` ranks running after ``timeout`` seconds:
        raise the hang report, or (ignoring failures) log it. ``timeout=0`` is a poll."""
        if not pending or timeout == 0:
            return
        err = self.timeout_error(method, ranks, refs, pending, timeout)
        if not self._ignore:
            raise err
        logger.warning("%s", str(err))

    # -- timeouts -------------------------------------------------------------------------
    def timeout_error(
        self,
        method: str,
        ranks: list[int],
        refs: list[Any],
        pending: list[int],
        timeout: float,
        finished: dict[int, Any] | None = None,
        silent: list[int] | None = None,
        silence_s: float = 0.0,
    ) -> GroupTimeoutError:
        """The error of a call not finished within ``timeout``: with a hang report of the
        ``pending`` ranks' stacks, except for a poll (``timeout=0``) or a plain collector."""
        if timeout == 0 or self._members is None:
            return GroupTimeoutError(self.name, method, pending, timeout)
        if finished is None:
            finished = {}
            for rank, ref in zip(ranks, refs):
                if rank in pending or not isinstance(ref, ray.ObjectRef):
                    continue
                try:
                    finished[rank] = ray.get(ref, timeout=0)
                except Exception as e:  # noqa: BLE001 - that rank's error is its result
                    finished[rank] = unwrap_error(self.name, method, rank, e)
        return hang.timeout_error(
            self._members, method, pending, timeout, finished, silent=silent, silence_s=silence_s
        )


__all__ = ["Collector"]
