"""In-place recovery of a GRPO run from the death of a policy rank.

After every step's training the policy's state (trainable weights, optimizer, scheduler)
is kept as the run's last good state: each rank copies it into memory-mapped files of its
own (``DTensorPolicyWorker.keep_state``), two slots used in turn, so a death while keeping
one leaves the other whole. A call on the policy that meets a dead rank
(:class:`~phalanx.WorkerDiedError`, or an error of a live rank while another one is dead)
then relaunches the whole policy group (its process group is rebuilt), restores that
state, refits the generators and does the interrupted part of the step again with the
same batch: nothing is trained twice, nothing is skipped.

The state lives in ``/dev/shm`` (memory of the driver's node) when every policy rank runs
on the driver's node, else in the run folder's ``recovery/``; it is removed when the run
ends. ``max_restarts`` relaunches are allowed per run; the next death ends the run with
:class:`RestartBudgetSpentError`, which names the group, the rank and the remote
traceback of that death.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

from phalanx._base.errors import WorkerDiedError, WorkerError
from phalanx.algorithms.worker_recoveries import RestartBudgetSpentError

R = TypeVar("R")
SHM = "/dev/shm"


def dead_rank(group: Any, error: WorkerError) -> int | None:
    """The rank of ``group`` whose death ``error`` reports or follows from, or None when
    ``error`` is a plain failure of a live group (or another group's)."""
    from phalanx.weights.transports.collective import ping

    if error.group != group.name:
        return None
    if isinstance(error, WorkerDiedError):
        return error.rank
    _, dead = ping(dict(enumerate(group.actors)))
    return min(dead) if dead else None


class PolicyRecovery:
    """Keeps the policy's last good state and relaunches the policy group of ``run`` (a
    ``GRPORun``) when a rank dies under :meth:`call`, at most ``max_restarts`` times."""

    def __init__(self, run: Any, metrics: Any, max_restarts: int) -> None:
        self.run, self.metrics, self.max_restarts = run, metrics, max_restarts
        self.restarts = 0
        self.good: int | None = None  # the slot of the last good state
        self.good_step = 0  # the step after which it was kept
        self.save_seconds = 0.0  # the last snapshot's
        self._root: str | None = None

    def _state_root(self) -> str:
        """Where snapshots go: driver-node memory when every policy rank is on this node."""
        import ray

        if self._root is None:
            pg = self.run.policy.worker_group
            here = ray.get_runtime_context().get_node_id()
            local = all(m.get("ray_node_id") == here for m in pg.worker_metadata)
            if local and os.path.isdir(SHM):
                self._root = tempfile.mkdtemp(prefix=f"phalanx-recovery-{os.getpid()}-", dir=SHM)
            else:
                self._root = os.path.join(self.run.cfg.run_dir, "recovery")
                os.makedirs(self._root, exist_ok=True)
        return self._root

    def snapshot(self, step: int) -> None:
        """Keep the policy's current state as the last good one (after ``step``); nothing
        with ``max_restarts=0``, where no relaunch would read it."""
        if self.max_restarts == 0:
            return
        t = time.perf_counter()
        slot = 0 if self.good != 0 else 1  # never the last good one
        self.run.policy.keep_state(self._state_root(), slot)
        self.good, self.good_step = slot, step
        self.save_seconds = time.perf_counter() - t

    def call(self, step: int, phase: str, fn: Callable[[], R]) -> R:
        """``fn()``; after a policy rank died under it, the policy is relaunched from the
        last good state and ``fn`` runs again (``phase`` names what is redone)."""
        while True:
            try:
                return fn()
            except WorkerError as e:
                self._recover_or_raise(step, phase, e)

    def _recover_or_raise(self, step: int, phase: str, error: WorkerError) -> None:
        """Recover from ``error`` if it is a policy rank's death and the budget allows, else
        raise; a death during the recovery itself is recovered (and counted) the same way."""
        while True:
            rank = dead_rank(self.run.policy.worker_group, error)
            if rank is None or self.good is None:  # no death, or no state kept yet
                raise error
            if self.restarts >= self.max_restarts:
                e = error
                raise RestartBudgetSpentError(
                    e.group, e.rank, e.method, e.remote_traceback, e.cause_type,
                    f"rank {rank} died after the policy group was relaunched "
                    f"{self.restarts} time(s) (max_restarts={self.max_restarts}): "
                    f"{e.message or type(e).__name__}",
                ) from e  # fmt: skip
            try:
                self._recover(step, phase, rank, error)
                return
            except WorkerError as e:
                error = e

    def _recover(self, step: int, phase: str, rank: int, error: WorkerError) -> None:
        """Relaunch the policy from the last good state, refit, log the recovery."""
        assert self.good is not None
        t = time.perf_counter()
        self.restarts += 1
        run = self.run
        parts = run.relaunch_policy(self._state_root(), self.good)
        t_refit = time.perf_counter()
        run.refit_restored(self.good_step)
        seconds = time.perf_counter() - t
        reason = f"{error.group}[rank {rank}] died in {error.method}()"
        self.metrics.log(step, {
            "recovery/seconds": seconds,
            "recovery/shutdown_seconds": parts["shutdown"],
            "recovery/start_seconds": parts["start"],
            "recovery/load_seconds": parts["load"],
            "recovery/refit_seconds": time.perf_counter() - t_refit,
            "recovery/group": "policy",
            "recovery/rank": rank,
            "recovery/step": step,
            "recovery/repeated": phase,
            "recovery/reason": reason,
            "recovery/count": self.restarts,
        })  # fmt: skip
        run.bar.log(
            f"[grpo] step {step}: {reason}; policy group relaunched from the state after "
            f"step {self.good_step} in {seconds:.1f} s "
            f"(restart {self.restarts}/{self.max_restarts}); {phase} of step {step} is redone"
        )

    def close(self) -> None:
        """Remove the kept state."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
