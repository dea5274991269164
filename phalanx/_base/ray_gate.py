"""Phalanx's background threads that call Ray, and a ``ray.shutdown`` that waits for them.

``ray.shutdown()`` destroys the core worker while other threads of the process may be
inside a Ray call (``ray.wait``, freeing an object ref); that crashes the process now and
then (SIGSEGV, "double free or corruption"). So every phalanx background thread makes its
Ray calls inside ``ray_calls()`` and registers how to stop (``on_shutdown``). Once
``install()`` ran (phalanx's threads call it), ``ray.shutdown`` and the interpreter's exit
first stop those threads: the stop hooks run while Ray is still up (they let their refs
go), then shutdown waits until no thread is inside a gated Ray call (at most
``DRAIN_TIMEOUT_S``); gated calls are refused from then until shutdown returns.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ray

logger = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 5.0  # gated calls are short (at most a second): this only guards a bug

_cv = threading.Condition()
_inside = 0
_closed = False
_hooks: list[Callable[[], None]] = []
_installed = False


@contextmanager
def ray_calls() -> Iterator[bool]:
    """Yield True while Ray may be called from this thread, False when it is shutting down
    or down (then make no Ray call and drop no object ref)."""
    global _inside
    with _cv:
        ok = not _closed and ray.is_initialized()
        if ok:
            _inside += 1
    try:
        yield ok
    finally:
        if ok:
            with _cv:
                _inside -= 1
                _cv.notify_all()


def on_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook`` (once) when Ray is about to shut down, while it still runs."""
    with _cv:
        if hook not in _hooks:
            _hooks.append(hook)


def drain(timeout: float = DRAIN_TIMEOUT_S) -> bool:
    """Refuse new gated calls, run the stop hooks, wait until no gated call runs.

    Returns whether they all finished in time. ``reopen()`` allows calls again.
    """
    global _closed
    with _cv:
        _closed = True
        hooks, _hooks[:] = list(_hooks), []
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - one bad hook must not block Ray's shutdown
            logger.exception("phalanx: a shutdown hook failed")
    deadline = time.monotonic() + timeout
    with _cv:
        while _inside:
            left = deadline - time.monotonic()
            if left <= 0:
                logger.warning("phalanx: %d Ray call(s) still running at ray.shutdown", _inside)
                return False
            _cv.wait(left)
    return True


def reopen() -> None:
    """Allow gated Ray calls again (after a shutdown, for the next ``ray.init``)."""
    global _closed
    with _cv:
        _closed = False


def install() -> None:
    """Make ``ray.shutdown`` (and the interpreter's exit) drain phalanx's threads first."""
    global _installed
    with _cv:
        if _installed:
            return
        _installed = True
    original = ray.shutdown

    @functools.wraps(original)
    def shutdown(*args: Any, **kwargs: Any) -> Any:
        drain()
        try:
            return original(*args, **kwargs)
        finally:
            reopen()

    ray.shutdown = shutdown
    # atexit runs handlers last-registered first: this runs before Ray's own exit hook.
    atexit.register(drain)
