"""In-place recovery of a GRPO run from the death of a policy rank.

After every step's training the policy's state (trainable weights, optimizer, scheduler)
is kept as the run's last good state: each rank copies it into memory-mapped files of its
own (``DTensorPolicyWorker.keep_state``), two slots used in turn, so a death while keeping
one leaves the other whole.

The relaunch starts as soon as the death is seen. The policy group's death listener
(``WorkerGroup.add_death_listener``, told by the health monitor within moments of the
death) starts it on a thread of its own: the old group is shut down, a new one started
and the kept state restored while the loop goes on with what does not need the policy
(generation, rewards). The next policy call (:meth:`PolicyRecovery.call`) waits for that
relaunch, makes the new group the run's, refits the generators on the loop's thread
(asynchronous GRPO: under the collector's pause) and then runs. A call that meets the
death first (:class:`~phalanx.WorkerDiedError`, or an error of a live rank while another
one is dead) joins the same relaunch, or starts it when nothing had seen the death; it is
then done again with the same batch: nothing is trained twice, nothing is skipped. One
death is one relaunch, counted once.

The state lives in ``/dev/shm`` (memory of the driver's node) when every policy rank runs
on the driver's node, else in the run folder's ``recovery/``; it is removed when the run
ends. ``max_restarts`` relaunches are allowed per run; a death past them starts nothing,
and the next policy call ends the run with :class:`RestartBudgetSpentError`, which names
the group, the rank and the remote traceback of that death.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass
class _Relaunch:
    """One relaunch of the policy group, from the death that asked for it to the new
    group taking the run's calls."""

    old: Any  # the group that lost a rank (shut down by the relaunch)
    rank: int
    reason: str  # how the death was seen: the monitor's reason, or the failed call
    slot: int  # the kept state it restores ...
    state_step: int  # ... which is the one kept after this step
    count: int  # the run's relaunches with this one
    seen_at: float  # perf_counter() when the death was seen
    method: str | None = None  # the policy call that met the death, if one did
    started_at: float = 0.0
    policy: Any = None
    parts: dict[str, float] = field(default_factory=dict)
    error: BaseException | None = None
    finished: bool = False  # under the recovery's lock
    done: threading.Event = field(default_factory=threading.Event)


class PolicyRecovery:
    """Keeps the policy's last good state and relaunches the policy group of ``run`` (a
    ``GRPORun``) when a rank dies, at most ``max_restarts`` times (see the module doc).

    ``relaunch_timeout_s`` bounds how long a policy call waits for a relaunch under way
    (default: twice the run's ``policy_timeout_s``, the bound of the new group's start and
    of its state's load)."""

    def __init__(
        self, run: Any, metrics: Any, max_restarts: int, relaunch_timeout_s: float | None = None
    ) -> None:
        self.run, self.metrics, self.max_restarts = run, metrics, max_restarts
        self.relaunch_timeout_s = relaunch_timeout_s
        self.restarts = 0
        self.good: int | None = None  # the slot of the last good state
        self.good_step = 0  # the step after which it was kept
        self.save_seconds = 0.0  # the last snapshot's
        self._root: str | None = None
        self._lock = threading.Lock()
        self._watched: Any = None  # the policy group whose deaths start a relaunch
        self._unwatch: Callable[[], None] | None = None
        self._pending: _Relaunch | None = None  # started, not yet the run's
        self._closed = False

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
        """Keep the policy's current state as the last good one (after ``step``) and act on
        the policy group's deaths from now on; nothing with ``max_restarts=0``, where no
        relaunch would read it."""
        if self.max_restarts == 0:
            return
        t = time.perf_counter()
        slot = 0 if self.good != 0 else 1  # never the last good one
        self.run.policy.keep_state(self._state_root(), slot)
        with self._lock:
            self.good, self.good_step = slot, step
        self.save_seconds = time.perf_counter() - t
        self._watch(self.run.policy.worker_group)

    # ------------------------------------------------------------------ the loop's side
    def call(self, step: int, phase: str, fn: Callable[[], R]) -> R:
        """``fn()``, after the relaunch under way (if any) is done and its group refitted;
        after a policy rank died under ``fn``, the policy is relaunched from the last good
        state and ``fn`` runs again (``phase`` names what is redone)."""
        redone = "none"  # what of this call runs twice
        while True:
            taken = self._take_relaunch()
            if taken is not None:
                try:
                    self._install(step, redone, *taken)
                except Exception as e:  # a rank of the new group died in the refit
                    if not self._recovering(e):
                        raise
                    continue
            try:
                return fn()
            except Exception as e:
                if not self._recovering(e):
                    raise
                redone = phase

    def _recovering(self, error: Exception) -> bool:
        """Whether a relaunch is under way that explains ``error`` (one is started for a
        policy rank's death nothing had seen yet); raises :class:`RestartBudgetSpentError`
        for a death past the budget."""
        with self._lock:
            pending = self._pending
        if pending is not None:  # the death it is for failed the call
            if isinstance(error, WorkerError) and error.group == pending.old.name:
                pending.method = pending.method or error.method
            return True
        if not isinstance(error, WorkerError):
            return False
        group = self.run.policy.worker_group
        rank = dead_rank(group, error)
        if rank is None or self.good is None:  # no death, or no state kept yet
            return False
        reason = f"{error.group}[rank {rank}] died in {error.method}()"
        under_way = self._claim(group, rank, reason, error.method)
        if under_way is None:
            return False
        if under_way:
            return True
        raise self._budget_error(rank, error) from error

    def _take_relaunch(self) -> tuple[_Relaunch, float] | None:
        """The relaunch under way once it is done (None when there is none), and the
        seconds waited for it; a new group that died while it loaded is relaunched again
        (counted) and waited for, one that failed otherwise ends the run."""
        t_wait = time.perf_counter()
        timeout = self.relaunch_timeout_s or 2 * self.run.cfg.policy_timeout_s
        while True:
            rec = self._pending
            if rec is None:
                return None
            with self.run.bar.waiting("the relaunched policy group"):
                done = rec.done.wait(max(0.0, t_wait + timeout - time.perf_counter()))
            if not done:
                raise TimeoutError(
                    f"the policy group's relaunch after {rec.reason} did not end within "
                    f"{timeout:g} s (relaunch_timeout_s)"
                )
            with self._lock:
                self._pending = None
            error = rec.error
            if error is None:
                return rec, time.perf_counter() - t_wait
            if not isinstance(error, WorkerDiedError):
                raise error
            reason = f"{error.group}[rank {error.rank}] died in {error.method}() while loading"
            under_way = self._claim(rec.old, error.rank, reason, error.method)
            if under_way is None:
                raise error
            if not under_way:
                raise self._budget_error(error.rank, error) from error

    def _install(self, step: int, redone: str, rec: _Relaunch, waited: float) -> None:
        """Make the relaunched group the run's, refit the generators from it (on the
        loop's thread, between generation batches) and log the recovery."""
        run = self.run
        run.install_policy(rec.policy)
        self._watch(rec.policy.worker_group)
        if rec.state_step != self.good_step:  # a newer state was kept after the death
            rec.policy.restore_kept_state(self._state_root(), self.good)
            rec.state_step = self.good_step
        t_refit = time.perf_counter()
        run.refit_restored(rec.state_step)
        end = time.perf_counter()
        seconds = end - rec.seen_at
        reason = (
            f"{rec.old.name}[rank {rec.rank}] died in {rec.method}()" if rec.method else rec.reason
        )
        self.metrics.log(step, {
            "recovery/seconds": seconds,
            "recovery/noticed_seconds": rec.started_at - rec.seen_at,
            "recovery/wait_seconds": waited,
            "recovery/shutdown_seconds": rec.parts["shutdown"],
            "recovery/start_seconds": rec.parts["start"],
            "recovery/load_seconds": rec.parts["load"],
            "recovery/refit_seconds": end - t_refit,
            "recovery/group": "policy",
            "recovery/rank": rec.rank,
            "recovery/step": step,
            "recovery/repeated": redone,
            "recovery/reason": reason,
            "recovery/count": rec.count,
        })  # fmt: skip
        again = f"{redone} of step {step} is redone" if redone != "none" else "nothing is redone"
        run.bar.log(
            f"[grpo] step {step}: {reason}; the policy group's relaunch began when the "
            f"death was seen, from the state after step {rec.state_step}, and it was back "
            f"{seconds:.1f} s after the death (restart {rec.count}/{self.max_restarts}; the "
            f"policy call waited {waited:.1f} s for it); {again}"
        )

    def _budget_error(self, rank: int, e: WorkerError) -> RestartBudgetSpentError:
        return RestartBudgetSpentError(
            e.group, e.rank, e.method, e.remote_traceback, e.cause_type,
            f"rank {rank} died after the policy group was relaunched "
            f"{self.restarts} time(s) (max_restarts={self.max_restarts}): "
            f"{e.message or type(e).__name__}",
        )  # fmt: skip

    # ------------------------------------------------------------------ the relaunch
    def _watch(self, group: Any) -> None:
        """Act on the deaths of ``group`` (the run's policy group) from now on."""
        with self._lock:
            if self._watched is group:
                return
            self._watched = group
            unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
        ref = weakref.ref(group)  # the listener must not keep a dropped group alive

        def on_death(rank: int, reason: str) -> None:
            g = ref()
            if g is not None:
                self._claim(g, rank, f"{g.name}[rank {rank}] died ({reason})", None)

        remove = group.add_death_listener(on_death)
        with self._lock:
            self._unwatch = remove

    def _claim(self, group: Any, rank: int, reason: str, method: str | None) -> bool | None:
        """Start the relaunch for a death of ``group``'s ``rank`` (on a thread: this may run
        on the health monitor's). True: a relaunch is under way for it; False: the budget
        is spent, none starts; None: not the run's policy group (an old one's late news),
        no state kept yet, or the run ended."""
        with self._lock:
            if self._closed or self.good is None:
                return None
            if self._pending is not None:  # this death's, or another rank's of that group
                return True if self._pending.old is group else None
            if group is not self._watched:
                return None
            if self.restarts >= self.max_restarts:
                return False
            self.restarts += 1
            rec = self._pending = _Relaunch(
                group, rank, reason, self.good, self.good_step, self.restarts,
                time.perf_counter(), method,
            )  # fmt: skip
        threading.Thread(
            target=self._relaunch, args=(rec,), name="grpo-policy-relaunch", daemon=True
        ).start()
        return True

    def _relaunch(self, rec: _Relaunch) -> None:
        """(On the relaunch's thread) shut ``rec.old`` down and start the new group from
        the kept state; a group started after the run ended is shut down here."""
        rec.started_at = time.perf_counter()
        try:
            root = self._state_root()
            rec.policy, rec.parts = self.run.start_policy_from(rec.old, root, rec.slot)
        except BaseException as e:  # the loop's next policy call raises or retries it
            rec.error = e
        finally:
            with self._lock:
                rec.finished = True
                orphan = self._closed and rec.policy is not None
            if orphan:
                rec.policy.worker_group.shutdown(timeout=5.0, force=True)
            rec.done.set()

    def close(self) -> None:
        """Stop acting on deaths, shut down a relaunched group the run never took, remove
        the kept state."""
        with self._lock:
            self._closed = True
            rec, self._pending = self._pending, None
            unwatch, self._unwatch = self._unwatch, None
            orphan = rec is not None and rec.finished and rec.policy is not None
        if unwatch is not None:
            unwatch()
        if orphan:
            assert rec is not None
            rec.policy.worker_group.shutdown(timeout=5.0, force=True)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
