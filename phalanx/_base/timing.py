"""Timers inside workers and their reduction across ranks.

Each worker process keeps one recorder. ``with worker.worker_timer("tag")`` adds the
span's duration to ``tag``; nested spans are recorded under their own tags, so a parent
and its children both appear. The group handle's ``consume_durations()`` pops every
rank's totals and reduces them (max by default: the slowest rank bounds the step).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_REDUCERS: dict[str, Callable[[list[float]], float]] = {
    "max": max,
    "min": min,
    "sum": sum,
    "mean": lambda xs: sum(xs) / len(xs),
}


class TimerRecorder:
    """Accumulates named durations (seconds) inside one process."""

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        # Span listeners (tracing) get (tag, start_s, end_s, depth); empty means no cost.
        self.listeners: list[Callable[[str, float, float, int], None]] = []

    @contextmanager
    def span(self, tag: str) -> Iterator[None]:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"timer tag must be a non-empty string, got {tag!r}")
        self._stack.append(tag)
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._stack.pop()
            self._totals[tag] += end - start
            for listener in self.listeners:
                listener(tag, start, end, len(self._stack))

    def add(self, tag: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere (e.g. in another process) to ``tag``."""
        self._totals[tag] += seconds

    def consume(self) -> dict[str, float]:
        """Return the totals recorded since the last call and reset them."""
        out = dict(self._totals)
        self._totals.clear()
        return out

    def peek(self) -> dict[str, float]:
        return dict(self._totals)


def reduce_durations(per_rank: list[dict[str, float]], reduce: str = "max") -> dict[str, float]:
    """Combine per-rank duration maps tag by tag (``max``, ``min``, ``mean`` or ``sum``).

    Args:
        per_rank: one dict from tag to seconds per rank.
        reduce: ``"max"``, ``"min"``, ``"mean"`` or ``"sum"``.

    Returns:
        A dict from tag to the combined seconds.

    Raises:
        ValueError: ``reduce`` is not one of those.
    """
    if reduce not in _REDUCERS:
        raise ValueError(f"reduce must be one of {sorted(_REDUCERS)}, got {reduce!r}")
    fn = _REDUCERS[reduce]
    by_tag: dict[str, list[float]] = defaultdict(list)
    for durations in per_rank:
        for tag, value in durations.items():
            by_tag[tag].append(value)
    return {tag: fn(values) for tag, values in by_tag.items()}


def timer(tag: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator form of ``worker_timer``: times every call of a worker method under ``tag``.

    Args:
        tag: the timer's name.

    Returns:
        The decorator.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.worker_timer(tag):
                return fn(self, *args, **kwargs)

        return wrapper

    return decorate
