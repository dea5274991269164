"""PPO's learner in a worker process that its group restarts (``num_learners=1``).

RLlib's ``num_learners``: with 0 the update runs in the driver process (RLlib's local
learner), so the learner's death is the run's death; with 1 it runs in the one worker of
a phalanx group under a :class:`~phalanx.RestartPolicy`, and the driver keeps the last
good state. After every update the worker returns its policy's and optimizer's state
dicts and torch's random state; the driver loads them into its own copy of the policy
and optimizer (the one the env runners' weight sync and the checkpoints read) and
registers them with the group as the state of a restarted worker. When the worker's
process dies (:class:`~phalanx.WorkerDiedError` of this group; an exception raised by
the update's code is a bug and is raised as it is), its group starts a new process and
gives it that state before it takes a call; a death under an update then has the driver
send the update again, on the same batch with the same random state: nothing is
trained twice, nothing skipped.

``max_restarts`` restarts are allowed per run; the next death ends the run with
:class:`LearnerRestartBudgetSpentError` (group, rank, remote traceback of that death).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import phalanx as px
from phalanx._base.errors import WorkerDiedError, WorkerError
from phalanx.algorithms.ppo_config import PPOConfig
from phalanx.algorithms.worker_recoveries import (
    Restart,
    RestartBudgetSpentError,
    RestartWatch,
    console_line,
)

if TYPE_CHECKING:
    import torch

    from phalanx.algorithms.ppo_run import Learner

# ppo_update(policy, optimizer, data, cfg) -> statistics: the update the worker runs
# (``phalanx.algorithms.ppo.ppo_update``, given by the caller, so the loop's module is
# not imported from here).
Update = Callable[[Any, Any, dict[str, Any], PPOConfig], dict[str, float]]

GROUP = "learner"  # recovery/group of the learner's restarts
# Seconds a restarted learner may take to be healthy again: a process start on a loaded
# machine, as Ray's own start is given (PHALANX_RAY_START_TIMEOUT_S's default).
RESTART_WAIT_S = 300.0


class LearnerRestartBudgetSpentError(RestartBudgetSpentError):
    """PPO's learner died after the run had used its ``max_restarts`` restarts."""


class PPOLearnerWorker(px.Worker):
    """The learner's process: a policy and optimizer built as the driver's are, trained
    by ``update`` (:func:`~phalanx.algorithms.ppo.ppo_update`) on the batches the driver
    sends."""

    def __init__(self, cfg: PPOConfig, update: Update) -> None:
        super().__init__()
        import gymnasium as gym
        import torch

        from phalanx.algorithms.ppo_run import build_optimizer, build_policy

        self._update = update
        torch.set_num_threads(cfg.torch_threads)
        env = gym.make(cfg.env, disable_env_checker=True, **cfg.env_config)
        spaces = (env.observation_space, env.action_space)
        env.close()
        self.cfg = cfg
        self.policy = build_policy(cfg, *spaces)
        self.optimizer = build_optimizer(cfg, self.policy)
        self.load_seconds = 0.0

    def set_state(self, state: tuple[dict, dict, torch.Tensor]) -> None:
        """Take a kept state: weights, optimizer state and torch's random state (also what
        the group gives a restarted worker before it takes a call)."""
        import torch

        t = time.perf_counter()
        policy, optimizer, rng = state
        self.policy.load_state_dict(policy)
        self.optimizer.load_state_dict(optimizer)
        torch.set_rng_state(rng)
        self.load_seconds = time.perf_counter() - t

    def update(self, data: dict[str, torch.Tensor], lr: float) -> tuple[dict, tuple, float]:
        """One PPO update at learning rate ``lr``; its statistics, the state it leaves
        (weights, optimizer state, torch's random state) and the seconds this process's
        last ``set_state`` took."""
        import torch

        # The count is kept per thread and the actor's calls may run on another thread
        # than its __init__.
        torch.set_num_threads(self.cfg.torch_threads)
        self.optimizer.param_groups[0]["lr"] = lr
        stats = self._update(self.policy, self.optimizer, data, self.cfg)
        state = (self.policy.state_dict(), self.optimizer.state_dict(), torch.get_rng_state())
        return stats, state, self.load_seconds


class RemoteLearner:
    """The driver's side of the learner's worker: runs each update there and keeps the
    state it leaves, both in ``learner`` (the driver's copy of the policy and optimizer)
    and as the state the group gives the worker when it restarts it
    (``register_state``). A worker that dies under an update is restarted with that
    state and the update runs again; one that dies between updates is restarted with it
    before the next. At most ``max_restarts`` restarts per run.

    Args:
        cfg: the run's config.
        cluster: the cluster to start the worker on (None: ``px.Cluster()``).
        name: the group's name.
        update: the update the worker runs (``ppo_update``).
    """

    def __init__(self, cfg: PPOConfig, cluster: Any, name: str, update: Update) -> None:
        self.cfg = cfg
        self.learner: Learner | None = None  # the driver's copy, given by take()
        self.max_restarts = cfg.max_restarts
        self.restarts = 0
        self.keep_seconds = 0.0  # the last update's: keeping the state it left
        self._between: list[tuple[Restart, int]] = []  # restarts not logged yet
        policy = px.RestartPolicy(max_restarts_per_worker=cfg.max_restarts, capture_state_from=None)
        self.group = PPOLearnerWorker.create_group(cfg, update).launch(
            cluster if cluster is not None else px.Cluster(),
            px.NodePlacement(num_workers=1),
            name=name,
            restart_policy=policy,
        )
        self._watch = RestartWatch(lambda: self.group)

    def take(self, learner: Learner) -> None:
        """Train ``learner`` (the driver's policy and optimizer, which hold the state of
        the last update from now on) from its current state and torch's random state."""
        import copy

        import torch

        self.learner = learner
        state = (
            copy.deepcopy(learner.policy.state_dict()),
            copy.deepcopy(learner.optimizer.state_dict()),
            torch.get_rng_state(),
        )
        self.group.register_state(0, state)
        self.group.set_state(state).wait()

    def update(self, data: dict[str, torch.Tensor], lr: float, bar: Any, log: Any) -> dict:
        """The update of the current iteration, done again on the same batch after the
        worker died under it; each restart is logged to ``log`` (a ``MetricsLogger``) and
        printed above ``bar``."""
        redone: list[tuple[Restart, int, float]] = []  # (restart, count, update resumed at)
        while True:
            called_at = time.time()
            try:
                stats, state, load = self.group.update(data, lr).wait()[0]
                break
            except WorkerError as e:
                restarted = self._restarts_after(e, called_at)
                redone += [(r, n, time.time()) for r, n in restarted]
        t = time.perf_counter()
        self.group.register_state(0, state)
        learner = self.learner
        assert learner is not None, "take() a learner first"
        learner.policy.load_state_dict(state[0])
        learner.optimizer.load_state_dict(state[1])
        self.keep_seconds = time.perf_counter() - t
        for r, n, resumed in redone:
            self._log(r, n, resumed - r.down_at, load, "update", bar, log)
        self._count(self._watch.new())  # died between updates: restarted before this one
        for r, n in self._between:
            self._log(r, n, r.seconds, load, "nothing (it died between updates)", bar, log)
        self._between.clear()
        return stats

    def _count(self, restarts: list[Restart]) -> list[tuple[Restart, int]]:
        """Count ``restarts`` against the budget; each with its count."""
        out = []
        for r in restarts:
            self.restarts += 1
            out.append((r, self.restarts))
        return out

    def _restarts_after(self, error: WorkerError, called_at: float) -> list[tuple[Restart, int]]:
        """The restart (with its count) that ``error``, the worker's death in a call made
        at ``called_at``, set off, once the group gave the new process the kept state.
        Raises ``error`` when it is not a death of this group's worker, and the budget's
        error past ``max_restarts``. Restarts of deaths before the call are kept for the
        rows written after the update."""
        if not isinstance(error, WorkerDiedError) or error.group != self.group.name:
            raise error
        seen = self._watch.new()
        self._between += self._count([r for r in seen if r.down_at < called_at])
        restarted = [r for r in seen if r.down_at >= called_at]
        if self.restarts >= self.max_restarts:
            e = error
            raise LearnerRestartBudgetSpentError(
                e.group, e.rank, e.method, e.remote_traceback, e.cause_type,
                f"the learner died after it was restarted {self.restarts} time(s) "
                f"(max_restarts={self.max_restarts}): {e.message or type(e).__name__}",
            ) from e  # fmt: skip
        deadline = time.monotonic() + RESTART_WAIT_S
        while not restarted:  # the death is seen by the group's watcher within milliseconds
            if time.monotonic() > deadline or self.group.health()[0] == px.WorkerHealth.DEAD:
                raise error
            self.group.wait_healthy(timeout_seconds=1.0, ranks=[0])
            restarted = self._watch.new()
            if not restarted:
                time.sleep(0.02)  # not seen by the group's watcher yet, or between attempts
        return self._count(restarted)

    def _log(self, restart: Restart, count: int, seconds: float, load: float, redone: str,
             bar: Any, log: Any) -> None:  # fmt: skip
        """A ``recovery/*`` row and a console line for ``restart`` (the ``count``-th), which
        took ``seconds`` from the death being seen to the learner going on, ``load`` of
        them giving the new process the kept state."""
        learner = self.learner
        assert learner is not None
        reason = f"{self.group.name}[rank {restart.rank}]: {restart.reason}"
        log.log(learner.timesteps, {
            "recovery/seconds": seconds,
            "recovery/start_seconds": restart.start_seconds - load,
            "recovery/load_seconds": load,
            "recovery/resumed_at": restart.down_at + seconds,
            "recovery/group": GROUP,
            "recovery/rank": restart.rank,
            "recovery/step": learner.timesteps,
            "recovery/iteration": learner.iteration,
            "recovery/repeated": redone,
            "recovery/reason": reason,
            "recovery/attempts": restart.attempts,
            "recovery/count": count,
        })  # fmt: skip
        console_line(
            bar,
            f"[ppo] iteration {learner.iteration}: learner {reason}; restarted with the "
            f"state after iteration {learner.iteration - 1} in {seconds:.1f} s (restart "
            f"{count}/{self.max_restarts}); redone: {redone}",
        )

    def stop(self) -> None:
        """Shut the worker's group down."""
        self.group.shutdown(timeout=30)
