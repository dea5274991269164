"""``phalanx report runs/<name>``: a summary table in the terminal and PNG plots of a run.

Reads what a run leaves in its directory: ``metrics.jsonl`` (``phalanx.observe.metrics``),
``config.json`` when present, ``breakdown.json`` (where the wall time went) when present,
and ``trace.json`` when the run was traced. Writes:

- ``learning_curve.png``: ``return_mean`` (or ``reward_mean``) against ``timesteps``
  (or the step), with the ``return_std`` band when logged and a dashed line at each
  in-place recovery (GRPO: its step; PPO: the timesteps of its iteration);
- ``phase_times.png``: seconds per phase per step, stacked (the ``time/<phase>`` keys;
  ``time/step``, the whole step, is drawn as a line over them);
- ``utilisation.png``: from the trace, one row per worker (and the driver) showing when it
  was running a call, with its busy fraction.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from phalanx.observe.breakdown import read_breakdown
from phalanx.observe.metrics import CONFIG_FILE, read_metrics
from phalanx.observe.plots import (
    CURVE_KEYS,
    EVAL_KEY,
    phase_keys,
    plot_learning_curve,
    plot_phase_times,
    series,
)

TRACE_FILE = "trace.json"


def _last(rows: list[dict[str, Any]], key: str) -> Any:
    for r in reversed(rows):
        if r.get(key) is not None:
            return r[key]
    return None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def utilisation(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per track of a Chrome trace: ``{label: {"spans", "named", "side", "busy_s", "fraction"}}``.

    Rows: ``driver`` (its phases: slices recorded with ``trace.span``), ``driver (waiting)``
    (blocked on results), and one per worker rank (busy while a call runs). ``spans`` are
    the merged busy intervals, ``named`` the ``(start, end, name)`` slices that make them
    up, ``side`` the slices of the rank's other threads (e.g. weight transfers). Times are
    seconds from the first call; ``fraction`` is busy time over the traced window.
    """
    procs = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "process_name"
    }
    named: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    side: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        t0, t1 = e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6
        proc = procs.get(e["pid"], str(e["pid"]))
        cat = e.get("cat")
        if proc == "driver":
            if cat == "wait":
                named["driver (waiting)"].append((t0, t1, "wait"))
            elif e["tid"] == 0 and cat not in ("call", "timer"):
                named["driver"].append((t0, t1, e["name"]))
            continue
        label = f"{proc.removeprefix('group ')} rank {e['tid'] // 100}"
        if cat == "call":
            named[label].append((t0, t1, e["name"]))
        elif e["tid"] % 100:
            side[label].append((t0, t1, e["name"]))
    if not named:
        return {}
    t_min = min(a for spans in named.values() for a, _, _ in spans)
    t_max = max(b for spans in [*named.values(), *side.values()] for _, b, _ in spans)
    total = max(t_max - t_min, 1e-9)
    out: dict[str, dict[str, Any]] = {}
    order = sorted(named, key=lambda s: (s != "driver", s != "driver (waiting)", s))
    for label in order:
        shifted = [(a - t_min, b - t_min, n) for a, b, n in named[label]]
        merged = _merge([(a, b) for a, b, _ in shifted])
        busy = sum(b - a for a, b in merged)
        out[label] = {
            "spans": merged,
            "named": shifted,
            "side": [(a - t_min, b - t_min, n) for a, b, n in side.get(label, [])],
            "busy_s": busy,
            "fraction": busy / total,
        }
    return out


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def summarize(run_dir: str | os.PathLike[str], trace_path: str | None = None) -> dict[str, Any]:
    """The numbers of the summary table (also useful in scripts)."""
    run = Path(run_dir)
    rows = read_metrics(run)
    out: dict[str, Any] = {"run": run.name, "log_rows": len(rows)}
    if not rows:
        return out
    out["steps"] = _last(rows, "step")
    out["wall_time_s"] = rows[-1].get("wall_time", 0) - rows[0].get("wall_time", 0)
    for key in ("timesteps", "episodes", "restarts", "weights_version"):
        if _last(rows, key) is not None:
            out[key] = _last(rows, key)
    recoveries = [r for r in rows if "recovery/step" in r]
    if recoveries:
        out["recoveries"] = ", ".join(
            f"step {r['recovery/step']} ({r.get('recovery/group', '?')}, "
            f"{r.get('recovery/seconds', 0.0):.1f} s)"
            for r in recoveries
        )
    for key in (*CURVE_KEYS, EVAL_KEY):
        _, ys = series(rows, key)
        if ys:
            out[f"{key} first"] = ys[0]
            out[f"{key} last"] = ys[-1]
            out[f"{key} best"] = max(ys)
    for key in sorted({k for r in rows for k in r if k.startswith("loss/")}):
        out[f"{key} last"] = _last(rows, key)
    for key in sorted({k for r in rows for k in r if k.startswith("throughput/")}):
        out[f"{key} mean"] = _mean(series(rows, key)[1])
    for key in [*phase_keys(rows), "time/step"]:
        values = series(rows, key)[1]
        if values:
            out[f"{key} mean s"] = _mean(values)
    breakdown = read_breakdown(run)
    if breakdown is not None:  # where the run's wall time went (phalanx.observe.breakdown)
        out["wall total s"] = breakdown["total_s"]
        for phase, seconds in breakdown["phases"].items():
            overlapped = " (overlapped)" if phase in breakdown.get("overlapped", []) else ""
            out[f"wall {phase}{overlapped} s"] = seconds
    trace_file = Path(trace_path) if trace_path else run / TRACE_FILE
    if trace_file.exists():
        from phalanx.observe.trace import load

        for label, u in utilisation(load(trace_file)).items():
            out[f"busy {label}"] = f"{100 * u['fraction']:.0f}%"
    return out


def plot_utilisation(events: list[dict[str, Any]], path: Path, max_rows: int = 32) -> bool:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    util = utilisation(events)
    if not util:
        return False
    labels = list(util)[:max_rows]
    # One colour per slice name, the names with most time first; the rest are "other".
    totals: dict[str, float] = defaultdict(float)
    for label in labels:
        for a, b, n in util[label]["named"] + util[label]["side"]:
            totals[n] += b - a
    top = sorted(totals, key=lambda n: -totals[n])[:9]
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i) for i, n in enumerate(top)}
    colour["wait"] = (0.6, 0.6, 0.6, 1.0)
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(labels) + 1.8))
    for i, label in enumerate(labels):
        by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for a, b, n in util[label]["named"]:
            by_name[n].append((a, max(b - a, 1e-6)))
        for n, bars in by_name.items():
            ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=colour.get(n, "black"))
        side: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for a, b, n in util[label]["side"]:
            side[n].append((a, max(b - a, 1e-6)))
        for n, bars in side.items():  # other threads of the worker: a thin strip below
            ax.broken_barh(bars, (i + 0.28, 0.12), facecolors=colour.get(n, "black"))
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([f"{lb}  ({100 * util[lb]['fraction']:.0f}%)" for lb in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first call")
    ax.set_title("Utilisation: calls per worker, driver phases and waits (busy %)")
    ax.grid(alpha=0.3, axis="x")
    shown = top + (["wait"] if "wait" in totals and "wait" not in top else [])
    handles = [Patch(color=colour[n], label=n) for n in shown]
    if len(totals) > len(top):
        handles.append(Patch(color="black", label="other"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    trace_path: str | os.PathLike[str] | None = None,
    console: Any = None,
    plots: bool = True,
) -> dict[str, str]:
    """Print the summary table and write the plots; returns ``{plot name: path}``."""
    import matplotlib

    matplotlib.use("Agg")
    from rich.console import Console
    from rich.table import Table

    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run_dir: {run} is not a directory")
    console = console or Console()
    out = Path(out_dir) if out_dir is not None else run
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(run, str(trace_path) if trace_path else None)
    table = Table(title=f"phalanx run [bold]{run.name}[/]", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, float):
            value = f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
        table.add_row(key, str(value))
    config_file = run / CONFIG_FILE
    if config_file.exists():
        cfg = json.loads(config_file.read_text())
        table.add_section()
        for key, value in list(cfg.items())[:30]:
            table.add_row(f"[dim]config.{key}[/]", f"[dim]{value}[/]")
    console.print(table)
    written: dict[str, str] = {}
    if not plots:
        return written
    rows = read_metrics(run)
    if plot_learning_curve(rows, out / "learning_curve.png"):
        written["learning_curve"] = str(out / "learning_curve.png")
    if plot_phase_times(rows, out / "phase_times.png"):
        written["phase_times"] = str(out / "phase_times.png")
    trace_file = Path(trace_path) if trace_path else run / TRACE_FILE
    if trace_file.exists():
        from phalanx.observe.trace import load

        if plot_utilisation(load(trace_file), out / "utilisation.png"):
            written["utilisation"] = str(out / "utilisation.png")
    for name, p in written.items():
        console.print(f"wrote {name}: {p}")
    missing = {"learning_curve", "phase_times", "utilisation"} - set(written)
    for name in sorted(missing):
        why = (
            "no trace.json (run with --trace)"
            if name == "utilisation"
            else "no such metrics logged"
        )
        console.print(f"[dim]skipped {name}: {why}[/]")
    return written


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run's directory, e.g. runs/ppo-cartpole")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: run_dir)")
    parser.add_argument("--trace", default=None, help="trace file (default: run_dir/trace.json)")
    parser.add_argument("--no-plots", action="store_true", help="only print the summary table")


def run(args: argparse.Namespace) -> int:
    try:
        write_report(args.run_dir, args.out, trace_path=args.trace, plots=not args.no_plots)
    except FileNotFoundError as e:
        print(f"phalanx report: {e}")
        return 1
    return 0
