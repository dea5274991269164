"""The phases of a training step: one labelled block each, timed, traced and shown.

``with phases("training"):`` runs the block while the progress line says what is running,
records it as a trace span and adds its wall seconds to ``phases.times["training"]`` (a
phase entered twice in a step counts both); with ``peak=True`` the peak memory of the
block (from a ``memory`` object with ``reset()`` and ``peak()``) goes to
``phases.memory_gb["training"]``; with a ``breakdown`` (a ``WallBreakdown``) the block's
time also goes to the run's wall-time breakdown under the phase's ``breakdown`` name. An algorithm's loop then reads as its list of phases, with no timing statements
between them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from phalanx.observe import trace


class StepPhases:
    """Times, traces and shows the phases of each step of a training loop.

    Args:
        bar: a ``Progress`` (its ``waiting(label)`` shows the running phase).
        memory: what measures peak memory (``reset()``, ``peak()`` in GB), or None.
        breakdown: the run's ``WallBreakdown``, or None.
    """

    def __init__(self, bar: Any, memory: Any = None, breakdown: Any = None) -> None:
        self.bar = bar
        self.memory = memory
        self.breakdown = breakdown
        self.times: dict[str, float] = {}
        self.memory_gb: dict[str, float] = {}

    def new_step(self) -> None:
        """Forget the previous step's figures."""
        self.times, self.memory_gb = {}, {}

    @contextmanager
    def __call__(
        self,
        name: str,
        label: str | None = None,
        peak: bool = False,
        breakdown: str | None = None,
    ) -> Iterator[None]:
        """Run the block as phase ``name`` (shown as ``label``, default the name; in the
        wall-time breakdown as ``breakdown``, default the name).

        Raises:
            ValueError: ``peak=True`` without a ``memory`` object.
        """
        if peak and self.memory is None:
            raise ValueError(f"phase {name!r}: peak=True needs StepPhases(memory=...)")
        if peak:
            self.memory.reset()
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.bar.waiting(label or name))
            stack.enter_context(trace.span(name, cat="phase"))
            if self.breakdown is not None:
                stack.enter_context(self.breakdown.phase(breakdown or name))
            yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
        if peak:
            self.memory_gb[name] = self.memory.peak()
