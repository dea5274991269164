"""Hang reports: where the stuck ranks of a group call are, at the moment it timed out.

Stacks are taken through the host's ``_px_stacks`` method, which runs in the control
concurrency group and so does not queue behind the stuck call. A rank that does not
answer that (its process holds the GIL in native code, say) is dumped with ``py-spy``
when it is installed and the worker runs on this node.

A report is written to a file (``$PHALANX_HANG_DIR``, default ``<tmp>/phalanx_hangs``)
and raised as :class:`HangTimeoutError` (a ``TimeoutError``) whose message gives its path.
:class:`Watchdog` prints the same report for any call of a group that runs longer than N
seconds (``group.set_watchdog(N)``, or ``PHALANX_WATCHDOG_S=N`` for every group).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from phalanx._base.checks import check_number
from phalanx._base.errors import GroupTimeoutError

STACKS_TIMEOUT_S = 5.0
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PYSPY_FRAME = re.compile(r"^\s+(\S+) \(([^)]+:\d+)\)$", re.MULTILINE)
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


def _in_stdlib(path: str) -> bool:
    """Whether a frame's file is in the Python standard library (frozen modules too)."""
    if path.startswith("<frozen"):
        return True
    real = os.path.realpath(path)
    installed = (f"{os.sep}{d}{os.sep}" in real for d in ("site-packages", "dist-packages"))
    return real.startswith(_STDLIB) and not any(installed)


class Members(Protocol):
    """What a report needs of a group: its name, actors and worker metadata (public API)."""

    name: str

    @property
    def actors(self) -> list[Any]: ...

    @property
    def worker_metadata(self) -> list[dict[str, Any]]: ...


class Watched(Protocol):
    """A call the watchdog follows: its method, ranks and their Ray refs."""

    method: str
    ranks: list[int]
    refs: list[Any]


def hang_dir() -> str:
    """Where hang reports are written."""
    return os.environ.get("PHALANX_HANG_DIR") or os.path.join(
        tempfile.gettempdir(), "phalanx_hangs"
    )


@dataclass
class HangReport:
    """Stacks of the ranks of one group call that had not finished after ``elapsed_s``.

    Attributes:
        group: the group's name.
        method: the method's name.
        elapsed_s: seconds the call had run.
        pending_ranks: the ranks still running.
        stacks: each pending rank's thread stacks, as text.
        workers: each pending rank's actor name, pid and node.
        path: the file it was written to (``""`` until ``write``).
    """

    group: str
    method: str
    elapsed_s: float
    pending_ranks: list[int]
    stacks: dict[int, str] = field(default_factory=dict)
    workers: dict[int, dict[str, Any]] = field(default_factory=dict)
    path: str = ""

    def text(self) -> str:
        """The report as text: the call, the ranks still running and their stacks.

        Returns:
            The text.
        """
        lines = [
            f"phalanx hang report: {self.group}.{self.method}() still running after "
            f"{self.elapsed_s:.1f}s on ranks {self.pending_ranks}",
            f"taken at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        ]
        for rank in self.pending_ranks:
            w = self.workers.get(rank, {})
            lines.append("")
            lines.append(
                f"=== rank {rank} (actor {w.get('name', '?')}, pid {w.get('pid', '?')}, "
                f"node {w.get('node_ip', '?')}) ==="
            )
            lines.append(self.stacks.get(rank, "(no stack)").rstrip())
        return "\n".join(lines) + "\n"

    def innermost(self, rank: int) -> str:
        """The innermost frame of the thread running the call (best guess), as text.

        Frames of the Python standard library are passed over (a rank polling
        ``os.path.exists`` is reported in the function that polls), unless every frame
        of the thread is one.

        Args:
            rank: the rank.

        Returns:
            ``function (file:line)``, or ``""`` if unknown.
        """
        stack = self.stacks.get(rank, "")
        pyspy = stack.startswith("(py-spy)")
        best = ""
        for block in stack.split("\nThread " if pyspy else "--- thread "):
            if not any(m in block for m in ("_px_call", "_px_apply", "_px_stream")):
                continue
            if pyspy:  # "    fn (file.py:12)", innermost first
                frames = [(fn, *w.rsplit(":", 1)) for fn, w in _PYSPY_FRAME.findall(block)]
            else:  # 'File "f.py", line 12, in fn', innermost last
                frames = [(fn, f, line) for f, line, fn in reversed(_FRAME.findall(block))]
            ours = [fr for fr in frames if not _in_stdlib(fr[1])] or frames
            if ours:
                fn, f, line = ours[0]
                best = f"{fn} ({os.path.basename(f)}:{line})"
        return best

    def write(self, directory: str | None = None) -> str:
        """Write the report to a new file in ``directory``.

        Args:
            directory: where (the hang-report directory if None).

        Returns:
            The file's path.
        """
        directory = directory or hang_dir()
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.group}-{self.method}")
        fd, path = tempfile.mkstemp(prefix=f"{safe}-{stamp}-", suffix=".txt", dir=directory)
        with os.fdopen(fd, "w") as f:
            f.write(self.text())
        self.path = path
        return path


class HangTimeoutError(GroupTimeoutError):
    """A group call timed out; ``report`` (and the file at ``report_path``) has the stacks.

    ``results`` maps each rank that did finish to its result (or its exception).

    Args:
        group: the group's name.
        method: the method's name.
        pending_ranks: the ranks that did not answer.
        timeout: the seconds waited.
        report: the hang report's text.
        report_path: the file it was written to.
        results: the finished ranks' results or exceptions.
        where: each pending rank's innermost frame.
        silent: the ranks whose health probe went unanswered.
        silence_s: how long those were silent.
    """

    def __init__(
        self,
        group: str,
        method: str,
        pending_ranks: list[int],
        timeout: float,
        report: str = "",
        report_path: str = "",
        results: dict[int, Any] | None = None,
        where: dict[int, str] | None = None,
        silent: list[int] | None = None,
        silence_s: float = 0.0,
    ):
        self.report_path = report_path
        self.results = dict(results or {})
        self.where = dict(where or {})
        self.silent_ranks = list(silent or [])
        self.silence_s = silence_s
        super().__init__(group, method, pending_ranks, timeout, report)
        stuck = ", ".join(f"rank {r} in {w}" for r, w in self.where.items() if w)
        text = f"{group}.{method}() did not finish within {timeout}s on ranks {self.pending_ranks}"
        if self.silent_ranks:
            text += (
                f": ranks {self.silent_ranks} did not answer a health probe for {silence_s:g}s "
                "(a stopped or wedged process; PHALANX_CALL_SILENCE_S)"
            )
        text += (
            f"{'; stuck: ' + stuck if stuck else ''}; hang report with their stacks: "
            f"{report_path or '(not written)'}"
        )
        self.args = (text,)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return (
            type(self),
            (
                self.group,
                self.method,
                self.pending_ranks,
                self.timeout,
                self.report,
                self.report_path,
                {},
                self.where,
                self.silent_ranks,
                self.silence_s,
            ),
        )


def collect_stacks(
    group: Members, ranks: list[int], timeout_s: float = STACKS_TIMEOUT_S
) -> dict[int, str]:
    """Python stacks of every thread of each rank's process, taken now."""
    refs = {}
    actors = group.actors
    for r in ranks:
        try:
            refs[r] = actors[r]._px_stacks.remote()
        except Exception as e:  # noqa: BLE001
            refs[r] = e
    out: dict[int, str] = {}
    plain = [v for v in refs.values() if isinstance(v, ray.ObjectRef)]
    if plain:
        ray.wait(plain, num_returns=len(plain), timeout=timeout_s, fetch_local=True)
    for r, ref in refs.items():
        if isinstance(ref, BaseException):
            out[r] = f"(stacks unavailable: {ref})"
            continue
        try:
            out[r] = ray.get(ref, timeout=0.5)
        except Exception as e:  # noqa: BLE001 - fall back to py-spy below
            out[r] = _py_spy(group, r) or f"(stacks unavailable: {_why_no_stacks(group, r, e)})"
    return out


def _local_pid(group: Members, rank: int) -> int | None:
    """The pid of ``rank``'s process when it runs on this node (else None)."""
    metas = group.worker_metadata
    meta = metas[rank] if rank < len(metas) else {}
    pid = meta.get("pid")
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        here = None
    return pid if pid and meta.get("ray_node_id") in (None, here) else None


def _proc_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _why_no_stacks(group: Members, rank: int, error: BaseException) -> str:
    """Why ``rank`` gave no stacks, as exactly as this node can tell."""
    if not isinstance(error, ray.exceptions.GetTimeoutError):
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    silent = f"its process did not answer within {STACKS_TIMEOUT_S:g}s"
    pid = _local_pid(group, rank)
    if pid is None:
        return f"{silent} (it runs on another node: its state cannot be read from here)"
    state = _proc_state(pid)
    if state is None:
        return f"{silent}; process {pid} is gone"
    if state in ("T", "t"):
        return (
            f"process {pid} is stopped (state {state}: SIGSTOP or a debugger); a stopped "
            "process runs no code, so it cannot report its stacks"
        )
    if state == "Z":
        return f"process {pid} has exited (zombie)"
    if state == "D":
        return f"{silent}; process {pid} waits in the kernel (state D: disk or network I/O)"
    return (
        f"{silent}; process {pid} is running (state {state}): a thread holds the GIL in "
        "native code, or the process is overloaded"
    )


def _py_spy(group: Members, rank: int) -> str:
    exe = shutil.which("py-spy")
    metas = group.worker_metadata
    meta = metas[rank] if rank < len(metas) else {}
    pid = meta.get("pid")
    if not exe or not pid:
        return ""
    try:
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        here = None
    if meta.get("ray_node_id") not in (None, here) or _proc_state(pid) in ("T", "t"):
        return ""  # another node's process, or a stopped one (py-spy cannot read it)
    try:
        proc = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return "(py-spy)\n" + proc.stdout if proc.returncode == 0 and proc.stdout else ""


def build_report(group: Members, method: str, pending: list[int], elapsed_s: float) -> HangReport:
    """Take the stacks of ``pending`` ranks and write the report file."""
    meta = group.worker_metadata
    report = HangReport(
        group=group.name,
        method=method,
        elapsed_s=elapsed_s,
        pending_ranks=list(pending),
        stacks=collect_stacks(group, pending),
        workers={r: meta[r] for r in pending if r < len(meta)},
    )
    report.write()
    return report


def timeout_error(
    group: Members,
    method: str,
    pending: list[int],
    timeout: float,
    results: dict[int, Any] | None = None,
    *,
    silent: list[int] | None = None,
    silence_s: float = 0.0,
) -> HangTimeoutError:
    """The error raised when a call given ``timeout`` did not finish on ``pending``
    (``silent``: the ranks among them that left their health probe unanswered for
    ``silence_s``, which ended the wait)."""
    report = build_report(group, method, pending, timeout)
    return HangTimeoutError(
        group.name,
        method,
        pending,
        timeout,
        report.text(),
        report.path,
        results,
        {r: report.innermost(r) for r in pending},
        silent,
        silence_s,
    )


class Watchdog:
    """Prints a hang report for each call of a group that runs longer than ``after_s``.

    Each call is reported once. The check runs on a daemon thread every
    ``min(1, after_s / 4)`` seconds and only asks Ray whether a call is done.

    Args:
        group: the group to watch.
        after_s: seconds a call may run before it is reported.
        stream: where reports go (stderr if None).
    """

    def __init__(self, group: Members, after_s: float, stream: Any = None):
        after_s = check_number(after_s, "after_s")
        if after_s <= 0:
            raise ValueError(f"after_s must be > 0 seconds, got {after_s:g}")
        self.group_ref = weakref.ref(group)
        self.after_s = after_s
        self.stream = stream
        self.reports: list[HangReport] = []
        self._calls: list[tuple[float, Watched]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-watchdog", daemon=True)
        self._thread.start()

    def track(self, handle: Watched) -> None:
        """Watch ``handle`` from now on.

        Args:
            handle: the call's handle.
        """
        with self._lock:
            self._calls.append((time.monotonic(), handle))

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, self.after_s / 4)
        while not self._stop.wait(period):
            group = self.group_ref()
            if group is None or not ray.is_initialized():
                return
            now = time.monotonic()
            with self._lock:
                calls, self._calls = self._calls, []
            keep = []
            for started, handle in calls:
                pending = _pending_ranks(handle)
                if not pending:
                    continue
                if now - started < self.after_s:
                    keep.append((started, handle))
                    continue
                try:
                    report = build_report(group, handle.method, pending, now - started)
                except Exception as e:  # noqa: BLE001 - a watchdog must not die
                    print(f"[phalanx watchdog] could not build a report: {e}", file=sys.stderr)
                    continue
                self.reports.append(report)
                out = self.stream or sys.stderr
                print(f"[phalanx watchdog] report written to {report.path}", file=out)
                print(report.text(), file=out, flush=True)
            with self._lock:
                self._calls[:0] = keep


def _pending_ranks(handle: Watched) -> list[int]:
    refs = handle.refs
    if not all(isinstance(r, ray.ObjectRef) for r in refs):
        return [
            rk for rk, g in zip(handle.ranks, refs) if not getattr(g, "is_finished", lambda: True)()
        ]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    done = set(ready)
    return [rk for rk, r in zip(handle.ranks, refs) if r not in done]


__all__ = ["HangReport", "HangTimeoutError", "Watchdog", "collect_stacks", "build_report"]
