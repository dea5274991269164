"""Where a run's wall time went: named phases, measured on the driver, printed as a table.

``WallBreakdown`` adds up seconds per phase (``with breakdown.phase("learning"): ...``).
Phases timed on a helper thread while the main thread did something else are recorded
with ``overlapped=True``: they are shown, but not counted again in the total. The part
of the wall time no phase covers is shown as ``other``. ``save`` writes it to a run folder
as ``breakdown.json``, which ``phalanx report`` shows.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BREAKDOWN_FILE = "breakdown.json"


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    import psutil

    return max(time.time() - psutil.Process().create_time(), 0.0)


class WallBreakdown:
    """Seconds per named phase of one run, in the order the phases first appeared."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.overlapped: set[str] = set()

    def add(self, name: str, seconds: float, *, overlapped: bool = False) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)
            if overlapped:
                self.overlapped.add(name)

    @contextmanager
    def phase(self, name: str, *, overlapped: bool = False) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, overlapped=overlapped)

    def as_dict(self, total_s: float | None = None) -> dict[str, float]:
        """The phases (seconds), plus ``other`` when the total wall time is given."""
        with self._lock:
            out = {k: round(v, 3) for k, v in self.seconds.items()}
            # from the rounded figures, so that the ones shown add up to the total
            counted = sum(v for k, v in out.items() if k not in self.overlapped)
        if total_s is not None:
            out["other"] = round(max(total_s - counted, 0.0), 3)
        return out

    def table(self, total_s: float, title: str = "wall time") -> str:
        """A plain-text table: phase, seconds, share of ``total_s``."""
        rows = self.as_dict(total_s)
        width = max(len(k) + (13 if k in self.overlapped else 0) for k in rows) if rows else 5
        lines = [f"{title}: {total_s:.2f} s"]
        for name, s in rows.items():
            label = f"{name} (overlapped)" if name in self.overlapped else name
            share = (
                f"{100 * s / total_s:5.1f}%" if total_s > 0 and name not in self.overlapped else ""
            )
            lines.append(f"  {label:<{width}}  {s:7.2f} s  {share}")
        return "\n".join(lines)

    def save(self, run_dir: str | os.PathLike[str], total_s: float) -> Path:
        """Write ``run_dir/breakdown.json``: total, phases (seconds), overlapped phases."""
        path = Path(run_dir) / BREAKDOWN_FILE
        path.write_text(
            json.dumps(
                {
                    "total_s": round(total_s, 3),
                    "phases": self.as_dict(total_s),
                    "overlapped": sorted(self.overlapped),
                },
                indent=1,
            )
        )
        return path


def read_breakdown(run_dir: str | os.PathLike[str]) -> dict | None:
    """The saved breakdown of a run, or None when it has none."""
    path = Path(run_dir) / BREAKDOWN_FILE
    return json.loads(path.read_text()) if path.exists() else None
