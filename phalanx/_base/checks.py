"""Argument checks shared by every layer: one rule per kind of value.

The rule, everywhere in phalanx:

- a value of the wrong *type* raises ``TypeError`` naming the argument and the type given;
- a value of the right type but out of range raises ``ValueError`` naming the argument,
  the bound and the value given.

``bool`` is never accepted where a number is expected (``True`` is not a timeout of one
second), numpy integers and floats are accepted where Python's are.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def check_int(value: Any, arg: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an ``int`` within ``[minimum, maximum]`` (each bound optional)."""
    if not _is_int(value):
        raise TypeError(f"{arg} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{arg} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{arg} must be <= {maximum}, got {value}")
    return value


def check_number(value: Any, arg: str, minimum: float | None = None) -> float:
    """``value`` as a ``float`` (an int or float, not a bool), at least ``minimum``."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{arg} must be a number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if value != value:
        raise ValueError(f"{arg} must be a number, got nan")
    if minimum is not None and value < minimum:
        raise ValueError(f"{arg} must be >= {minimum}, got {value:g}")
    return value


def check_timeout(value: Any, arg: str = "timeout") -> float | None:
    """``None`` (wait without a bound) or a number of seconds ``>= 0``."""
    if value is None:
        return None
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{arg} must be a number of seconds or None, got {type(value).__name__} ({value!r})"
        )
    if not value >= 0:
        raise ValueError(f"{arg} must be >= 0 or None, got {value!r}")
    return float(value)


def check_rank(value: Any, world_size: int, arg: str = "rank") -> int:
    """A rank of a group of ``world_size`` workers: an int in ``[0, world_size)``.

    Args:
        value: the rank to check.
        world_size: the number of workers.
        arg: the argument's name, for the error.

    Returns:
        The rank as an ``int``.

    Raises:
        TypeError: ``value`` is not an int.
        ValueError: it is out of range.
    """
    rank = check_int(value, arg, minimum=0)
    if rank >= world_size:
        raise ValueError(f"{arg} must be < world size {world_size}, got {rank}")
    return rank


REPEATS = ("error", "allow", "merge")


def check_ranks(
    values: Iterable[Any],
    world_size: int,
    arg: str = "ranks",
    *,
    repeats: str = "error",
    first: int = 0,
    group: str | None = None,
) -> list[int]:
    """A list of ranks of a group of ``world_size`` workers, in the given order.

    Each rank follows ``check_rank``'s rule (an int, not a bool), in
    ``[first, first + world_size)``; every bad one is named in one error.

    Args:
        values: the ranks.
        world_size: the number of workers.
        arg: the argument's name, for the error.
        repeats: what a rank given twice means: ``"error"``; ``"allow"`` (a dispatch
            may call one rank twice); ``"merge"`` (kept once, where it first stands).
        first: the lowest rank (1 where ids count from 1, as RLlib's remote runners).
        group: the group's name, for the error.

    Returns:
        The ranks as ``int``.

    Raises:
        TypeError: ``values`` is not a list of ints.
        ValueError: a rank is out of range, or repeated with ``repeats="error"``.
    """
    check_choice(repeats, REPEATS, "repeats")
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{arg} must be a list of ints, got {type(values).__name__}")
    values = list(values)
    not_int = [v for v in values if not _is_int(v)]
    if not_int:
        raise TypeError(
            f"{arg}: ranks must be ints; each rank must be an int rank, got {not_int!r}"
        )
    ranks = [int(v) for v in values]
    bad = [r for r in ranks if not first <= r < first + world_size]
    if bad:
        where = f"group {group} of " if group else ""
        span = f" (ranks {first}..{first + world_size - 1})" if first else ""
        raise ValueError(f"{arg}: ranks {bad} out of range for {where}{world_size} workers{span}")
    if repeats == "merge":
        return list(dict.fromkeys(ranks))
    if repeats == "error" and len(set(ranks)) != len(ranks):
        raise ValueError(f"{arg} has repeated ranks: {ranks}")
    return ranks


def check_name(value: Any, arg: str) -> str:
    """A non-empty string (group, channel, method or route names)."""
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__} ({value!r})")
    if not value:
        raise ValueError(f"{arg} must be a non-empty string")
    return value


def check_tags(value: Any, arg: str = "tags") -> set[str] | None:
    """``None`` (every tag), one tag, or a list/tuple/set of tags, as a set."""
    if value is None:
        return None
    if isinstance(value, str):
        return {value}
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(t, str) for t in value):
        return set(value)
    raise TypeError(f"{arg} must be a str, a list of str or None, got {value!r}")


def check_choice(value: Any, choices: Iterable[Any], arg: str) -> Any:
    """``value`` if it is one of ``choices``; ``ValueError`` naming ``arg`` and the choices."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{arg} must be one of {choices}, got {value!r}")
    return value
