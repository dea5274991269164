"""Recovery rows for workers that their own group restarts (PPO's env runners, GRPO's
generation workers).

Such a group replaces a dead worker by itself, between the training loop's calls; the
loop only sees a counter go up. :class:`RestartWatch` reads the group's health events
instead and turns each finished restart into the ``recovery/*`` row and console line
that an in-place relaunch of a policy group leaves: the seconds from the death being
seen to the worker being back (its process started, its state and the latest weights
restored), and the part of it spent starting the new process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx._base.errors import WorkerDiedError


class RestartBudgetSpentError(WorkerDiedError):
    """A worker of a training run died after the run had used its ``max_restarts``
    restarts (GRPO: of its policy group; PPO: of its learner)."""


@dataclass(frozen=True)
class Restart:
    """One finished restart of one rank.

    Attributes:
        rank: the rank.
        down_at: when its death (or failure) was seen (``time.time()``).
        asked_at: when its new process was asked for.
        back_at: when it was healthy again: its new process started, its state and the
            latest weights restored.
        reason: why it went down (the health event's reason).
        attempts: restart attempts it took (more than one when a new process died too).
    """

    rank: int
    down_at: float
    asked_at: float
    back_at: float
    reason: str
    attempts: int

    @property
    def seconds(self) -> float:
        """From the death being seen to the rank being healthy again."""
        return self.back_at - self.down_at

    @property
    def start_seconds(self) -> float:
        """From the new process being asked for to the rank being healthy again."""
        return self.back_at - self.asked_at


class RestartWatch:
    """The restarts of ``group()`` finished since the last :meth:`new` call.

    ``group`` is called each time (a set of workers may replace its group); a new group
    object starts a new count. Restarts done while the group started (no death seen
    before them) are not recoveries and are left out.
    """

    def __init__(self, group: Callable[[], Any]) -> None:
        self._group = group
        self._seen_group: Any = None
        self._next = 0  # index of the first health event not read yet
        self._down: dict[int, tuple[float, str]] = {}  # rank -> (time down, reason)
        self._restarting: dict[int, tuple[float, int]] = {}  # rank -> (first ask, attempts)

    def new(self) -> list[Restart]:
        """Restarts finished since the last call, in the order they finished."""
        from phalanx.group.fault import WorkerHealth

        group = self._group()
        if group is None:
            return []
        if group is not self._seen_group:
            self._seen_group, self._next = group, 0
            self._down.clear()
            self._restarting.clear()
        events = group.health_events()
        out = []
        for e in events[self._next :]:
            if e.old == WorkerHealth.HEALTHY and e.new != WorkerHealth.HEALTHY:
                self._down[e.rank] = (e.time, e.reason)
            if e.new == WorkerHealth.RESTARTING and e.rank in self._down:
                first, n = self._restarting.get(e.rank, (e.time, 0))
                self._restarting[e.rank] = (first, n + 1)
            if e.new == WorkerHealth.HEALTHY and e.rank in self._down:
                down_at, reason = self._down.pop(e.rank)
                asked_at, attempts = self._restarting.pop(e.rank, (e.time, 0))
                if attempts:  # back without a new process (answered a probe) is no restart
                    out.append(Restart(e.rank, down_at, asked_at, e.time, reason, attempts))
        self._next = len(events)
        return out


def recovery_row(restart: Restart, group: str, step: int, **extra: Any) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of ``restart`` of a worker of ``group`` (a role name),
    seen at ``step``."""
    return {
        "recovery/seconds": restart.seconds,
        "recovery/start_seconds": restart.start_seconds,
        "recovery/group": group,
        "recovery/rank": restart.rank,
        "recovery/step": step,
        "recovery/reason": restart.reason,
        "recovery/attempts": restart.attempts,
        **extra,
    }


def console_line(bar: Any, message: str) -> None:
    """``message`` above the live display, or as a plain line when there is none (a run
    with ``progress`` off still says what it recovered from)."""
    if getattr(bar, "enabled", False):
        bar.log(message)
    else:
        print(message, flush=True)
