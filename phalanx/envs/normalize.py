"""A running mean/variance of observations whose statistics merge across env runners.

Each runner normalises with the global statistics plus what it saw since the last sync;
``EnvRunnerGroup.sync_env_runner_states`` merges every runner's delta into the global
statistics (the parallel-variance formula of Chan et al.) and hands the result back to
all runners, so every runner (and the learner's checkpoint) agrees on one normaliser.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def batch_moments(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean, variance, count) over the first axis, in float64: what ``merge_moments``
    takes. Written with sums: ``np.mean``/``np.var`` cost several times more on the few
    rows of a vector step."""
    x = np.asarray(batch, np.float64)
    n = x.shape[0]
    mean = x.sum(0) / n
    d = x - mean
    return mean, (d * d).sum(0) / n, float(n)


class RunningMeanStd:
    """Mean and variance over a stream of batches, mergeable with other instances."""

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = float(epsilon)

    def update(self, batch: np.ndarray) -> None:
        """Add a batch of samples (first axis is the batch)."""
        self.merge_moments(*batch_moments(batch))

    def merge_moments(self, mean: np.ndarray, var: np.ndarray, count: float) -> None:
        """Fold in the statistics of another set of ``count`` samples."""
        if count <= 0:
            return
        total = self.count + count
        w_old, w_new = self.count / total, count / total
        delta = mean - self.mean
        self.mean = self.mean + delta * w_new
        self.var = self.var * w_old + var * w_new + delta * delta * (w_old * w_new)
        self.count = total

    def merge(self, other: RunningMeanStd | dict[str, Any]) -> None:
        """Fold in another instance (or its ``get_state()``)."""
        st = other.get_state() if isinstance(other, RunningMeanStd) else other
        self.merge_moments(np.asarray(st["mean"]), np.asarray(st["var"]), float(st["count"]))

    def normalize(self, x: np.ndarray, clip: float = 10.0) -> np.ndarray:
        out = x - self.mean
        out /= np.sqrt(self.var + 1e-8)
        return out.clip(-clip, clip, out=out).astype(np.float32)

    def get_state(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count}

    def set_state(self, state: dict[str, Any]) -> None:
        self.mean = np.array(state["mean"], np.float64)
        self.var = np.array(state["var"], np.float64)
        self.count = float(state["count"])

    def copy(self) -> RunningMeanStd:
        out = RunningMeanStd(self.mean.shape)
        out.set_state(self.get_state())
        return out
