"""NeMo-RL's face of a group: ``run_*`` dispatch and worker proxies.

Names, argument order and defaults are those of NeMo-RL's ``RayWorkerGroup``, whose
methods ``WorkerGroup`` keeps and hands to the :class:`NemoFace` it holds. Each ``run_*``
turns its arguments into per-rank calls with ``dispatch`` and starts them through the
group's one dispatch (:meth:`CallPath.call`), returning bare Ray refs or a
``MultiWorkerFuture`` as NeMo-RL does.

Deliberate difference: NeMo-RL asserts that ``run_*`` get no positional data (positional
arguments broke with its worker method shells); phalanx forwards them
in order, since its dispatch has no such limit.
"""

from __future__ import annotations

from typing import Any

import ray

from phalanx.group import dispatch
from phalanx.group.call_path import CallPath
from phalanx.group.futures import MultiWorkerFuture
from phalanx.group.sharding import NamedSharding


class _ActorProxy:
    """A worker's handle as NeMo-RL users hold it: ``proxy.method.remote(*args)``."""

    __slots__ = ("actor", "_path", "_rank")

    def __init__(self, path: CallPath, rank: int, actor: ray.actor.ActorHandle):
        self.actor, self._path, self._rank = actor, path, rank

    def __getattr__(self, name: str) -> Any:
        path, rank = self._path, self._rank
        path.check_method(name)

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return path.bare_refs(path.call(name, [(rank, args, kwargs)]))[0]

        return _Remote()

    def __repr__(self) -> str:
        return f"<worker {self._path.name}:{self._rank}>"


class NemoFace:
    """NeMo-RL's calls over one group's call path.

    ``sharding`` is the group's ``NamedSharding``, given with each call that reads it.

    Args:
        path: the group's call path.
    """

    def __init__(self, path: CallPath) -> None:
        self._path = path

    def workers(self) -> list[_ActorProxy]:
        """One proxy per rank."""
        return [_ActorProxy(self._path, r, a) for r, a in enumerate(self._path.roster.actors)]

    def run_single(self, method_name: str, worker_idx: int, args: tuple, kwargs: dict) -> Any:
        """``run_single_worker_single_data``: the Ray ref of one worker's call."""
        path = self._path
        path.check_method(method_name)
        path.check_ranks([worker_idx], "worker_idx")
        return path.bare_refs(path.call(method_name, [(worker_idx, args, kwargs)]))[0]

    def run_single_data(
        self,
        sharding: NamedSharding,
        method_name: str,
        args: tuple,
        kwargs: dict,
        run_rank_0_only_axes: list[str] | None,
    ) -> list[Any]:
        """``run_all_workers_single_data``: one Ray ref per called worker."""
        path = self._path
        path.check_method(method_name)
        ranks = dispatch.rank0_only(sharding, path.ranks, run_rank_0_only_axes)
        calls = dispatch.broadcast(ranks, args, kwargs)
        return path.bare_refs(path.call(method_name, calls, health=path.broadcast_health()))

    def run_multiple_data(
        self,
        sharding: NamedSharding,
        method_name: str,
        args: tuple,
        kwargs: dict,
        run_rank_0_only_axes: list[str] | None,
        common_kwargs: dict[str, Any] | None,
    ) -> list[Any]:
        """``run_all_workers_multiple_data``: one Ray ref per called worker."""
        path = self._path
        path.check_method(method_name)
        ranks = dispatch.rank0_only(sharding, path.ranks, run_rank_0_only_axes)
        calls = dispatch.multiple_data(ranks, args, kwargs, common_kwargs)
        return path.bare_refs(path.call(method_name, calls))

    def run_sharded_data(
        self,
        sharding: NamedSharding,
        method_name: str,
        args: tuple,
        kwargs: dict,
        **options: Any,
    ) -> MultiWorkerFuture:
        """``run_all_workers_sharded_data``; ``options`` are ``dispatch.sharded``'s."""
        path = self._path
        path.check_method(method_name)
        plan = dispatch.sharded(sharding, path.ranks, args, kwargs, **options)
        handle = path.call(method_name, plan.calls)
        return MultiWorkerFuture(
            futures=handle.refs,
            return_from_workers=plan.returning,
            called_workers=plan.called,
            method=method_name,
        )


__all__ = ["NemoFace"]
