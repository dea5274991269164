"""NeMo-RL's face of a group: ``run_*`` dispatch, worker proxies, dp leaders, metadata.

Names, argument order and defaults are those of NeMo-RL's ``RayWorkerGroup``. Each
``run_*`` method turns its arguments into per-rank calls with ``dispatch`` and starts them
through the group's one dispatch (``WorkerGroup._call``), returning bare Ray refs or a
``MultiWorkerFuture`` as NeMo-RL does.

Deliberate difference: NeMo-RL asserts that ``run_*`` get no positional data (positional
arguments broke with its worker method shells); phalanx forwards them
in order, since its dispatch has no such limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from phalanx._base.checks import check_int
from phalanx.group import dispatch
from phalanx.group.futures import GroupHandle, MultiWorkerFuture
from phalanx.group.launch import Roster
from phalanx.group.sharding import NamedSharding


class _ActorProxy:
    """A worker's handle as NeMo-RL users hold it: ``proxy.method.remote(*args)``."""

    __slots__ = ("actor", "_group", "_rank")

    def __init__(self, group: NemoFace, rank: int, actor: ray.actor.ActorHandle):
        self.actor, self._group, self._rank = actor, group, rank

    def __getattr__(self, name: str) -> Any:
        group, rank = self._group, self._rank
        group._check_method(name)

        class _Remote:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Any:
                return group._bare_refs(group._call(name, [(rank, args, kwargs)]))[0]

        return _Remote()

    def __repr__(self) -> str:
        return f"<worker {self._group.name}:{self._rank}>"


class NemoFace:
    """Mixin of ``WorkerGroup``: NeMo-RL's methods over the group's call path.

    The group provides the attributes annotated here.
    """

    name: str
    sharding_annotations: NamedSharding | None
    dp_leader_worker_indices: list[int]
    _roster: Roster
    _all_ranks: list[int]
    _call: Callable[..., GroupHandle]
    _check_method: Callable[[str], None]
    _check_ranks: Callable[[Any, str], list[int]]
    _broadcast_health: Callable[[], str]
    _bare_refs: Callable[[GroupHandle], list[Any]]

    @property
    def workers(self) -> list[_ActorProxy]:
        """One proxy per rank: ``group.workers[r].method.remote(...)`` returns a Ray ref."""
        return [_ActorProxy(self, r, a) for r, a in enumerate(self._roster.actors)]

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        """Per rank: node index, local and global rank, actor name, bundle indices, pid."""
        return list(self._roster.metadata)

    @property
    def master_address(self) -> str:
        """The IP address of rank 0, for ``torch.distributed`` rendezvous."""
        return self._roster.master_address

    @property
    def master_port(self) -> int:
        """A free port on rank 0's node, for ``torch.distributed`` rendezvous."""
        return self._roster.master_port

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards (one leader each)."""
        return len(self.dp_leader_worker_indices)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        """The rank that leads data-parallel shard ``dp_shard_idx``.

        Args:
            dp_shard_idx: the data-parallel shard.

        Returns:
            The rank of its leader.

        Raises:
            IndexError: ``dp_shard_idx`` is out of range.
        """
        check_int(dp_shard_idx, "dp_shard_idx")
        if not 0 <= dp_shard_idx < self.dp_size:
            raise IndexError(f"dp_shard_idx {dp_shard_idx} out of range 0..{self.dp_size - 1}")
        return self.dp_leader_worker_indices[dp_shard_idx]

    def run_single_worker_single_data(
        self, method_name: str, worker_idx: int, *args: Any, **kwargs: Any
    ) -> ray.ObjectRef:
        """Run ``method_name`` on one worker; returns its Ray future.

        Args:
            method_name: the worker method's name.
            worker_idx: the worker's rank.
            *args, **kwargs: its arguments.

        Returns:
            The Ray future of its result.

        Raises:
            UnknownMethodError: the worker class has no such public method.
            ValueError: ``worker_idx`` is out of range.
        """
        self._check_method(method_name)
        self._check_ranks([worker_idx], "worker_idx")
        return self._bare_refs(self._call(method_name, [(worker_idx, args, kwargs)]))[0]

    def run_all_workers_single_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """Same arguments to every worker (or only rank 0 of ``run_rank_0_only_axes``).

        Args:
            method_name: the worker method's name.
            *args, **kwargs: the arguments every called worker gets.
            run_rank_0_only_axes: call only index 0 along these named axes.

        Returns:
            One Ray future per called worker.

        Raises:
            UnknownMethodError: the worker class has no such public method.
        """
        self._check_method(method_name)
        ranks = dispatch.rank0_only(
            self.sharding_annotations, self._all_ranks, run_rank_0_only_axes
        )
        calls = dispatch.broadcast(ranks, args, kwargs)
        return self._bare_refs(self._call(method_name, calls, health=self._broadcast_health()))

    def run_all_workers_multiple_data(
        self,
        method_name: str,
        *args: Any,
        run_rank_0_only_axes: list[str] | None = None,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[ray.ObjectRef]:
        """One item of each list argument per called worker, plus ``common_kwargs`` for all.

        Data that do not match the workers called raise ``dispatch.DispatchError`` (a
        ``ValueError`` and, as in NeMo-RL, an ``AssertionError``).

        Args:
            method_name: the worker method's name.
            *args, **kwargs: lists with one item per called worker.
            run_rank_0_only_axes: call only index 0 along these named axes.
            common_kwargs: keyword arguments every called worker gets.

        Returns:
            One Ray future per called worker.

        Raises:
            DispatchError: the lists do not match the workers called.
            UnknownMethodError: the worker class has no such public method.
        """
        self._check_method(method_name)
        ranks = dispatch.rank0_only(
            self.sharding_annotations, self._all_ranks, run_rank_0_only_axes
        )
        calls = dispatch.multiple_data(ranks, args, kwargs, common_kwargs)
        return self._bare_refs(self._call(method_name, calls))

    def run_all_workers_sharded_data(
        self,
        method_name: str,
        *args: Any,
        in_sharded_axes: list[str] | None = None,
        replicate_on_axes: list[str] | None = None,
        output_is_replicated: list[str] | None = None,
        make_dummy_calls_to_free_axes: bool = False,
        common_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> MultiWorkerFuture:
        """Send each worker the shard for its coordinates (see ``dispatch.sharded``).

        ``in_sharded_axes``: data is nested lists indexed by these axes, in this order (a
        value that shards itself, such as a ``BatchedDataDict``, may be given whole for
        one axis). ``replicate_on_axes``: every worker along these axes gets the same
        shard. Free axes (neither): only index 0 is called (others get ``None`` data with
        ``make_dummy_calls_to_free_axes``). Results come from index 0 of free axes and of
        ``output_is_replicated`` axes.

        Args:
            method_name: the worker method's name.
            *args, **kwargs: the data, nested lists indexed by ``in_sharded_axes``.
            in_sharded_axes: the axes the data is sharded over.
            replicate_on_axes: the axes along which every worker gets the same shard.
            output_is_replicated: the axes whose results come from index 0 only.
            make_dummy_calls_to_free_axes: call the free axes' other workers with ``None`` data.
            common_kwargs: keyword arguments every called worker gets.

        Returns:
            A ``MultiWorkerFuture`` whose results are those of the workers that return.

        Raises:
            DispatchError: the data do not match the axes.
            UnknownMethodError: the worker class has no such public method.
        """
        self._check_method(method_name)
        plan = dispatch.sharded(
            self.sharding_annotations,
            self._all_ranks,
            args,
            kwargs,
            in_sharded_axes=in_sharded_axes,
            replicate_on_axes=replicate_on_axes,
            output_is_replicated=output_is_replicated,
            make_dummy_calls_to_free_axes=make_dummy_calls_to_free_axes,
            common_kwargs=common_kwargs,
        )
        handle = self._call(method_name, plan.calls)
        return MultiWorkerFuture(
            futures=handle.refs,
            return_from_workers=plan.returning,
            called_workers=plan.called,
            method=method_name,
        )

    def get_all_worker_results(
        self, future_bundle: MultiWorkerFuture, return_generators_as_proxies: bool = False
    ) -> list[Any]:
        """``future_bundle.get_results(self, ...)``: the selected workers' results.

        Args:
            future_bundle: the ``MultiWorkerFuture`` of a call on this group.
            return_generators_as_proxies: return generator methods' generators as they are.

        Returns:
            The selected workers' results, in worker order.

        Raises:
            WorkerError: a worker's method raised.
        """
        return future_bundle.get_results(
            self, return_generators_as_proxies=return_generators_as_proxies
        )


__all__ = ["NemoFace"]
