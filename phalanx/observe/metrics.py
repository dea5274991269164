"""One small metrics logger for every algorithm: JSONL always, TensorBoard and W&B optionally.

``MetricsLogger(run_dir).log(step, {...})`` appends one JSON object per call to
``run_dir/metrics.jsonl`` (``{"step": ..., "wall_time": ..., **metrics}``). The file is the
source of truth that ``phalanx report`` reads; TensorBoard (when the ``tensorboard``
package is installed) and Weights & Biases (when installed *and* asked for) get the same
scalars.

Standard keys (use these names so reports and dashboards line up across algorithms):

================== ==============================================================
``timesteps``      environment steps (or samples, for LLM runs) consumed so far
``episodes``       episodes finished so far
``return_mean``    mean episodic return of episodes finished since the last log
``return_std``     their standard deviation (``return_min``/``return_max`` too)
``reward_mean``    mean reward per sample (LLM runs: one reward per response)
``loss/<name>``    losses of the last update: ``loss/policy``, ``loss/value``,
                   ``loss/entropy``, ``loss/kl``, ``loss/total``
``time/<phase>``   seconds spent in a phase during this step: ``time/rollout``,
                   ``time/train``, ``time/weight_sync``, ``time/generate``,
                   ``time/logprobs``, ``time/wait``; ``time/step`` is the whole step,
                   ``time/total`` the seconds since the run began
``throughput/<x>`` rates: ``throughput/steps_per_s`` (env steps),
                   ``throughput/samples_per_s``, ``throughput/tokens_per_s``
``restarts``       worker restarts so far (all groups)
``weights_version`` version of the weights the rollout workers hold
================== ==============================================================

Nested dicts are flattened with ``/`` (``{"time": {"train": 1.0}}`` -> ``time/train``);
torch and numpy scalars become numbers; NaN and infinities are written as ``null`` so
the file stays strict JSON.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"

STANDARD_KEYS: dict[str, str] = {
    "timesteps": "environment steps (or samples) consumed so far",
    "episodes": "episodes finished so far",
    "return_mean": "mean episodic return of episodes finished since the last log",
    "return_std": "standard deviation of those returns",
    "reward_mean": "mean reward per sample (LLM runs)",
    "loss/": "losses of the last update (loss/policy, loss/value, loss/entropy, loss/kl)",
    "time/": "seconds per phase in this step (time/rollout, time/train, time/weight_sync, time/step)",
    "throughput/": "rates (throughput/steps_per_s, throughput/tokens_per_s)",
    "restarts": "worker restarts so far",
    "weights_version": "weights version held by the rollout workers",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _scalar(value: Any) -> Any:
    """A JSON-friendly value: numbers stay numbers, 1-element tensors/arrays become numbers."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)
    if callable(item) and (getattr(value, "ndim", None) == 0 or _numel(value) == 1):
        return _scalar(item())
    if isinstance(value, numbers.Real):
        return _scalar(float(value))
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return _scalar(tolist())
    if isinstance(value, (list, tuple)):
        return [_scalar(v) for v in value]
    raise TypeError(f"metric value of type {type(value).__name__} is not a number, string or list")


def _numel(value: Any) -> int:
    numel = getattr(value, "numel", None)
    if callable(numel):
        return int(numel())
    size = getattr(value, "size", None)
    return size if isinstance(size, int) else -1


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"time": {"train": 1}}`` -> ``{"time/train": 1}``, values made JSON-friendly."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric names must be non-empty strings, got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        else:
            out[name] = _scalar(value)
    return out


class MetricsLogger:
    """Writes metrics of a run to ``run_dir/metrics.jsonl`` (+ TensorBoard, W&B).

    ``use_tensorboard=None`` means "when the tensorboard package is installed";
    ``use_wandb=True`` logs to W&B when ``wandb`` is installed (a warning otherwise).
    Use as a context manager or call ``close()``. ``backends`` lists what is active.

    Args:
        run_dir: the run's directory (made if missing).
        use_tensorboard: write TensorBoard event files too.
        use_wandb: log to W&B too.
        config: the run's configuration, written to ``config.json``.
        wandb_project: the W&B project.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        use_tensorboard: bool | None = None,
        use_wandb: bool = False,
        *,
        config: Mapping[str, Any] | None = None,
        wandb_project: str = "phalanx",
    ):
        if not isinstance(run_dir, (str, os.PathLike)) or not str(run_dir):
            raise TypeError(f"run_dir must be a path, got {run_dir!r}")
        if use_tensorboard not in (None, True, False):
            raise TypeError(f"use_tensorboard must be None, True or False, got {use_tensorboard!r}")
        if use_wandb not in (True, False):
            raise TypeError(f"use_wandb must be True or False, got {use_wandb!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._t0 = time.time()
        self._tb: Any = None
        self._wandb: Any = None
        self.backends: list[str] = ["jsonl"]
        if config is not None:
            self.log_config(config)
        if use_tensorboard is not False:
            if _installed("tensorboard"):
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
                self.backends.append("tensorboard")
            elif use_tensorboard:
                warnings.warn(
                    "use_tensorboard=True but the tensorboard package is not installed; "
                    "logging to metrics.jsonl only",
                    stacklevel=2,
                )
        if use_wandb:
            if _installed("wandb"):
                import wandb

                self._wandb = wandb.init(
                    project=wandb_project,
                    name=self.run_dir.name,
                    dir=str(self.run_dir),
                    config=dict(config) if config is not None else None,
                )
                self.backends.append("wandb")
            else:
                warnings.warn(
                    "use_wandb=True but the wandb package is not installed; "
                    "logging to metrics.jsonl only",
                    stacklevel=2,
                )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record ``metrics`` at ``step``; returns the row as written.

        Args:
            step: the step.
            metrics: the values, nested mappings flattened to ``a/b`` keys.

        Returns:
            The row.

        Raises:
            TypeError: ``step`` is not an int or ``metrics`` not a mapping.
            RuntimeError: the logger is closed.
            ValueError: ``metrics`` has a ``step`` or ``wall_time`` key.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping, got {type(metrics).__name__}")
        if self._file.closed:
            raise RuntimeError(f"MetricsLogger({self.run_dir}) is closed")
        flat = flatten(metrics)
        for reserved in ("step", "wall_time"):
            if reserved in flat:
                raise ValueError(f"metrics: {reserved!r} is reserved (given as an argument)")
        now = time.time()
        row = {"step": step, "wall_time": round(now, 3), **flat}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        numeric = {
            k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, global_step=step, walltime=now)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        return row

    def drop_after(self, step: int) -> int:
        """Remove the ``metrics.jsonl`` rows past ``step`` (a resumed run redoes those
        steps and logs them again); returns how many were removed. A torn last line from
        a crash goes too.

        Args:
            step: the last step kept.

        Returns:
            The number of rows removed.

        Raises:
            TypeError: ``step`` is not an int.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        self._file.close()
        kept, dropped = [], 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    dropped += bool(line.strip())
                    continue
                if (
                    isinstance(row, dict)
                    and isinstance(row.get("step"), int)
                    and row["step"] > step
                ):
                    dropped += 1
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if dropped:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        return dropped

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Write the run's configuration to ``run_dir/config.json`` (replacing it).

        Args:
            config: the configuration.

        Raises:
            TypeError: ``config`` is not a mapping.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        with open(self.run_dir / CONFIG_FILE, "w", encoding="utf-8") as f:
            json.dump(dict(config), f, indent=2, default=str)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsLogger({str(self.run_dir)!r}, backends={self.backends})"


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
