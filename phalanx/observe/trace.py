"""Timeline tracing of a distributed run, written as a Chrome trace that Perfetto opens.

Turn it on with ``phalanx.observe.trace.enable("trace.json")`` (or ``PHALANX_TRACE=trace.json`` in
the driver's environment; workers inherit the variable) and write it with ``dump()``
(also done at exit). What is recorded:

- every group call, on the driver: an async slice ``group.method`` from dispatch until
  every called rank finished (args: ranks, bytes of arguments), and a ``wait ...`` slice
  while the driver blocks on its results;
- every call inside each worker (method, bytes of arguments and result), with every
  ``worker_timer`` span (weight-sync phases included) nested inside it;
- anything reported through ``span(name, **args)`` / ``record_event(name, start, end)``
  (channel put/get, user phases on the driver).

Tracks: the driver is one process; each group is a process with one thread per rank
(``tid = rank * 100 + lane``; lane 0 runs the calls, other lanes are other threads of
the worker such as weight transfers). Times are wall-clock: each process records
``time.perf_counter()`` and converts with its own wall-clock anchor; workers on another
node than the driver are also corrected by a measured clock offset.

Off, the hot paths pay one module-attribute check (``trace.ON``). Workers buffer events
(up to ``MAX_EVENTS``) and the driver collects them at ``dump()``, at ``disable()`` and
when a group shuts down.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from phalanx._base.timing import TimerRecorder


class GroupLike(Protocol):
    """What tracing reads of a worker group (its public API; groups sit in a higher layer)."""

    name: str

    @property
    def actors(self) -> list[Any]: ...


class HandleLike(Protocol):
    """What tracing reads of a call's handle."""

    group: GroupLike
    method: str
    ranks: list[int]
    refs: list[Any]


ENV_VAR = "PHALANX_TRACE"
MAX_EVENTS = 1_000_000  # per process; later events are counted as dropped
DRIVER_PID = 1

# The one flag every hot path checks. Read it as ``trace.ON`` (module attribute).
ON = False

_NULL = nullcontext()


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.path: str | None = None
        # Raw local events: (ph, name, cat, start_perf, end_perf, lane, args).
        self.events: list[tuple] = []
        self.dropped = 0
        self.anchor = time.time() - time.perf_counter()
        self.lanes: dict[int, int] = {}
        self.lane_names: dict[int, str] = {}
        # Worker identity (None on the driver).
        self.group: str | None = None
        self.rank = 0
        self.timers: TimerRecorder | None = None
        # Driver side.
        self.groups: weakref.WeakSet[GroupLike] = weakref.WeakSet()
        self.collected: list[dict[str, Any]] = []
        self.calls: list[_DriverCall] = []  # in flight, watched by the poller
        self.call_ids = itertools.count(1)
        self.poller: threading.Thread | None = None
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.atexit = False
        self.dirty = False


_S = _State()


class _DriverCall:
    __slots__ = ("id", "name", "start", "refs", "gens", "ranks", "arg_bytes")

    def __init__(self, name: str, start: float, refs: list[Any], ranks: list[int], nbytes: int):
        import ray

        self.id = next(_S.call_ids)
        self.name = name
        self.start = start
        self.refs = [r for r in refs if isinstance(r, ray.ObjectRef)]
        self.gens = [r for r in refs if not isinstance(r, ray.ObjectRef)]
        self.ranks = ranks
        self.arg_bytes = nbytes


# ----------------------------------------------------------------------------- public API


def enabled() -> bool:
    """True while tracing is on in this process."""
    return ON


def enable(path: str | os.PathLike[str] | None = None) -> str:
    """Start tracing (driver): this process, running groups, and workers started later.

    ``path`` is where ``dump()`` writes; default ``$PHALANX_TRACE``. Returns the path.
    """
    global ON
    if path is None:
        path = os.environ.get(ENV_VAR)
        if not path:
            raise ValueError(f"path: give a file path or set {ENV_VAR}")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"path must be a file path, got {path!r}")
    if _S.group is not None:
        raise RuntimeError("trace.enable() is for the driver; workers follow the driver")
    _S.path = str(path)
    os.environ[ENV_VAR] = _S.path  # groups launched later inherit it (PHALANX_ prefix)
    if ON:
        return _S.path
    ON = True
    _S.stop.clear()
    _lane()  # the enabling thread is the driver's main lane
    _S.poller = threading.Thread(target=_poll, name="phalanx-trace", daemon=True)
    _S.poller.start()
    for group in list(_S.groups):
        _worker_control(group, "enable")
    if not _S.atexit:
        _S.atexit = True
        atexit.register(_dump_at_exit)
    return _S.path


def disable() -> None:
    """Stop tracing; workers' buffered events are collected first (``dump()`` still works)."""
    global ON
    if not ON:
        return
    for group in list(_S.groups):
        collect_group(group)
        _worker_control(group, "disable")
    ON = False
    _S.stop.set()
    _S.wake.set()
    if _S.poller is not None:
        _S.poller.join(timeout=5)
        _S.poller = None
    _finish_calls(time.perf_counter(), unfinished=True)
    os.environ.pop(ENV_VAR, None)


def dump(path: str | os.PathLike[str] | None = None) -> str:
    """Collect the workers' events and write every event so far as Chrome trace JSON."""
    out = str(path) if path is not None else _S.path
    if not out:
        raise ValueError("path: tracing was never enabled and no path was given")
    if ON:
        for group in list(_S.groups):
            collect_group(group)
    doc = chrome_trace()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, out)
    _S.dirty = False
    return out


def reset() -> None:
    """Forget every recorded event (tracing stays as it is)."""
    with _S.lock:
        _S.events.clear()
        _S.collected.clear()
        _S.dropped = 0


def span(name: str, cat: str = "user", **args: Any) -> Any:
    """``with trace.span("rollout", step=3): ...`` records the block; a no-op when off."""
    if not ON:
        return _NULL
    return _span(name, cat, args)


def record_event(name: str, start: float, end: float, *, cat: str = "user", **args: Any) -> None:
    """Record a finished span; ``start``/``end`` are ``time.perf_counter()`` seconds."""
    if not ON:
        return
    _append(("X", name, cat, start, end, _lane(), args or None))


def instant(name: str, *, cat: str = "user", **args: Any) -> None:
    """Record a point in time (e.g. "restart rank 2")."""
    if not ON:
        return
    now = time.perf_counter()
    _append(("i", name, cat, now, now, _lane(), args or None))


# ----------------------------------------------------------------------------- hooks (driver)


def register_group(group: GroupLike) -> None:
    """Called by a group after launch: its workers' events are collected at dump time."""
    _S.groups.add(group)
    if not ON and _S.group is None and os.environ.get(ENV_VAR):
        enable(os.environ[ENV_VAR])


def driver_call(
    group: GroupLike,
    method: str,
    calls: list[tuple[int, tuple, dict]],
    handle: HandleLike,
    start: float,
) -> None:
    """The driver dispatched ``method`` to the ranks in ``calls`` (tracing is on)."""
    nbytes = sum(_nbytes(args) + _nbytes(kwargs) for _, args, kwargs in calls)
    call = _DriverCall(f"{group.name}.{method}", start, list(handle.refs), handle.ranks, nbytes)
    with _S.lock:
        _S.calls.append(call)
    _S.wake.set()


@contextmanager
def traced_wait(handle: HandleLike) -> Iterator[None]:
    """The driver blocks on a handle's results."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        args = {"ranks": len(handle.ranks)}
        _append(
            (
                "X",
                f"wait {handle.group.name}.{handle.method}",
                "wait",
                t0,
                time.perf_counter(),
                _lane(),
                args,
            )
        )


def collect_group(group: GroupLike) -> None:
    """Fetch and clear the buffered events of every live worker of ``group``."""
    import ray

    actors = list(group.actors)
    if not actors:
        return
    refs = []
    for rank, actor in enumerate(actors):
        try:
            refs.append((rank, actor._px_trace.remote("collect")))
        except Exception:  # noqa: BLE001 - a dead actor cannot be asked
            continue
    driver_node = _node_id()
    for rank, ref in refs:
        try:
            payload = ray.get(ref, timeout=30)
        except Exception:  # noqa: BLE001 - dead or stuck worker: its events are lost
            continue
        payload["group"] = group.name
        payload["rank"] = rank
        payload["offset"] = 0.0
        if payload.get("node") and driver_node and payload["node"] != driver_node:
            payload["offset"] = _clock_offset(actors[rank])
        with _S.lock:
            _S.collected.append(payload)


# ----------------------------------------------------------------------------- hooks (worker)


def init_worker(group: str, rank: int, timers: TimerRecorder) -> None:
    """Called by the worker host at start: trace when the driver asked for it."""
    _S.group, _S.rank, _S.timers = group, rank, timers
    if os.environ.get(ENV_VAR):
        worker_op("enable")


def worker_op(op: str, *args: Any) -> Any:
    """Control from the driver (runs in the host's control concurrency group)."""
    global ON
    if op == "enable":
        ON = True
        if _S.timers is not None and _timer_listener not in _S.timers.listeners:
            _S.timers.listeners.append(_timer_listener)
        return True
    if op == "disable":
        ON = False
        if _S.timers is not None and _timer_listener in _S.timers.listeners:
            _S.timers.listeners.remove(_timer_listener)
        return True
    if op == "collect":
        with _S.lock:
            events, _S.events = _S.events, []
            dropped, _S.dropped = _S.dropped, 0
        return {
            "events": events,
            "anchor": _S.anchor,
            "lane_names": dict(_S.lane_names),
            "pid": os.getpid(),
            "node": _node_id(),
            "dropped": dropped,
        }
    if op == "clock":
        return time.time()
    raise ValueError(f"op: unknown trace operation {op!r}")


def call_begin() -> float:
    """A call starts on this worker thread (tracing is on): its thread is lane 0."""
    ident = threading.get_ident()
    if _S.lanes.get(ident) != 0:
        _S.lanes[ident] = 0
        _S.lane_names.setdefault(0, "calls")
    return time.perf_counter()


def worker_call(method: str, start: float, args: tuple, kwargs: dict, result: Any) -> None:
    """A call ran on this worker from ``start`` until now (tracing is on)."""
    end = time.perf_counter()
    info = {"arg_bytes": _nbytes(args) + _nbytes(kwargs), "result_bytes": _nbytes(result)}
    _append(("X", method, "call", start, end, 0, info))


def _timer_listener(tag: str, start: float, end: float, depth: int) -> None:
    _append(("X", tag, "timer", start, end, _lane(), None))


# ----------------------------------------------------------------------------- output


def chrome_trace() -> dict[str, Any]:
    """Every event recorded so far (driver and collected workers) as a Chrome trace dict."""
    with _S.lock:
        local = list(_S.events)
        collected = list(_S.collected)
        dropped = _S.dropped + sum(p.get("dropped", 0) for p in collected)
        in_flight = list(_S.calls)
    now = time.perf_counter()
    sources: list[tuple[int, int, float, list[tuple], dict[int, str]]] = []
    sources.append((DRIVER_PID, 0, _S.anchor, local, _driver_lane_names()))
    group_pids: dict[str, int] = {}
    for p in collected:
        pid = group_pids.setdefault(p["group"], DRIVER_PID + 1 + len(group_pids))
        lanes = dict(p["lane_names"])
        lanes[0] = f"pid {p['pid']}"
        sources.append((pid, p["rank"], p["anchor"] - p["offset"], p["events"], lanes))
    starts = [e[3] + anchor for _, _, anchor, evs, _ in sources for e in evs]
    starts += [c.start + _S.anchor for c in in_flight]
    origin = min(starts) if starts else time.time()

    def us(t: float, anchor: float) -> float:
        return round((t + anchor - origin) * 1e6, 3)

    out: list[dict[str, Any]] = []
    out.append(_meta("process_name", DRIVER_PID, 0, name="driver"))
    out.append(_meta("process_sort_index", DRIVER_PID, 0, sort_index=0))
    for name, pid in group_pids.items():
        out.append(_meta("process_name", pid, 0, name=f"group {name}"))
        out.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    threads: set[tuple[int, int]] = set()
    for pid, rank, anchor, events, lane_names in sources:
        for ph, name, cat, t0, t1, lane, args in events:
            args = dict(args) if args else None
            tid = rank * 100 + lane
            ev: dict[str, Any] = {"name": name, "cat": cat, "ph": ph, "pid": pid, "tid": tid}
            ev["ts"] = us(t0, anchor)
            if ph == "X":
                ev["dur"] = round(max(0.0, t1 - t0) * 1e6, 3)
            elif ph == "i":
                ev["s"] = "t"
            elif ph in ("b", "e"):
                ev["id"] = args.pop("id")
                if ph == "e":
                    ev["ts"] = us(t1, anchor)
            if args:
                ev["args"] = args
            out.append(ev)
            if (pid, tid) not in threads:
                threads.add((pid, tid))
                label = "main" if pid == DRIVER_PID and lane == 0 else lane_names.get(lane, "")
                thread = f"rank {rank}" if pid != DRIVER_PID else "driver"
                thread = f"{thread} · {label}" if label else f"{thread} · lane {lane}"
                out.append(_meta("thread_name", pid, tid, name=thread))
                out.append(_meta("thread_sort_index", pid, tid, sort_index=tid))
    for c in in_flight:  # still running at dump time
        args = {"ranks": c.ranks, "arg_bytes": c.arg_bytes, "unfinished": True}
        out.append(_async("b", c, us(c.start, _S.anchor), args))
        out.append(_async("e", c, us(now, _S.anchor), None))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"phalanx": "trace", "origin_unix_s": origin, "dropped_events": dropped},
    }


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of a trace file written by ``dump`` (for reports and tests)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return events


# ----------------------------------------------------------------------------- internals


class _span:
    __slots__ = ("name", "cat", "args", "t0")

    def __init__(self, name: str, cat: str, args: dict[str, Any]):
        self.name, self.cat, self.args = name, cat, args or None

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        _append(("X", self.name, self.cat, self.t0, time.perf_counter(), _lane(), self.args))


def _append(event: tuple) -> None:
    if len(_S.events) >= MAX_EVENTS:
        _S.dropped += 1
        return
    _S.events.append(event)  # list.append is atomic under the GIL
    _S.dirty = True


def _lane() -> int:
    ident = threading.get_ident()
    lane = _S.lanes.get(ident)
    if lane is None:
        with _S.lock:
            lane = _S.lanes.get(ident)
            if lane is None:
                thread = threading.current_thread()
                if thread.name == "phalanx-loop":  # async methods: part of the call lane
                    lane = 0
                else:
                    lane = 1 + sum(1 for v in _S.lanes.values() if v > 0)
                    if _S.group is None and not any(v == 0 for v in _S.lanes.values()):
                        lane = 0  # the driver's first tracing thread is its main lane
                    _S.lane_names.setdefault(lane, thread.name)
                _S.lanes[ident] = lane
    return lane


def _driver_lane_names() -> dict[int, str]:
    return dict(_S.lane_names)


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _async(ph: str, call: _DriverCall, ts: float, args: dict[str, Any] | None) -> dict[str, Any]:
    ev = {
        "name": call.name,
        "cat": "group_call",
        "ph": ph,
        "id": call.id,
        "pid": DRIVER_PID,
        "tid": 0,
        "ts": ts,
    }
    if args:
        ev["args"] = args
    return ev


def _finish_calls(
    now: float, done: list[_DriverCall] | None = None, unfinished: bool = False
) -> None:
    with _S.lock:
        if done is None:
            done, _S.calls = _S.calls, []
        for c in done:
            args = {"ranks": c.ranks, "arg_bytes": c.arg_bytes, "id": c.id}
            if unfinished:
                args["unfinished"] = True
            _S.events.append(("b", c.name, "group_call", c.start, c.start, 0, args))
            _S.events.append(("e", c.name, "group_call", now, now, 0, {"id": c.id}))
        _S.dirty = True


def _poll() -> None:
    """Driver thread: marks each traced group call finished when its last rank returned."""
    import ray

    while not _S.stop.is_set():
        with _S.lock:
            calls = list(_S.calls)
        if not calls:
            _S.wake.wait(0.2)
            _S.wake.clear()
            continue
        refs = [r for c in calls for r in c.refs]
        if refs:
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.005, fetch_local=False)
                if ready:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            except Exception:  # noqa: BLE001 - Ray shut down under us
                return
            ready_set = set(ready)
        else:
            ready_set = set()
            time.sleep(0.005)
        now = time.perf_counter()
        done = []
        for c in calls:
            if ready_set:
                c.refs = [r for r in c.refs if r not in ready_set]
            if not c.refs and all(_gen_finished(g) for g in c.gens):
                done.append(c)
        if done:
            with _S.lock:
                ids = {id(c) for c in done}
                _S.calls = [c for c in _S.calls if id(c) not in ids]
            _finish_calls(now, done)


def _gen_finished(gen: Any) -> bool:
    try:
        return bool(gen.is_finished())
    except Exception:  # noqa: BLE001
        return True


def _worker_control(group: GroupLike, op: str) -> None:
    import ray

    refs = []
    for actor in list(group.actors):
        try:
            refs.append(actor._px_trace.remote(op))
        except Exception:  # noqa: BLE001
            continue
    for ref in refs:
        try:
            ray.get(ref, timeout=30)
        except Exception:  # noqa: BLE001 - a dead worker has nothing to trace
            continue


def _clock_offset(actor: Any, samples: int = 5) -> float:
    """Worker clock minus driver clock (s), from the round trip with the least delay."""
    import ray

    best = (float("inf"), 0.0)
    for _ in range(samples):
        t0 = time.time()
        try:
            tw = ray.get(actor._px_trace.remote("clock"), timeout=10)
        except Exception:  # noqa: BLE001
            break
        t1 = time.time()
        best = min(best, (t1 - t0, tw - (t0 + t1) / 2))
    return best[1]


def _node_id() -> str | None:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        pass
    return None


def _nbytes(value: Any, budget: int = 256) -> int:
    """Bytes of the data in a value where known (arrays, tensors, bytes, strings, containers)."""
    stack = [value]
    total = 0
    seen = 0
    while stack and seen < budget:
        v = stack.pop()
        seen += 1
        if v is None or isinstance(v, (bool, int, float)):
            continue
        if isinstance(v, (bytes, bytearray, memoryview, str)):
            total += len(v)
        elif hasattr(v, "nbytes") and isinstance(getattr(v, "nbytes", None), int):
            total += v.nbytes  # numpy arrays, torch tensors (>= 2.1)
        elif hasattr(v, "element_size") and hasattr(v, "numel"):
            total += int(v.element_size()) * int(v.numel())
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
    return total


def _dump_at_exit() -> None:
    if _S.path and (_S.dirty or _S.calls or _S.groups):
        try:
            dump()
        except Exception:  # noqa: BLE001 - never fail interpreter exit
            pass
