"""One call on several remote env runners, and what each runner gave back.

The collect path of ``EnvRunnerGroup``: start a function or a runner method on chosen
ranks of the runners' ``WorkerGroup`` (through its public ``apply``/``call_ranks``),
wait up to a timeout, and sort every rank's outcome into a value, an error or a
straggler. Errors become phalanx errors naming group, rank and method; the actor that
was called is kept with its error so a caller can replace exactly that incarnation.
What a failure means for the runner (RLlib's rules) is the group's business, not this
module's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from phalanx._base.errors import WorkerDiedError
from phalanx.group.fault import WorkerHealth
from phalanx.group.group import WorkerGroup
from phalanx.group.results import unwrap_error


@dataclass
class RunnerCall:
    """The outcome of one call on several runners, by rank (0-based)."""

    method: str
    timeout: float | None = None
    values: list[tuple[int, Any]] = field(default_factory=list)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    # (rank, ref, actor) of the calls still running at the timeout
    pending: list[tuple[int, ray.ObjectRef, Any]] = field(default_factory=list)
    actors: dict[int, Any] = field(default_factory=dict)  # the incarnation that failed


def call_on_runner(runner: Any, func: Any, kwargs: dict[str, Any] | None) -> Any:
    """``func(runner, **kwargs)``, or the runner's method named ``func`` (runs remotely)."""
    if isinstance(func, str):
        return getattr(runner, func)(**(kwargs or {}))
    return func(runner, **(kwargs or {}))


def method_name(func: Any) -> str:
    """How errors and logs name a call of ``func``."""
    if isinstance(func, str):
        return func
    if isinstance(func, list):
        return "foreach_env_runner"
    return getattr(func, "__name__", "foreach_env_runner")


def start(
    group: WorkerGroup,
    func: Any,
    ranks: list[int],
    kwargs: dict[str, Any] | None,
    funcs: list[Any] | None = None,
) -> tuple[list[int], list[ray.ObjectRef], list[Any], list[int]]:
    """Start ``func`` (or ``funcs[i]`` on ``ranks[i]``) on the ranks whose process is up.

    Returns ``(ranks called, refs, actors called, ranks not up)``.
    """
    health = group.health()
    up = [r for r in ranks if health[r] == WorkerHealth.HEALTHY]
    down = [r for r in ranks if health[r] != WorkerHealth.HEALTHY]
    if not up:
        return [], [], [], down
    kwargs = dict(kwargs or {})
    if funcs is not None:
        by_rank = dict(zip(ranks, funcs))
        calls = [(r, (by_rank[r], kwargs), {}) for r in up]
        handle = group.apply(call_on_runner, calls, label="foreach_env_runner", skip_unhealthy=True)
    elif isinstance(func, str):
        handle = group.call_ranks(func, [(r, (), kwargs) for r in up], skip_unhealthy=True)
    else:
        calls = [(r, (), kwargs) for r in up]
        handle = group.apply(func, calls, label=method_name(func), skip_unhealthy=True)
    actors = group.actors
    down += list(handle.skipped)
    return list(handle.ranks), list(handle.refs), [actors[r] for r in handle.ranks], down


def collect(
    group: WorkerGroup,
    method: str,
    ranks: list[int],
    refs: list[ray.ObjectRef],
    actors: list[Any],
    timeout: float | None,
    *,
    return_obj_refs: bool = False,
) -> RunnerCall:
    """Wait up to ``timeout`` for every ref; each rank's value, error or straggling call."""
    out = RunnerCall(method=method, timeout=timeout)
    if not refs:
        return out
    ready, _ = ray.wait(
        refs, num_returns=len(refs), timeout=timeout, fetch_local=not return_obj_refs
    )
    done = set(ready)
    for rank, ref, actor in zip(ranks, refs, actors):
        if ref not in done:
            out.pending.append((rank, ref, actor))
        elif return_obj_refs:
            out.values.append((rank, ref))
        else:
            try:
                out.values.append((rank, ray.get(ref)))
            except (RayTaskError, RayActorError) as e:
                out.errors.append((rank, unwrap_error(group.name, method, rank, e)))
                out.actors[rank] = actor
    out.values.sort(key=lambda x: x[0])
    return out


def call(
    group: WorkerGroup,
    func: Any,
    ranks: list[int],
    kwargs: dict[str, Any] | None,
    timeout: float | None,
    funcs: list[Any] | None = None,
    *,
    return_obj_refs: bool = False,
) -> RunnerCall:
    """Start and collect; a rank whose process is not up counts as a ``WorkerDiedError``."""
    called, refs, actors, down = start(group, func, ranks, kwargs, funcs)
    method = method_name(func)
    out = collect(group, method, called, refs, actors, timeout, return_obj_refs=return_obj_refs)
    health = group.health()
    for r in down:
        reason = f"env runner {r + 1} is {health[r].value}: its process is not up"
        out.errors.append(
            (r, WorkerDiedError(group.name, r, method, "", "WorkerUnavailable", reason))
        )
    return out
