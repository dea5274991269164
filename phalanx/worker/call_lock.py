"""The call lock: weights are applied only between a worker's method calls.

Every user call on a worker host holds the read side of its worker's lock for its whole
duration; applying a new weight version takes the write side. Concurrent calls stay
concurrent, an apply waits for the calls in flight to end, and calls that arrive
meanwhile wait for the apply (the writer is preferred, so a busy worker cannot starve
it). It lives in the worker layer because the host takes it on every call; the weights
layer takes its write side through ``call_lock(worker)``. Torch-free on purpose.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class ReadWriteLock:
    """Shared (read) / exclusive (write) lock with writer preference.

    The read side is re-entrant per thread (a user method that calls back into the host
    on the same thread does not deadlock); the write side is not re-entrant.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers: dict[int, int] = {}
        self._writer: int | None = None
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._readers.get(me, 0) == 0:
                while self._writer is not None or self._writers_waiting:
                    if self._writer == me:
                        break  # a writer thread may read what it holds
                    self._cond.wait()
            self._readers[me] = self._readers.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                n = self._readers[me] - 1
                if n:
                    self._readers[me] = n
                else:
                    del self._readers[me]
                    self._cond.notify_all()

    @contextmanager
    def write(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the exclusive side; ``TimeoutError`` if calls keep it busy past ``timeout``."""
        me = threading.get_ident()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer is not None or any(t != me for t in self._readers):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"weights could not be applied within {timeout}s: the worker "
                            "stayed busy in a method call"
                        )
                    self._cond.wait(left)
                self._writer = me
            finally:
                self._writers_waiting -= 1
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """True while some call holds the read side."""
        with self._cond:
            return bool(self._readers)


_create_lock = threading.Lock()
_ATTR = "_px_call_lock"


def call_lock(worker: Any) -> ReadWriteLock:
    """The lock guarding ``worker``'s model between calls (created on first use)."""
    lock = worker.__dict__.get(_ATTR)
    if lock is None:
        with _create_lock:
            lock = worker.__dict__.setdefault(_ATTR, ReadWriteLock())
    return lock


def holds_call_lock(get_worker: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    """Decorate a host entry point so the user's code runs under the worker's read lock.

    ``get_worker(host)`` returns the hosted worker. Generator entry points keep the lock
    until the stream ends, so weights are never applied in the middle of a method call.
    """

    def decorate(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def gen_wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                with call_lock(get_worker(self)).read():
                    yield from fn(self, *args, **kwargs)

            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            with call_lock(get_worker(self)).read():
                return fn(self, *args, **kwargs)

        return wrapper

    return decorate
