"""CartPole with faults on a fixed schedule, for env-runner failure tests and benchmarks.

``env_config`` keys (the creator gets an :class:`~phalanx.envs.EnvContext`):

- ``bad``: worker indices whose env faults (default: none);
- ``at_step``: the fault comes at this ``step()`` call of the env (1-based);
- ``every``: or a fault at every multiple of this many ``step()`` calls;
- ``mode``: ``"raise"`` (ValueError from ``step``), ``"exit"`` (the runner's process
  exits), ``"hang"`` (``step`` blocks for an hour) or ``"nan"`` (``step`` returns a NaN
  observation);
- ``once_dir``: if set, each worker index faults only once: a marker file in this
  folder, written just before the fault, stops later incarnations from faulting again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np


class FaultyCartPole(gym.Wrapper):
    def __init__(self, ctx: Any):
        super().__init__(gym.make("CartPole-v1"))
        self.worker_index = getattr(ctx, "worker_index", 0)
        self.bad = list(ctx.get("bad", []))
        self.at_step = ctx.get("at_step")
        self.every = ctx.get("every")
        self.mode = ctx.get("mode", "raise")
        self.once_dir = ctx.get("once_dir")
        self.steps = 0

    def _due(self) -> bool:
        if self.worker_index not in self.bad:
            return False
        if self.every is not None:
            return self.steps % self.every == 0
        return self.at_step is not None and self.steps == self.at_step

    def step(self, action: Any):
        self.steps += 1
        if self._due():
            if self.once_dir is not None:
                marker = Path(self.once_dir) / f"faulted_{self.worker_index}"
                if marker.exists():
                    return self.env.step(action)
                marker.write_text(str(os.getpid()))
            if self.mode == "exit":
                os._exit(1)
            if self.mode == "hang":
                time.sleep(3600)
            if self.mode == "nan":
                obs, reward, term, trunc, info = self.env.step(action)
                return np.full_like(obs, np.nan), reward, term, trunc, info
            raise ValueError(
                f"simulated env failure on worker {self.worker_index} at step {self.steps}"
            )
        return self.env.step(action)


def make_faulty_cartpole(ctx: Any) -> gym.Env:
    """The ``env_creator`` of :class:`FaultyCartPole`."""
    return FaultyCartPole(ctx)


def make_cartpole_dying_in_init(ctx: Any) -> gym.Env:
    """CartPole whose remote runner's process is killed while it is being built.

    ``env_config``: ``driver_pid`` (the test process: the driver builds envs too and never
    dies), ``deaths`` (``{worker_index: n}``: the first ``n`` incarnations of that runner
    die in ``__init__``), ``marks`` (a folder: one file per incarnation started, so the
    schedule survives the restarts), optional ``gates`` (``{worker_index: [gate file per
    incarnation]}``: an incarnation waits up to 120 s for its gate file before going on).
    """
    wi = getattr(ctx, "worker_index", 0)
    if os.getpid() != ctx["driver_pid"] and getattr(ctx, "vector_index", 0) == 0:
        marks = Path(ctx["marks"])
        n = len(list(marks.glob(f"init_{wi}_*"))) + 1
        (marks / f"init_{wi}_{n}").write_text(str(os.getpid()))
        gates = ctx.get("gates", {}).get(wi, [])
        if n <= len(gates):
            deadline = time.monotonic() + 120
            while not Path(gates[n - 1]).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        if n <= ctx.get("deaths", {}).get(wi, 0):
            os.kill(os.getpid(), signal.SIGKILL)
    return gym.make("CartPole-v1")
