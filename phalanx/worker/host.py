"""The Ray actor that hosts one worker object and runs every group call on it.

All faces of a group end in ``_px_call`` (or ``_px_stream`` for generators, ``_px_apply``
for functions given to ``foreach_worker``). Keeping one entry point gives one place for
error wrapping, timers, tracing and weight application between calls. Control calls
(ping, stacks) run in their own concurrency group so a stuck method cannot block them.
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib
import inspect
import io
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray

from phalanx._base.errors import WorkerError
from phalanx._base.timing import TimerRecorder
from phalanx.comm import shm
from phalanx.observe import trace as _trace
from phalanx.worker.call_lock import holds_call_lock
from phalanx.worker.context import ContextBound, WorkerContext

CONTROL_GROUP = "_px_control"
WEIGHTS_GROUP = "_px_weights"  # side calls (weight transfers) run here, beside user calls


def _worker_of(host: WorkerHost) -> Any:
    return host._obj


holds_model_lock = holds_call_lock(_worker_of)


def load_class(cls_or_fqn: Any) -> type:
    """The worker class from a class, a ``@ray.remote`` class, ``"pkg.module.Class"``, or
    a class pickled with ``ray.cloudpickle`` (bytes)."""
    if isinstance(cls_or_fqn, bytes):
        cls = ray.cloudpickle.loads(cls_or_fqn)
    elif isinstance(cls_or_fqn, str):
        module_name, _, class_name = cls_or_fqn.rpartition(".")
        if not module_name:
            raise ValueError(f"worker class must be 'module.Class', got {cls_or_fqn!r}")
        cls = getattr(importlib.import_module(module_name), class_name)
    else:
        cls = cls_or_fqn
    # A @ray.remote-decorated class: host the plain class it wraps.
    inner = getattr(cls, "__ray_actor_class__", None)
    return inner if inner is not None else cls


def method_kinds(cls: type) -> dict[str, str]:
    """Public methods of a worker class: name -> sync | async | gen | asyncgen."""
    kinds = {}
    base = cls.px_base_attributes if issubclass(cls, ContextBound) else frozenset()
    for name in dir(cls):
        if name.startswith("_") or name in base:
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if not callable(attr) or isinstance(attr, type):
            continue
        if inspect.isasyncgenfunction(attr):
            kinds[name] = "asyncgen"
        elif inspect.iscoroutinefunction(attr):
            kinds[name] = "async"
        elif inspect.isgeneratorfunction(attr):
            kinds[name] = "gen"
        else:
            kinds[name] = "sync"
    return kinds


_thread_state = threading.local()


def adopt_torch_threads() -> None:
    """Give the calling thread the process's torch thread count, once per thread.

    Calls run on Ray's threads, not on the one ``__init__`` ran on, and torch applies
    ``torch.set_num_threads`` to another thread (OpenMP and MKL keep the count per thread)
    only when that thread first runs an op through its parallel loop. Small ops never do,
    so MKL's matrix products and vector functions there used every core: two env runners
    on 2 cores spent most of their time in OpenMP spin-waits.
    """
    if getattr(_thread_state, "torch_threads", False):
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())
        _thread_state.torch_threads = True


@dataclass(slots=True)
class _Call:
    """What one call on the worker returned, for its trace record (None until it does)."""

    result: Any = None


class WorkerHost:
    """Hosts the user's worker object inside a Ray actor process."""

    def __init__(self, cls_or_fqn: Any, ctx: WorkerContext, args: tuple, kwargs: dict):
        # The environment first: the worker class is loaded (its module imported) below.
        os.environ.update(ctx.env)
        os.environ.update(ctx.rank_env())
        self._ctx = ctx
        self._timers = TimerRecorder()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        self._started_at = time.time()
        self._exiting = threading.Event()  # set when a method calls sys.exit (see _px_watch)
        shm.reap_orphans()  # segments of processes on this node that died without cleaning up
        cls = load_class(cls_or_fqn)
        self._cls = cls
        self._kinds = method_kinds(cls)
        obj = cls.__new__(cls)
        if isinstance(obj, ContextBound):
            obj._px_bind(ctx, self._timers)
        _trace.init_worker(ctx.group_name, ctx.rank, self._timers)
        try:
            obj.__init__(*args, **kwargs)
        except Exception as e:
            raise WorkerError(
                ctx.group_name,
                ctx.rank,
                "__init__",
                traceback.format_exc(),
                type(e).__name__,
                str(e),
            ) from None
        self._obj = obj

    # -- calls ------------------------------------------------------------------------
    def _px_describe(self) -> dict[str, Any]:
        gpu_ids = []
        try:
            gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        except Exception:  # noqa: BLE001
            pass
        return {
            "methods": self._kinds,
            "class": f"{self._cls.__module__}.{self._cls.__qualname__}",
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ray_gpu_ids": gpu_ids,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    @holds_model_lock
    def _px_call(self, _px_method__: str, *args: Any, **kwargs: Any) -> Any:
        # Arguments travel as top-level task arguments: Ray resolves ObjectRefs among
        # them, and a call without arguments costs one small argument (the name).
        fn = self._resolve(_px_method__)
        return self._invoke(_px_method__, lambda: fn(*args, **kwargs), args, kwargs)

    @holds_model_lock
    def _px_stream(self, _px_method__: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        method = _px_method__
        fn = self._resolve(method)
        with self._running(method, args, kwargs):
            if self._kinds.get(method) == "asyncgen":
                agen = fn(*args, **kwargs)
                while True:
                    try:
                        yield self._run_coro(agen.__anext__())
                    except StopAsyncIteration:
                        return
            else:
                # Not ``yield from``: Ray resumes the stream with ``send``, which ``yield
                # from`` hands to the method's own ``yield from`` of a plain iterator.
                for item in fn(*args, **kwargs):  # noqa: UP028
                    yield item

    @holds_model_lock
    def _px_apply(self, _px_fn__: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args, **kwargs)`` (RLlib's ``foreach_worker`` with a function)."""
        fn = _px_fn__
        name = getattr(fn, "__name__", "function")
        return self._invoke(name, lambda: fn(self._obj, *args, **kwargs), args, kwargs)

    def _invoke(self, name: str, run: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
        """Run one call (awaiting it if it is a coroutine) with error wrapping and tracing."""
        with self._running(name, args, kwargs) as call:
            out = run()
            if inspect.iscoroutine(out):
                out = self._run_coro(out)
            if inspect.isgenerator(out) or inspect.isasyncgen(out):
                if inspect.isgenerator(out):
                    out.close()
                raise TypeError(
                    f"{name}() returned a generator, which a call does not send back: make "
                    f"{name} a generator function (one that yields: its items are streamed "
                    "to the caller) or return a list"
                )
            call.result = out
            return out

    @contextmanager
    def _running(self, name: str, args: tuple, kwargs: dict) -> Iterator[_Call]:
        """The frame of every call on the worker, plain or streamed: ``_current`` names it
        (for ``phalanx status``), the thread gets torch's thread count, an exception comes
        out as a ``WorkerError`` naming the method (``sys.exit`` as itself, flagged for
        ``_px_watch``), and with tracing on the call is recorded with the result the block
        put in ``call.result``."""
        self._current = (name, time.time())
        adopt_torch_threads()
        t0 = _trace.call_begin() if _trace.ON else 0.0
        call = _Call()
        try:
            yield call
        except SystemExit:
            self._exiting.set()
            raise
        except Exception as e:
            raise self._error(name, e) from None
        finally:
            self._current = None
            if t0:
                _trace.worker_call(name, t0, args, kwargs, call.result)

    def _px_pop_durations(self) -> dict[str, float]:
        return self._timers.consume()

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def px_side_call(self, _px_fn__: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args, **kwargs)`` beside the method call in flight.

        The public way for a higher layer to reach a busy worker: it runs in its own
        concurrency group (two at a time) and does *not* hold the call lock, so it may
        move bytes while a method runs; to change what methods see it takes
        ``phalanx.worker.call_lock.call_lock(worker).write()``, which waits for the calls
        in flight to end. The weights layer receives weights this way. Exceptions
        propagate unchanged (the caller inspects their type).
        """
        return _px_fn__(self._obj, *args, **kwargs)

    # -- control (own concurrency group) ------------------------------------------------
    @ray.method(concurrency_group=CONTROL_GROUP)
    def _px_ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def _px_trace(self, op: str, *args: Any) -> Any:
        """Tracing control from the driver: enable, disable, collect, clock (phalanx.observe.trace)."""
        return _trace.worker_op(op, *args)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def _px_status(self) -> dict[str, Any]:
        """What ``phalanx status`` shows of this worker: identity and the call running now."""
        current = self._current
        return {
            "group": self._ctx.group_name,
            "rank": self._ctx.rank,
            "world_size": self._ctx.world_size,
            "class": f"{self._cls.__module__}.{self._cls.__qualname__}",
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": self._ctx.node_ip,
            "started_at": self._started_at,
            "current": None if current is None else {"method": current[0], "since": current[1]},
        }

    @ray.method(concurrency_group=CONTROL_GROUP)
    def _px_watch(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True when the worker is exiting (sys.exit in a method).

        The driver's health monitor keeps one such call open per worker: it fails the
        moment the actor dies. Returning early on exit lets the process end at once.
        """
        return self._exiting.wait(timeout_s)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def _px_stacks(self) -> str:
        """Python stacks of every thread of this process, now."""
        buf = io.StringIO()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            buf.write(f"--- thread {names.get(ident, ident)} ---\n")
            buf.write("".join(traceback.format_stack(frame)))
        return buf.getvalue()

    # -- helpers ------------------------------------------------------------------------
    def _resolve(self, method: str) -> Callable[..., Any]:
        try:
            return getattr(self._obj, method)
        except AttributeError:
            raise WorkerError(
                self._ctx.group_name,
                self._ctx.rank,
                method,
                "",
                "AttributeError",
                f"{type(self._obj).__name__} has no method {method!r}",
            ) from None

    def _error(self, method: str, e: Exception) -> WorkerError:
        if isinstance(e, WorkerError):
            return e
        return WorkerError(
            self._ctx.group_name,
            self._ctx.rank,
            method,
            traceback.format_exc(),
            type(e).__name__,
            str(e),
        )

    def _run_coro(self, coro: Any) -> Any:
        """Run a coroutine on this worker's own event loop thread (created on first use)."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="phalanx-loop", daemon=True
                ).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


# A worker that crashes hard (a segfault in a C extension) dumps every thread's traceback to
# its log; the process's own stderr, as a caller may have replaced sys.stderr (pytest does).
faulthandler.enable(file=sys.__stderr__)


def host_class_for(cls: type) -> type:
    """A ``WorkerHost`` subclass with one actor method per public method of ``cls``.

    ``actor.hello.remote()`` then costs exactly what a plain Ray actor call costs (no extra
    argument naming the method); each trampoline enters the same ``_px_call`` path.
    """
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "__qualname__": f"Host[{cls.__qualname__}]",
    }
    for name, kind in method_kinds(cls).items():
        if hasattr(WorkerHost, name):
            continue  # never shadow the host's own machinery
        namespace[name] = _trampoline(name, kind)
    return type(f"Host_{cls.__name__}", (WorkerHost,), namespace)


def _trampoline(name: str, kind: str) -> Callable[..., Any]:
    if kind in ("gen", "asyncgen"):

        def stream(self: WorkerHost, *args: Any, **kwargs: Any) -> Iterator[Any]:
            yield from self._px_stream(name, *args, **kwargs)

        stream.__name__ = name
        return stream

    def call(self: WorkerHost, *args: Any, **kwargs: Any) -> Any:
        return self._px_call(name, *args, **kwargs)

    call.__name__ = name
    return call
