"""Asynchronous GRPO: a collector thread keeps the generation workers producing rollouts
into a bounded :class:`TrajectoryBuffer` while the policy trains (NeMo-RL's
``grpo.async_grpo``).

Versions. The policy's weights version is the number of optimizer steps behind it, so
GRPO step ``s`` trains at version ``s - 1`` and its refit makes version ``s``. The
collector's ``k``-th batch is meant for step ``k``; it starts generating it only once the
generators hold a version ``>= k - 1 - max_trajectory_age_steps``, so a batch is never
older than the bound when its step comes (the buffer still drops and counts any that is,
the safety net of ``TrajectoryBuffer.take``). With the default bound of 1, step ``k``
trains on rollouts of version ``k - 2`` or ``k - 1`` while the generators produce step
``k + 1``'s: generation overlaps training. With 0 the pipeline is synchronous.

Refit between batches. A generation batch runs under one version: the refit (and an
evaluation) waits for the batch in flight to end and keeps the collector from starting
the next until it is done. On an evaluation step the trainer holds one pause over the
refit and the evaluation: were the collector let go between them, the evaluation would
wait for a whole generation batch; ``time/training_wait`` counts that wait and the wait for a
batch, ``time/generation_wait`` how long the collector idled for the trainer.
``in_flight_weight_updates`` (switching weights inside a batch) is refused: the Hugging
Face backend decodes a batch in one call and takes new weights only between calls.

A batch's version is the one its generators hold. A refit that raises leaves the
generators' weights unknown (a death in the middle of a transfer), so no batch starts
until a refit succeeds. After a policy rank died, :meth:`AsyncRollouts.restore` refits
the generators with the relaunched policy's restored state and sets the version to that
state's under one pause; when that is the version the failed refit was making, the
refit done again finds it held and sends nothing.

Failures. A generation batch that raises (a worker exception, or its worker died) is
dropped, and a generation worker restart counts as a failure too (one per death); the
run aborts with :class:`GenerationFailedError` once the failures exceed
``max_generation_failures`` (default 0: the first one). The group's restart policy brings
a dead worker back, refitted with the current weights, before its next call.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from ray.exceptions import RayError

from phalanx._base.errors import WorkerDiedError, WorkerError
from phalanx.algorithms.trajectory_buffer import TrajectoryBuffer
from phalanx.data import BatchedDataDict


class GenerationFailedError(RuntimeError, RayError):
    """More generation failures than ``max_generation_failures``; names the group, the
    count and the last failure (with its remote traceback)."""


class AsyncRollouts:
    """Rollouts produced ahead of the trainer by a collector thread (see the module doc).

    ``make_batch()`` runs one rollout on the generation group; ``refit()`` brings the
    generators to the policy's current weights; ``on_generating(True/False)`` is told when
    a batch starts and ends (the cores follow the phase: :mod:`phase_threads`).
    """

    def __init__(
        self,
        make_batch: Callable[[], BatchedDataDict],
        refit: Callable[[], Any],
        generation: Any,
        *,
        max_trajectory_age_steps: int = 1,
        max_generation_failures: int = 0,
        start_version: int = 0,
        timeout_s: float = 1800.0,
        on_generating: Callable[[bool], None] | None = None,
    ) -> None:
        self._make_batch, self._refit, self.generation = make_batch, refit, generation
        self._on_generating = on_generating or (lambda on: None)
        self.max_age = max_trajectory_age_steps
        self.max_failures = max_generation_failures
        self.timeout_s = timeout_s
        self.version = start_version
        self._refit_target = start_version  # the version the next refit makes
        self._weights_known = True  # False from a failed refit to the next good one
        self.buffer = TrajectoryBuffer(max_trajectory_age_steps + 1)
        self.failures = 0
        self._next_target = start_version + 1
        self._cv = threading.Condition()
        self._generating = False
        self._pauses = 0  # paused() blocks held (they nest)
        self._stopped = False
        self._generation_wait = 0.0
        self._restarts_seen = generation.num_remote_worker_restarts()
        self._deaths_unrestarted = 0
        self._thread = threading.Thread(target=self._collect, name="grpo-collector", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ collector thread
    def _collect(self) -> None:
        try:
            while True:
                with self._cv:
                    t = time.perf_counter()
                    self._cv.wait_for(
                        lambda: (
                            self._stopped
                            or (
                                not self._pauses
                                and self._weights_known
                                and self.version >= self._next_target - 1 - self.max_age
                            )
                        )
                    )
                    self._generation_wait += time.perf_counter() - t
                    if self._stopped:
                        return
                    self._generating, version = True, self.version
                self._on_generating(True)
                try:
                    batch, error = self._make_batch(), None
                except (WorkerError, RayError) as e:
                    batch, error = None, e
                finally:
                    self._on_generating(False)
                    with self._cv:
                        self._generating = False
                        self._cv.notify_all()
                with self._cv:
                    self._count_failures(error)
                if batch is not None:
                    batch["version"] = torch.full((batch.size,), version, dtype=torch.long)
                    self.buffer.put(batch, version)
                    self._next_target += 1
        except BaseException as e:  # anything else ends the run: the trainer re-raises it
            self.buffer.fail(e)

    def _count_failures(self, error: BaseException | None) -> None:
        """One failure per batch that raised and per worker restart it does not explain."""
        restarts = self.generation.num_remote_worker_restarts()
        new = restarts - self._restarts_seen
        self._restarts_seen = restarts
        # A batch's worker death explains its restart, whether that came already or not.
        deaths = self._deaths_unrestarted + isinstance(error, WorkerDiedError)
        unexplained = max(0, new - deaths)
        self._deaths_unrestarted = max(0, deaths - new)
        failed = unexplained + (error is not None)
        if not failed:
            return
        self.failures += failed
        if self.failures > self.max_failures:
            last = (
                "".join(traceback.format_exception(error))
                if error is not None
                else f"{unexplained} generation worker(s) died and were restarted"
            )
            raise GenerationFailedError(
                f"{self.generation.name}: {self.failures} generation failure(s) exceed "
                f"max_generation_failures={self.max_failures}; last failure:\n{last}"
            )

    # ------------------------------------------------------------------ trainer side
    def take(self, step: int) -> tuple[BatchedDataDict, dict[str, float]]:
        """The trajectories for GRPO step ``step`` (policy version ``step - 1``) and the
        step's async metrics."""
        current = step - 1
        with self._cv:
            self._refit_target = step  # step s's refit makes version s
        t = time.perf_counter()
        batch, version = self.buffer.take(current, self.max_age, timeout=self.timeout_s)
        wait = time.perf_counter() - t
        with self._cv:
            gen_wait, self._generation_wait = self._generation_wait, 0.0
        return batch, {
            "async/trajectory_age_mean": float(current - version),
            "async/trajectory_version": float(version),
            "async/dropped_stale": float(self.buffer.dropped_stale),
            "async/generation_failures": float(self.failures),
            "time/training_wait": wait,
            "time/generation_wait": gen_wait,
        }

    @contextlib.contextmanager
    def paused(self) -> Iterator[float]:
        """No generation batch runs inside: waits for the one in flight (yields that wait
        in seconds) and keeps the collector from starting another. Blocks nest: the
        collector goes on when the outermost ends."""
        with self._cv:
            self._pauses += 1
            t = time.perf_counter()
            self._cv.wait_for(lambda: not self._generating)
            waited = time.perf_counter() - t
        try:
            yield waited
        finally:
            with self._cv:
                self._pauses -= 1
                self._cv.notify_all()

    def refit(self) -> dict[str, float]:
        """Refit the generators between two batches to the version of the step last taken
        (step ``s``'s refit makes version ``s``); nothing is sent when they hold it already
        (:meth:`restore` brought them there after a policy rank died in this refit)."""
        with self._cv:
            target = self._refit_target
            if self.version == target and self._weights_known:
                return {"time/refit": 0.0, "time/refit_wait": 0.0}
        with self.paused() as waited:
            t = time.perf_counter()
            self._refit_generators(target)
        return {"time/refit": time.perf_counter() - t, "time/refit_wait": waited}

    def restore(self, version: int) -> None:
        """Refit the generators with a relaunched policy's state, restored from version
        ``version``, and make that the collector's version, under one pause: no batch
        starts between the two, so none is tagged with another version than the one its
        generators hold."""
        with self.paused():
            self._refit_generators(version)

    def _refit_generators(self, version: int) -> None:
        """(Inside a pause) refit, then the generators hold ``version``. A generator that
        died since its last batch fails the refit: a call restarts it (the sender's restart
        hook gives it the refit's weights) and counts a generation failure; any other
        error is raised, and no batch starts until a later refit succeeds."""
        with self._cv:
            self._weights_known = False
        try:
            self._refit()
        except Exception:
            before = self._restarts_seen
            self.generation.call("is_alive").wait(timeout=self.timeout_s)
            if self.generation.num_remote_worker_restarts() == before:
                raise
            try:
                with self._cv:
                    self._count_failures(None)
            except GenerationFailedError as e:
                self.buffer.fail(e)
                raise
        with self._cv:
            self.version = version
            self._weights_known = True

    def close(self) -> None:
        """Stop the collector: it starts no batch; one in flight ends with its call (or
        when the generation group is shut down), then :meth:`join` returns."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.buffer.close()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the collector thread to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
