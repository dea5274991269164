"""Live progress for training loops and long operations: never silent for long.

A training loop::

    bar = Progress(total=cfg.steps, title="PPO", unit="steps")
    for step in range(1, cfg.steps + 1):
        with bar.waiting("rollouts from 4 env runners"):
            batch = runners.sample().wait()
        ...
        bar.update(step, {"timesteps": t, "return_mean": r, "restarts": n})
    bar.close()

A long operation on Ray object refs (e.g. workers starting)::

    wait_refs(refs, "workers ready", timeout_s=120)

On a terminal this is a rich live display (bar, rate, the standard metric keys of
``phalanx.observe.metrics`` and what the loop is waiting for, with its elapsed time). Elsewhere
(logs, CI, pytest) it prints one plain line at most every ``log_interval_s`` seconds, and
a background ticker prints "still waiting for ..." so no wait is silent for longer than
that. ``PHALANX_PROGRESS=0`` turns every display off.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as _RichProgress
from rich.text import Text

# Standard metric keys shown when present, with their label and format.
_SHOWN: list[tuple[str, str, str]] = [
    ("timesteps", "timesteps", "{:,.0f}"),
    ("return_mean", "return", "{:.2f}"),
    ("reward_mean", "reward", "{:.3f}"),
    ("loss/total", "loss", "{:.4f}"),
    ("throughput/steps_per_s", "steps/s", "{:,.0f}"),
    ("throughput/tokens_per_s", "tok/s", "{:,.0f}"),
    ("time/step", "step", "{:.2f}s"),
    ("restarts", "restarts", "{:d}"),
    ("weights_version", "weights v", "{:d}"),
]


def _enabled(enabled: bool | None) -> bool:
    if enabled is not None:
        return bool(enabled)
    return os.environ.get("PHALANX_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


def format_stats(stats: Mapping[str, Any], keys: Sequence[str] | None = None) -> str:
    """``"return 12.30 · steps/s 1,024 · restarts 0"`` from a metrics row."""
    parts = []
    table = _SHOWN if keys is None else [(k, k, "{}") for k in keys]
    for key, label, fmt in table:
        value = stats.get(key)
        if value is None or isinstance(value, bool):
            continue
        try:
            text = fmt.format(value)
        except (ValueError, TypeError):
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
        parts.append(f"{label} {text}")
    return " · ".join(parts)


class _StatusColumn(ProgressColumn):
    """Rate, stats and "waiting for X (Ns)" of a task, re-rendered on every refresh."""

    def __init__(self, unit: str):
        super().__init__()
        self._unit = unit

    def render(self, task: Task) -> Text:
        text = Text()
        if task.speed:
            text.append(f"{task.speed:.2f} {self._unit}/s  ", style="cyan")
        stats = task.fields.get("stats", "")
        if stats:
            text.append(stats)
        what = task.fields.get("waiting")
        if what:
            waited = time.monotonic() - task.fields.get("wait_since", time.monotonic())
            text.append(f"  waiting for {what} ({waited:.0f}s)", style="yellow")
        return text


class Progress:
    """A live progress display: ``update(completed, stats)``, ``waiting(what)``, ``close()``.

    ``total`` may be None (no bar, a counter). ``start`` is where a resumed run begins.
    ``keys`` picks the stats shown (default: the standard keys of ``phalanx.observe.metrics``).
    Closes itself when ``completed`` reaches ``total``.

    Args:
        total: the count at the end (None: a counter without a bar).
        start: the count to start from.
        title: the display's title.
        unit: what is counted.
        keys: the stats shown.
        enabled: show anything at all (None: unless ``PHALANX_PROGRESS`` is 0, false, no or off).
        console: the ``rich`` console to draw on.
        log_interval_s: seconds between lines when the output is not a terminal.
    """

    def __init__(
        self,
        total: int | float | None = None,
        *,
        start: int | float = 0,
        title: str = "training",
        unit: str = "steps",
        keys: Sequence[str] | None = None,
        enabled: bool | None = None,
        console: Console | None = None,
        log_interval_s: float = 5.0,
    ):
        if total is not None and (isinstance(total, bool) or not isinstance(total, (int, float))):
            raise TypeError(f"total must be a number or None, got {total!r}")
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if isinstance(start, bool) or not isinstance(start, (int, float)):
            raise TypeError(f"start must be a number, got {start!r}")
        if not isinstance(log_interval_s, (int, float)) or log_interval_s <= 0:
            raise ValueError(f"log_interval_s must be > 0, got {log_interval_s!r}")
        self.total = total
        self.completed = start
        self.title = title
        self.unit = unit
        self.keys = list(keys) if keys is not None else None
        self.enabled = _enabled(enabled)
        self.console = console if console is not None else Console(stderr=True)
        self.log_interval_s = float(log_interval_s)
        self.stats: dict[str, Any] = {}
        self._stats_text = ""
        self._waiting: str | None = None
        self._wait_since = 0.0
        self._t0 = time.monotonic()
        self._last_line = 0.0
        self._last_text = ""
        self._lock = threading.Lock()
        self._closed = False
        self._live: _RichProgress | None = None
        self._task: Any = None
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        if not self.enabled:
            return
        if self.console.is_terminal:
            self._live = _RichProgress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                _StatusColumn(unit),
                console=self.console,
                refresh_per_second=4,
                transient=False,
            )
            self._task = self._live.add_task(
                title, total=total, completed=start, stats="", waiting=None
            )
            self._live.start()
        else:
            self._ticker = threading.Thread(target=self._tick, name="phalanx-progress", daemon=True)
            self._ticker.start()

    # -- public ---------------------------------------------------------------------
    def update(
        self,
        completed: int | float | None = None,
        stats: Mapping[str, Any] | None = None,
        *,
        advance: int | float | None = None,
    ) -> None:
        """Set (``completed``) or advance (``advance``) the count; show ``stats``.

        Args:
            completed: the new count.
            stats: values to show beside the bar.
            advance: add this to the count.

        Raises:
            ValueError: both ``completed`` and ``advance`` are given.
            TypeError: ``stats`` is not a mapping.
        """
        if completed is not None and advance is not None:
            raise ValueError("give completed or advance, not both")
        if stats is not None and not isinstance(stats, Mapping):
            raise TypeError(f"stats must be a mapping, got {type(stats).__name__}")
        with self._lock:
            if completed is not None:
                self.completed = completed
            elif advance is not None:
                self.completed += advance
            if stats:
                self.stats.update(stats)
                self._stats_text = format_stats(self.stats, self.keys)
        if self._closed or not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._task, completed=self.completed, stats=self._stats_text)
        elif time.monotonic() - self._last_line >= self.log_interval_s or self._finished():
            self._print_line()
        if self._finished():
            self.close()

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Show "waiting for ``what``" (with its elapsed time) while the block runs.

        Args:
            what: what is waited for.

        Yields:
            Nothing; the display shows the wait while the block runs.

        Raises:
            ValueError: ``what`` is not a non-empty string.
        """
        if not isinstance(what, str) or not what:
            raise ValueError(f"what must be a non-empty string, got {what!r}")
        previous, previous_since = self._waiting, self._wait_since
        self._set_waiting(what, time.monotonic())
        try:
            yield
        finally:
            self._set_waiting(previous, previous_since)

    @property
    def waiting_for(self) -> str | None:
        """What the innermost running ``waiting`` block shows, or None."""
        return self._waiting

    def log(self, message: str) -> None:
        """Print a message above the live display (or as a line).

        Args:
            message: the text.
        """
        if self.enabled and not self._closed:
            self.console.print(message, highlight=False)

    def close(self) -> None:
        """Stop the display (idempotent); prints the final state in line mode."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._live is not None:
            self._live.update(self._task, completed=self.completed, waiting=None)
            self._live.stop()
        elif self.enabled:
            self._print_line(unless_same=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------
    def _finished(self) -> bool:
        return self.total is not None and self.completed >= self.total

    def _set_waiting(self, what: str | None, since: float) -> None:
        self._waiting, self._wait_since = what, since
        if self._live is not None and not self._closed:
            self._live.update(self._task, waiting=what, wait_since=since)

    def _line(self) -> str:
        count = f"{self.completed:g}" + (f"/{self.total:g}" if self.total is not None else "")
        parts = [f"[{self.title}] {count} {self.unit}", f"{time.monotonic() - self._t0:.0f}s"]
        if self._stats_text:
            parts.append(self._stats_text)
        if self._waiting:
            parts.append(
                f"waiting for {self._waiting} ({time.monotonic() - self._wait_since:.0f}s)"
            )
        return " · ".join(parts)

    def _print_line(self, *, unless_same: bool = False) -> None:
        line = self._line()
        if unless_same and line == self._last_text:
            return
        self._last_line, self._last_text = time.monotonic(), line
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def _tick(self) -> None:
        step = min(1.0, self.log_interval_s / 2)
        while not self._stop.wait(step):
            if time.monotonic() - self._last_line >= self.log_interval_s:
                self._print_line()


def wait_refs(
    refs: Sequence[Any],
    what: str,
    *,
    timeout_s: float | None = None,
    progress: Progress | None = None,
    enabled: bool | None = None,
) -> list[Any]:
    """Wait for Ray object refs showing "k/n ``what``"; returns the ready refs in order.

    Raises ``TimeoutError`` naming how many are still pending after ``timeout_s``.
    """
    import ray

    if not isinstance(what, str) or not what:
        raise ValueError(f"what must be a non-empty string, got {what!r}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    refs = list(refs)
    own = progress is None
    bar = progress or Progress(total=len(refs), title=what, unit="ready", enabled=enabled)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    remaining = list(refs)
    try:
        with bar.waiting(what):
            while remaining:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"{what}: {len(remaining)}/{len(refs)} still pending after {timeout_s}s"
                    )
                step = 1.0 if left is None else min(1.0, left)
                _, remaining = ray.wait(
                    remaining, num_returns=len(remaining), timeout=step, fetch_local=False
                )
                if own:
                    bar.update(len(refs) - len(remaining))
    finally:
        if own:
            bar.close()
    return refs
