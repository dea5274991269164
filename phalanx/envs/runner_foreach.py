"""Calls on the runners of an ``EnvRunnerGroup``: RLlib's ``foreach_env_runner*`` and
async requests, over the runners' group's public RLlib face.

Worker ids are RLlib's: 0 is the local runner, the remote runners are ``1..n`` (the
group's rank plus one). Which runner is in service, and what a failure does to it, is the
group's :class:`~phalanx.group.fault.RestartPolicy` (``RestartPolicy.rllib``); this module
applies RLlib's error rule to the outcomes (a failed runner's error raises unless the
config restarts or ignores failed runners) and makes a result that cannot travel back the
caller's error, not the runner's failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from ray import cloudpickle

from phalanx._base.checks import check_timeout
from phalanx._base.errors import WorkerError
from phalanx.envs.config import EnvContext, EnvRunnerGroupConfig
from phalanx.envs.env_runner import EnvRunner
from phalanx.envs.runner_ids import RunnerIds
from phalanx.group.dispatch import DispatchError, funcs_mismatch
from phalanx.group.group import WorkerGroup
from phalanx.group.results import RemoteCallResults

logger = logging.getLogger(__name__)


class RunnerForeach:
    """Base class of ``EnvRunnerGroup``: every call on the runners but ``sample`` rounds.

    It is the group's dispatch, which sampling, weight sync and policies all call, and it
    holds no state of its own: it reads the group's ``config``, remote runners
    (``_group``), local runner (``_local``), runner ids (``_ids``) and ``_fault_tolerant``.
    """

    config: EnvRunnerGroupConfig
    _group: WorkerGroup | None
    _local: EnvRunner | None
    _ids: RunnerIds
    _fault_tolerant: bool

    # ------------------------------------------------------------------ calls and failures
    def _select(self, func: Any, remote_worker_ids: list[int] | None) -> tuple[list[int], Any]:
        """Ranks to call and ``func`` checked and wrapped to run on each of them."""
        ids = self._ids
        ranks = list(ids.active) if remote_worker_ids is None else ids.ranks(remote_worker_ids)
        funcs = func if isinstance(func, list) else [func]
        if isinstance(func, list) and len(func) != len(ranks):
            raise funcs_mismatch(len(func), len(ranks), "remote env runners")
        methods = self._group.methods if self._group is not None else {}
        for f in funcs:
            if isinstance(f, str):
                if f not in methods:
                    raise ValueError(f"func: env runners have no method {f!r}")
            elif not callable(f):
                raise TypeError(f"func must be a callable or a method name, got {type(f).__name__}")
        wrapped = [Returnable(f) for f in funcs]
        return ranks, wrapped if isinstance(func, list) else wrapped[0]

    def _settle(self, results: RemoteCallResults, method: str) -> list[tuple[int, Any]]:
        """RLlib's error rule for a finished call: failed runners are out of service (the
        group's policy did that); their errors raise unless the config restarts or ignores
        failed runners. Returns ``(rank, value)`` of each success."""
        errors = results.errors
        if errors and not self._fault_tolerant:
            raise errors[0].get()
        for r in errors:
            logger.warning(
                "%s failed in %s() and is out of service: %s",
                self._ids.label(r.actor_id),
                method,
                str(r.get()).splitlines()[0],
            )
        return [(r.actor_id, r.get()) for r in results if r.ok]

    def _foreach_remote(
        self,
        func: Any,
        *,
        kwargs: dict[str, Any] | None = None,
        ranks: list[int] | None = None,
        timeout_seconds: float | None = None,
        healthy_only: bool = True,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[Any]:
        """Values of ``func`` on ``ranks`` (default all, standby runners included; with
        ``healthy_only`` those in service) in id order, standby runners last; failures per
        config, stragglers after the timeout left out."""
        if self._group is None:
            return []
        results = self._group.foreach_actor(
            func,
            kwargs=kwargs,
            healthy_only=healthy_only,
            remote_actor_ids=ranks,
            timeout_seconds=timeout_seconds,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )
        method = getattr(func, "__name__", "foreach_env_runner")
        values = self._settle(results, method)
        if timeout_seconds:
            late = sorted(
                set(self._ids.all_ranks() if ranks is None else ranks)
                - {r.actor_id for r in results}
                - set([] if not healthy_only else self._not_in_service())
            )
            if late:
                logger.warning(
                    "%s: %s() still running after %ss; their results are dropped",
                    ", ".join(self._ids.label(r) for r in late),
                    method,
                    timeout_seconds,
                )
        order = {r: i for i, r in enumerate(self._ids.all_ranks())}
        return [v for _, v in sorted(values, key=lambda x: order[x[0]])]

    def _not_in_service(self) -> list[int]:
        up = set(self._group.healthy_worker_ids())
        return [r for r in self._ids.all_ranks() if r not in up]

    def _first_answer(self, method: str, ids: list[int]) -> Any:
        """``method()`` of the first of the runners ``ids`` that answers (RLlib asks one)."""
        for wid in ids:
            got = self._foreach_remote(
                method, ranks=self._ids.ranks([wid]), timeout_seconds=self.config.sample_timeout_s
            )
            if got:
                return got[0]
        raise RuntimeError(f"{method}: none of the remote runners {ids} answered")

    # ------------------------------------------------------------------ foreach
    def foreach_env_runner(
        self,
        func: Callable[[EnvRunner], Any] | str | list[Callable[[EnvRunner], Any] | str],
        *,
        kwargs: dict[str, Any] | None = None,
        local_env_runner: bool = True,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        local_worker: bool | None = None,
    ) -> list[Any]:
        """``func(runner)`` (or the runner method named ``func``) on each runner.

        The local runner's result first (if it exists and ``local_env_runner``), then the
        remote runners' in id order. ``func`` may be a list with one function per selected
        remote runner. ``healthy_only`` calls only the runners in service. A runner that
        fails is taken out of service and its result left out; its error raises unless
        the config restarts or ignores failed runners. Results not ready after
        ``timeout_seconds`` are dropped (logged; the runner stays in service);
        ``return_obj_refs`` returns the refs of the results ready by then.
        ``mark_healthy`` (with ``healthy_only=False``) brings runners out of service that
        answer back, each counted as a restart. A result that cannot travel back (it does
        not pickle) raises ``TypeError`` naming the runner; the runner stays in service.

        Args:
            func: a function of the runner, a runner method's name, or a list of them.
            kwargs: keyword arguments of ``func``.
            local_env_runner: call the local runner too.
            healthy_only: call only runners in service.
            remote_worker_ids: the remote ids (1..n) to call (every runner if None).
            timeout_seconds: seconds to wait (no bound if None).
            return_obj_refs: return the ready results' Ray refs.
            mark_healthy: runners out of service that answer are back in service.
            local_worker: RLlib's older name of ``local_env_runner``.

        Returns:
            The results, the local runner's first.

        Raises:
            DispatchError: a list of functions does not match the runners selected.
            TypeError: a result cannot travel back (it does not pickle).
            WorkerError: a runner failed and the config neither restarts nor ignores failed
                runners.
        """
        if local_worker is not None:
            local_env_runner = local_worker
        if return_obj_refs and local_env_runner and self._local is not None:
            raise DispatchError(
                "return_obj_refs: the local runner has no object refs; pass local_env_runner=False"
            )
        check_timeout(timeout_seconds, "timeout_seconds")
        out: list[Any] = []
        if self._group is not None:
            ranks, wrapped = self._select(func, remote_worker_ids)
            out = self._foreach_remote(
                wrapped,
                kwargs=kwargs,
                ranks=ranks,
                timeout_seconds=timeout_seconds,
                healthy_only=healthy_only,
                return_obj_refs=return_obj_refs,
                mark_healthy=mark_healthy,
            )
            if not return_obj_refs:
                check_returned(out)
        if local_env_runner and self._local is not None:
            local_func = func[0] if isinstance(func, list) else func
            out.insert(0, _call(self._local, local_func, kwargs or {}))
        return out

    foreach_worker = foreach_env_runner

    def foreach_worker_with_id(
        self,
        func: Callable[[int, EnvRunner], Any] | str,
        *,
        kwargs: dict[str, Any] | None = None,
        local_env_runner: bool = True,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        timeout_seconds: float | None = None,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        local_worker: bool | None = None,
    ) -> list[Any]:
        """``func(worker_id, runner)`` on each runner (the local runner's id is 0).

        Args:
            func: a function of ``(worker_id, runner)``, or a runner method's name.
            kwargs, local_env_runner, healthy_only, remote_worker_ids: as for
                ``foreach_env_runner``.
            timeout_seconds, return_obj_refs, mark_healthy, local_worker: the same.

        Returns:
            The results, the local runner's first.
        """
        return self.foreach_env_runner(
            _with_worker_id,
            kwargs={"func": func, "kwargs": kwargs or {}},
            local_env_runner=local_env_runner if local_worker is None else local_worker,
            healthy_only=healthy_only,
            remote_worker_ids=remote_worker_ids,
            timeout_seconds=timeout_seconds,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )

    foreach_env_runner_with_id = foreach_worker_with_id

    # ------------------------------------------------------------------ async requests
    def foreach_env_runner_async(
        self,
        func: Callable[[EnvRunner], Any] | str | list[Callable[[EnvRunner], Any] | str],
        tag: str | None = None,
        *,
        kwargs: dict[str, Any] | None = None,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
    ) -> int:
        """Start ``func`` on the remote runners without waiting; returns how many requests
        were sent. A runner that already has ``max_requests_in_flight_per_env_runner``
        requests of ``tag`` in flight gets none. Collect with ``fetch_ready_async_reqs``.

        Args:
            func: a function of the runner, a runner method's name, or a list of them.
            tag: the requests' tag, for ``fetch_ready_async_reqs``.
            kwargs: keyword arguments of ``func``.
            healthy_only: call only runners in service.
            remote_worker_ids: the remote ids (1..n) to call (every runner if None).

        Returns:
            The number of requests sent.

        Raises:
            TypeError: ``tag`` is not a str or None.
        """
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag must be a str or None, got {type(tag).__name__}")
        if self._group is None:
            return 0
        ranks, wrapped = self._select(func, remote_worker_ids)
        sub = self._group.foreach_worker_async(
            wrapped,
            tag=tag,
            kwargs=kwargs,
            healthy_only=healthy_only,
            remote_worker_ids=ranks,
            max_in_flight_per_worker=self.config.max_requests_in_flight_per_env_runner,
        )
        return int(sub)

    foreach_worker_async = foreach_env_runner_async

    def fetch_ready_async_reqs(
        self,
        *,
        tags: str | list[str] | tuple[str, ...] | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
    ) -> list[tuple[int, Any]]:
        """``(worker_id, result)`` of the async requests (of ``tags``; None: all) that are
        done. Waits up to ``timeout_seconds`` for every request in flight (None: until all
        are done; 0: only those done now). A failed request raises its error unless the
        config restarts or ignores failed runners; the other results of that fetch are
        kept for the next one.

        Args:
            tags: the tags whose requests to fetch (every tag if None).
            timeout_seconds: seconds to wait for requests in flight.
            return_obj_refs: return the results' Ray refs instead of their values.
            mark_healthy: runners out of service that answered are back in service.

        Returns:
            A list of ``(worker_id, result)``.

        Raises:
            WorkerError: a request failed and the config neither restarts nor ignores failed
                runners.
        """
        if self._group is None:
            return []
        got = self._group.fetch_ready_async_reqs(
            tags=tags,
            timeout_seconds=timeout_seconds,
            return_obj_refs=return_obj_refs,
            mark_healthy=mark_healthy,
        )
        if not return_obj_refs:
            check_returned([v for _, v in got])
        return [(self._ids.id_of(r), v) for r, v in got]

    def foreach_env_runner_async_fetch_ready(
        self,
        func: Callable[[EnvRunner], Any] | str | list[Callable[[EnvRunner], Any] | str],
        kwargs: dict[str, Any] | None = None,
        tag: str | None = None,
        timeout_seconds: float | None = 0.0,
        return_obj_refs: bool = False,
        mark_healthy: bool = False,
        healthy_only: bool = True,
        remote_worker_ids: list[int] | None = None,
        return_actor_ids: bool = False,
    ) -> list[Any]:
        """Fetch the results of earlier requests of ``tag``, then send ``func`` again.

        First the ready results of requests made with ``tag`` are fetched (up to
        ``timeout_seconds``), then ``func`` goes to the selected runners (those at their
        in-flight limit are skipped), then a failed request raises as in
        ``fetch_ready_async_reqs``. Returns the fetched values, or ``(worker_id, value)``
        pairs with ``return_actor_ids``.

        Args:
            func: a function of the runner, a runner method's name, or a list of them.
            kwargs: keyword arguments of ``func``.
            tag: the requests' tag.
            timeout_seconds: seconds to wait for requests in flight.
            return_obj_refs: return the results' Ray refs instead of their values.
            mark_healthy: runners out of service that answered are back in service.
            healthy_only: send only to runners in service.
            remote_worker_ids: the remote ids (1..n) to send to (every runner if None).
            return_actor_ids: return ``(worker_id, value)`` pairs.

        Returns:
            The fetched values, or ``(worker_id, value)`` pairs.

        Raises:
            WorkerError: as for ``fetch_ready_async_reqs``.
        """
        send = dict(kwargs=kwargs, healthy_only=healthy_only, remote_worker_ids=remote_worker_ids)
        try:
            got = self.fetch_ready_async_reqs(
                tags=tag,
                timeout_seconds=timeout_seconds,
                return_obj_refs=return_obj_refs,
                mark_healthy=mark_healthy,
            )
        except WorkerError:
            self.foreach_env_runner_async(func, tag, **send)  # RLlib sends, then raises
            raise
        self.foreach_env_runner_async(func, tag, **send)
        return got if return_actor_ids else [v for _, v in got]

    def foreach_env(self, func: Callable[[gym.Env], Any]) -> list[list[Any]]:
        """``func(sub_env)`` for every sub-environment; one list per runner (local first).

        Args:
            func: called with each sub-environment.

        Returns:
            One list of results per runner.
        """
        return self.foreach_worker(_foreach_env, kwargs={"func": func})

    def foreach_env_with_context(
        self, func: Callable[[gym.Env, EnvContext], Any]
    ) -> list[list[Any]]:
        """``func(sub_env, env_context)`` for every sub-environment; one list per runner.

        Args:
            func: called with each sub-environment and its ``EnvContext``.

        Returns:
            One list of results per runner.
        """
        return self.foreach_worker(_foreach_env_ctx, kwargs={"func": func})


class Unreturnable:
    """What a runner returns in place of a result that cannot travel back (RLlib's caller
    gets the error; the runner stays in service)."""

    def __init__(self, worker_index: int, cause: str):
        self.worker_index = worker_index
        self.cause = cause


class Returnable:
    """A ``foreach`` function as it runs on a runner: a result that does not pickle comes
    back as an :class:`Unreturnable` instead of failing the runner."""

    def __init__(self, func: Callable[..., Any] | str):
        self.func = func
        self.__name__ = func if isinstance(func, str) else getattr(func, "__name__", "foreach")

    def __call__(self, runner: EnvRunner, *args: Any, **kwargs: Any) -> Any:
        out = _call(runner, self.func, kwargs, *args)
        try:  # large buffers are not copied (out of band), so the check is cheap
            cloudpickle.dumps(out, protocol=5, buffer_callback=lambda _: None)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the caller's
            return Unreturnable(runner.worker_index, f"{type(e).__name__}: {e}")
        return out


def check_returned(values: list[Any]) -> None:
    """``TypeError`` naming the runner whose result could not be returned."""
    for v in values:
        if isinstance(v, Unreturnable):
            raise TypeError(
                f"foreach_env_runner: the result of env runner {v.worker_index} cannot be "
                f"returned to the caller ({v.cause}); return something picklable "
                "(e.g. w.module.state_dict() instead of the module)"
            )


# Functions shipped to runners (module level so they pickle by reference).
def _call(runner: EnvRunner, func: Any, kwargs: dict[str, Any], *args: Any) -> Any:
    """``func(runner, *args, **kwargs)``, or the runner's method named ``func``."""
    if isinstance(func, str):
        return getattr(runner, func)(*args, **kwargs)
    return func(runner, *args, **kwargs)


def _with_worker_id(runner: EnvRunner, func: Any, kwargs: dict[str, Any]) -> Any:
    if isinstance(func, str):
        return getattr(runner, func)(runner.worker_index, **kwargs)
    return func(runner.worker_index, runner, **kwargs)


def _foreach_env(runner: EnvRunner, func: Callable[..., Any]) -> list[Any]:
    return runner.foreach_env(func)


def _foreach_env_ctx(runner: EnvRunner, func: Callable[..., Any]) -> list[Any]:
    return runner.foreach_env_with_context(func)
