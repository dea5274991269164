"""PNG plots of a run's ``metrics.jsonl`` rows: the learning curve and the time per phase.

Both algorithms draw their curve at the end of a run and ``phalanx report`` draws both
plots again; they read the standard keys of ``phalanx.observe.metrics``. matplotlib's
``Figure`` is used directly (no pyplot): no GUI backend is imported.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# The curve's key, the first one logged wins: PPO's mean over its last episodes, the
# episodes of one log row, GRPO's mean reward over a step's responses.
CURVE_KEYS = ("return_mean_recent", "return_mean", "reward_mean")
_BANDS = {
    "return_mean": ("return_std", "± 1 std over the row's episodes"),
    "reward_mean": ("reward_std", "± 1 std over the step's responses"),
}
EVAL_KEY = "eval/accuracy"
NOT_PHASES = ("time/step", "time/total")  # the whole step, and time since the run began


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(x, y) of ``key`` over the rows that have a finite value; x is ``timesteps`` when
    every such row has it, else ``step``."""
    use_ts = all("timesteps" in r for r in rows if r.get(key) is not None)
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["timesteps"] if use_ts else r["step"])
            ys.append(float(v))
    return xs, ys


def phase_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The ``time/<phase>`` keys of the rows, in first-seen order (not the step totals)."""
    keys: dict[str, None] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("time/") and k not in NOT_PHASES and isinstance(v, (int, float)):
                keys[k] = None
    return list(keys)


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def plot_learning_curve(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> bool:
    """The learning curve (with its std band when logged) and, when logged, the held-out
    accuracy on a second axis; ``False`` (nothing written) when there is no curve key."""
    key = next((k for k in CURVE_KEYS if series(rows, k)[1]), None)
    evals = series(rows, EVAL_KEY)
    if key is None and not evals[1]:
        return False
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    lines = []
    if key is not None:
        xs, ys = series(rows, key)
        lines += ax.plot(xs, ys, color="tab:blue", lw=1.8, label=key.replace("_", " "))
        std_key, meaning = _BANDS.get(key, ("", ""))
        sx, sd = series(rows, std_key) if std_key else ([], [])
        if sd and sx == xs:
            lo, hi = [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)]
            lines.append(ax.fill_between(xs, lo, hi, alpha=0.2, label=meaning))
        ax.set_ylabel(key.replace("_", " "))
        ax.set_xlabel("timesteps" if all("timesteps" in r for r in rows if key in r) else "step")
    if evals[1]:
        ax2 = ax.twinx() if key is not None else ax
        lines += ax2.plot(*evals, "o-", color="tab:red", label="held-out greedy accuracy")
        ax2.set_ylim(-0.05, 1.05)
        ax2.set_ylabel("held-out accuracy")
        ax.set_xlabel("step")
    lines += _mark_recoveries(ax, rows)
    ax.set_title(title or "Learning curve")
    ax.grid(alpha=0.3)
    ax.legend(handles=lines, loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def recovery_marks(rows: list[dict[str, Any]], x_axis: str) -> list[float]:
    """Where each in-place recovery (a row with ``recovery/step``) goes on a curve whose x
    axis is ``x_axis``, so that a mark sits on the curve's point of the step or iteration
    it happened in.

    On ``"step"`` a recovery goes at its ``recovery/step`` (GRPO). On ``"timesteps"`` it
    goes at the ``timesteps`` of the iteration row whose ``iteration`` is its
    ``recovery/iteration`` (PPO's learner and env runners), or at its own row's step, which
    PPO writes in timesteps, when that iteration wrote no row (the run stopped first); a
    recovery without ``recovery/iteration`` has no place there and is left out.

    Args:
        rows: the rows of a ``metrics.jsonl`` (``read_metrics``).
        x_axis: ``"step"`` or ``"timesteps"``.

    Returns:
        The x of each recovery, in the rows' order.

    Raises:
        ValueError: ``x_axis`` is neither ``"step"`` nor ``"timesteps"``.
    """
    if x_axis not in ("step", "timesteps"):
        raise ValueError(f"x_axis must be 'step' or 'timesteps', got {x_axis!r}")
    recoveries = [r for r in rows if "recovery/step" in r]
    if x_axis == "step":
        return [r["recovery/step"] for r in recoveries]
    at_iteration = {
        r["iteration"]: r["timesteps"]
        for r in rows
        if "iteration" in r and "timesteps" in r and "recovery/step" not in r
    }
    return [
        at_iteration.get(r["recovery/iteration"], r["step"])
        for r in recoveries
        if "recovery/iteration" in r
    ]


def _mark_recoveries(ax: Any, rows: list[dict[str, Any]]) -> list[Any]:
    """A dashed line at each in-place recovery (:func:`recovery_marks`) on the curve's axis
    (its x label: ``step`` or ``timesteps``); the legend handle, or none."""
    x_axis = ax.get_xlabel()
    if x_axis not in ("step", "timesteps"):
        return []
    xs = recovery_marks(rows, x_axis)
    if not xs:
        return []
    marks = [ax.axvline(x, color="tab:gray", ls="--", lw=1) for x in xs]
    what = (
        "a group relaunched, its step redone"
        if x_axis == "step"
        else "the learner or an env runner restarted"
    )
    marks[0].set_label(f"recovery ({len(xs)}: {what})")
    return marks[:1]


def plot_phase_times(rows: list[dict[str, Any]], path: str | Path) -> bool:
    """Seconds per phase per step, stacked, with the step's total as a line; steps before
    the first (a warm-up) are left out. ``False`` when no phase was logged."""
    rows = [r for r in rows if r.get("step", 0) >= 1 and any(k in r for k in phase_keys(rows))]
    keys = phase_keys(rows)
    if not keys:
        return False
    steps = [r["step"] for r in rows]
    fig = _figure(8, 4)
    ax = fig.add_subplot()
    bottom = [0.0] * len(rows)
    width = 0.8 * (min(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 1 else 1)
    for key in keys:
        vals = [float(r.get(key) or 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, width=width, label=key.removeprefix("time/"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    totals = [(r["step"], r["time/step"]) for r in rows if r.get("time/step") is not None]
    if totals:
        ax.plot(*zip(*totals), "k.-", lw=1, label="step (total)")
    ax.set_xlim(min(steps) - width, max(steps) + width)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Time per phase per step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
