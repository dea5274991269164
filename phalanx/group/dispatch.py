"""Call styles as pure functions: from a call's arguments to ``[(rank, args, kwargs), ...]``.

Every face of a group (RLinf's ``group.method()``/``execute_on``, NeMo-RL's
``run_all_workers_*``, RLlib's ``foreach_worker*``) turns its arguments into per-rank calls
here, checking them before any remote work; the group then starts those calls through
its one dispatch. Nothing here touches Ray, so each style is tested without a cluster
(as veRL keeps its dispatch modes). Calls are ``(rank, args, kwargs)`` tuples.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from phalanx._base.checks import check_ranks
from phalanx.group.sharding import NamedSharding

Call = tuple[int, tuple, dict]
INLINE_LIMIT = 100 * 1024  # Ray inlines arguments below this size; above, share one copy.


@runtime_checkable
class ShardsItself(Protocol):
    """A value that splits itself for sharded dispatch (NeMo-RL's ``BatchedDataDict`` does).

    Given whole for a call sharded along one axis, it is split into that axis' size.
    """

    def shard_by_batch_size(self, shards: int, *args: Any, **kwargs: Any) -> list[Any]: ...


# ----------------------------------------------------------------------------- ranks


class DispatchError(ValueError, AssertionError):
    """Per-worker data or functions that do not match the workers called.

    NeMo-RL and RLlib assert these (``AssertionError``); phalanx's rule is ``ValueError``:
    this error is both, so code written for either catches it.
    """


RLLIB_FUNCS_MISMATCH = "Funcs must have the same number of callables as actor indices."


def funcs_mismatch(funcs: int, ranks: int, workers: str = "workers") -> DispatchError:
    """A list of ``funcs`` functions for ``ranks`` workers: RLlib's message (which code
    written for RLlib matches), then phalanx's counts."""
    return DispatchError(
        f"{RLLIB_FUNCS_MISMATCH} (func: a list of {funcs} functions for {ranks} {workers})"
    )


def execute_on(ranks: tuple[Any, ...], world_size: int, group: str) -> list[int]:
    """The ranks of ``group.execute_on(*ranks)`` (a single list or tuple is unpacked)."""
    if len(ranks) == 1 and isinstance(ranks[0], (list, tuple)):
        ranks = tuple(ranks[0])
    if not ranks:
        raise ValueError("execute_on needs at least one rank")
    return check_ranks(ranks, world_size, "execute_on", repeats="allow", group=group)


def broadcast(ranks: Sequence[int], args: tuple, kwargs: dict) -> list[Call]:
    """The same arguments to every rank in ``ranks``."""
    return [(r, args, kwargs) for r in ranks]


def rank0_only(sharding: NamedSharding, ranks: Sequence[int], axes: list[str] | None) -> list[int]:
    """The ranks at index 0 of every axis in ``axes`` (all ranks when none are given)."""
    axes = list(axes or [])
    for ax in axes:
        if ax not in sharding.names:
            raise ValueError(f"run_rank_0_only_axes: unknown axis {ax!r} (axes: {sharding.names})")
    if not axes:
        return list(ranks)
    return [r for r in ranks if all(sharding.get_worker_coords(r)[ax] == 0 for ax in axes)]


# ----------------------------------------------------------------------------- NeMo-RL


def multiple_data(
    ranks: Sequence[int], args: tuple, kwargs: dict, common_kwargs: dict | None
) -> list[Call]:
    """One item of each list argument per rank, plus ``common_kwargs`` for every rank."""
    if not args and not kwargs:
        raise DispatchError(
            "run_all_workers_multiple_data needs per-worker data; use run_all_workers_single_data"
        )
    common = dict(common_kwargs or {})
    for name, value in _named(args, kwargs):
        if not isinstance(value, (list, tuple)):
            raise TypeError(
                f"{name} must be a list with one entry per worker, got {type(value).__name__}"
            )
        if len(value) != len(ranks):
            raise DispatchError(f"{name} has {len(value)} entries for {len(ranks)} called workers")
    clash = set(common) & set(kwargs)
    if clash:
        raise ValueError(f"common_kwargs repeats per-worker kwargs {sorted(clash)}")
    return [
        (r, tuple(a[i] for a in args), {**{k: v[i] for k, v in kwargs.items()}, **common})
        for i, r in enumerate(ranks)
    ]


@dataclass
class ShardedPlan:
    """The calls of a sharded dispatch, who is called and whose results are returned."""

    calls: list[Call]
    called: list[int]
    returning: list[int]


def sharded(
    sharding: NamedSharding,
    ranks: Sequence[int],
    args: tuple,
    kwargs: dict,
    *,
    in_sharded_axes: list[str] | None = None,
    replicate_on_axes: list[str] | None = None,
    output_is_replicated: list[str] | None = None,
    make_dummy_calls_to_free_axes: bool = False,
    common_kwargs: dict | None = None,
) -> ShardedPlan:
    """NeMo-RL's ``run_all_workers_sharded_data``: each rank gets the shard at its coordinates.

    Data are nested lists indexed by ``in_sharded_axes`` in order (a :class:`ShardsItself`
    value given whole for one axis splits itself). Ranks along ``replicate_on_axes`` get
    the same shard. Along free axes (neither) only index 0 is called, others get ``None``
    data with ``make_dummy_calls_to_free_axes``. Results come from index 0 of free axes
    and of ``output_is_replicated`` axes.
    """
    in_sharded = list(in_sharded_axes or [])
    replicated = list(replicate_on_axes or [])
    out_rep = list(output_is_replicated or [])
    for arg, axes in (
        ("in_sharded_axes", in_sharded),
        ("replicate_on_axes", replicated),
        ("output_is_replicated", out_rep),
    ):
        unknown = [a for a in axes if a not in sharding.names]
        if unknown:
            raise ValueError(f"{arg}: unknown axes {unknown} (axes: {sharding.names})")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{arg} repeats an axis: {axes}")
    overlap = set(in_sharded) & set(replicated)
    if overlap:
        raise ValueError(f"in_sharded_axes and replicate_on_axes overlap on {sorted(overlap)}")
    common = dict(common_kwargs or {})
    clash = set(common) & set(kwargs)
    if clash:
        raise ValueError(f"common_kwargs repeats sharded kwargs {sorted(clash)}")
    args = tuple(_self_shard(sharding, a, in_sharded) for a in args)
    kwargs = {k: _self_shard(sharding, v, in_sharded) for k, v in kwargs.items()}
    for name, value in _named(args, kwargs):
        _check_nested(sharding, name, value, in_sharded)

    free = [a for a in sharding.names if a not in in_sharded and a not in replicated]
    plan = ShardedPlan([], [], [])
    for rank in ranks:
        coords = sharding.get_worker_coords(rank)
        on_free_zero = all(coords[a] == 0 for a in free)
        if on_free_zero and all(coords[a] == 0 for a in out_rep):
            plan.returning.append(rank)
        if on_free_zero:
            idx = [coords[a] for a in in_sharded]
            wargs = tuple(_index(a, idx) for a in args)
            wkwargs = {k: _index(v, idx) for k, v in kwargs.items()}
        elif make_dummy_calls_to_free_axes:
            wargs = tuple(None for _ in args)
            wkwargs = {k: None for k in kwargs}
        else:
            continue
        plan.calls.append((rank, wargs, {**wkwargs, **common}))
        plan.called.append(rank)
    return plan


def _self_shard(sharding: NamedSharding, value: Any, axes: list[str]) -> Any:
    if len(axes) == 1 and isinstance(value, ShardsItself) and not isinstance(value, type):
        return value.shard_by_batch_size(sharding.get_axis_size(axes[0]))
    return value


def _check_nested(sharding: NamedSharding, name: str, value: Any, axes: list[str]) -> None:
    level = [value]
    for ax in axes:
        size = sharding.get_axis_size(ax)
        nxt = []
        for v in level:
            if not isinstance(v, (list, tuple)):
                raise TypeError(
                    f"{name}: expected a list of {size} shards along axis {ax!r}, got {type(v).__name__}"
                )
            if len(v) != size:
                raise ValueError(f"{name}: axis {ax!r} has size {size}, got {len(v)} shards")
            nxt.extend(v)
        level = nxt


def _index(value: Any, idx: list[int]) -> Any:
    for i in idx:
        value = value[i]
    return value


def _named(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]


# ----------------------------------------------------------------------------- RLlib


def foreach_select(
    all_ranks: Sequence[int],
    world_size: int,
    func: Any,
    *,
    healthy_only: bool,
    not_healthy: Iterable[int],
    remote_worker_ids: list[int] | None,
) -> tuple[list[int], Any]:
    """The ranks a ``foreach_worker*`` call goes to, and ``func`` matched to them.

    A list of functions pairs with ``remote_worker_ids`` (or every rank) before unhealthy
    ranks are dropped, so with ``healthy_only`` the dead workers' functions are dropped
    with them and the rest are still called (RLlib's rule).
    """
    if remote_worker_ids is None:
        ranks = list(all_ranks)
    else:
        if not isinstance(remote_worker_ids, (list, tuple)):
            raise TypeError("remote_worker_ids must be a list of ranks")
        ranks = check_ranks(remote_worker_ids, world_size, "remote_worker_ids", repeats="allow")
    funcs = func if isinstance(func, list) else None
    if funcs is not None and len(funcs) != len(ranks):
        raise funcs_mismatch(len(funcs), len(ranks))
    bad = set(not_healthy) if healthy_only else set()
    if bad:
        keep = [i for i, r in enumerate(ranks) if r not in bad]
        ranks = [ranks[i] for i in keep]
        if funcs is not None:
            func = [funcs[i] for i in keep]
    return ranks, func


@dataclass
class ForeachPlan:
    """A ``foreach_worker*`` call: the worker method to call, or ``fn`` to apply, per rank."""

    label: str
    calls: list[Call]
    method: str | None = None
    fn: Callable[..., Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def foreach(
    func: Any,
    ranks: Sequence[int],
    kwargs: dict | None,
    *,
    with_id: bool,
    check_method: Callable[[str], None],
) -> ForeachPlan:
    """Plan ``foreach_worker(func)``: ``func`` is a callable, a method name, or a list of
    either (one per rank). ``check_method`` raises for a name the worker class lacks."""
    kwargs = dict(kwargs or {})
    funcs = func if isinstance(func, list) else None
    if funcs is not None and len(funcs) != len(ranks):
        raise funcs_mismatch(len(funcs), len(ranks))
    for f in funcs or [func]:
        if not (callable(f) or isinstance(f, str)):
            raise TypeError(f"func must be a callable or a method name, got {type(f).__name__}")
        if isinstance(f, str):
            check_method(f)
    if with_id:
        calls = [(r, (funcs[i] if funcs else func, r), kwargs) for i, r in enumerate(ranks)]
        return ForeachPlan(_label(func, "foreach_worker_with_id"), calls, fn=call_with_id)
    if funcs is not None:
        calls = [(r, (funcs[i],), kwargs) for i, r in enumerate(ranks)]
        return ForeachPlan(_label(func, "foreach_worker"), calls, fn=call_each)
    if isinstance(func, str):
        return ForeachPlan(func, broadcast(ranks, (), kwargs), method=func)
    return ForeachPlan(_label(func, "foreach_worker"), broadcast(ranks, (), kwargs), fn=func)


def _label(func: Any, default: str) -> str:
    """A name for errors and traces: the method name, or the function's name."""
    items = func if isinstance(func, list) else [func]
    names = {f if isinstance(f, str) else getattr(f, "__name__", "") for f in items}
    names.discard("")
    names.discard("<lambda>")
    return names.pop() if len(names) == 1 else default


def call_with_id(worker: Any, func: Any, rank: int, *args: Any, **kw: Any) -> Any:
    """``foreach_worker_with_id``: run ``func(worker_id, worker)`` on the worker."""
    if isinstance(func, str):
        return getattr(worker, func)(rank, *args, **kw)
    return func(rank, worker, *args, **kw)


def call_each(worker: Any, func: Any, *args: Any, **kw: Any) -> Any:
    """``foreach_worker`` with one function per worker: run ``func(worker)``."""
    if isinstance(func, str):
        return getattr(worker, func)(*args, **kw)
    return func(worker, *args, **kw)


# ----------------------------------------------------------------------------- shared values


MAX_ITEMS_LOOKED_AT = 4096  # approx_nbytes assumes a big value past this many items
_END = object()


def _own_size(value: Any, budget: int) -> tuple[int, Iterable[Any] | None]:
    """A value's own bytes, and its items when it is a container to look into."""
    if value is None or isinstance(value, (bool, int, float, complex)):
        return 8, None
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return len(value), None
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes, None
    numel = getattr(value, "numel", None)
    if callable(numel) and hasattr(value, "element_size"):
        return int(numel()) * int(value.element_size()), None
    if isinstance(value, dict):
        return 0, itertools.chain.from_iterable(value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return 0, value
    return budget, None  # unknown objects: assume big enough to share


def approx_nbytes(value: Any, budget: int = INLINE_LIMIT) -> int:
    """A cheap lower bound of a value's serialized size, stopping once past ``budget``.

    It walks containers with its own stack and looks into each one once, so deep nesting
    and cycles (which pickle handles) work; past ``MAX_ITEMS_LOOKED_AT`` items it
    assumes the value is big.
    """
    total, looked = 0, 0
    seen: set[int] = set()
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        looked += 1
        if looked > MAX_ITEMS_LOOKED_AT:
            return max(total, budget)
        size, items = _own_size(item, budget - total)
        total += size
        if total >= budget:
            return total
        if items is not None and id(item) not in seen:
            seen.add(id(item))
            stack.append(iter(items))
    return total


def unpicklable_argument(
    group: str, method: str, rank: int, args: tuple, kwargs: dict, error: BaseException
) -> pickle.PicklingError:
    """The error for a call whose arguments Ray could not serialise, naming the argument
    (found by serialising each on its own; called only once serialising failed)."""
    from ray import cloudpickle

    where = "an argument"
    named = [(f"argument {i}", v) for i, v in enumerate(args)]
    named += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    for label, value in named:
        try:
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - the one that fails is the one to name
            where = label
            break
    why = (str(error).strip().splitlines() or [""])[0]
    return pickle.PicklingError(
        f"{group}.{method}() rank {rank}: {where} cannot be serialised "
        f"({type(error).__name__}: {why})"
    )


def shared_values(calls: list[Call], is_ref: Callable[[Any], bool]) -> dict[int, Any]:
    """Values (by ``id``) passed to several ranks and too big to inline: put them once."""
    seen: dict[int, int] = {}
    values: dict[int, Any] = {}
    for _, args, kwargs in calls:
        for v in itertools.chain(args, kwargs.values()):
            if is_ref(v):
                continue
            key = id(v)
            seen[key] = seen.get(key, 0) + 1
            values[key] = v
    return {
        key: values[key]
        for key, count in seen.items()
        if count > 1 and approx_nbytes(values[key]) >= INLINE_LIMIT
    }


__all__ = [
    "DispatchError",
    "ShardsItself",
    "ShardedPlan",
    "ForeachPlan",
    "broadcast",
    "execute_on",
    "foreach",
    "foreach_select",
    "multiple_data",
    "rank0_only",
    "sharded",
    "shared_values",
    "approx_nbytes",
]
