"""A readers-writer lock that lets weights be applied only between worker calls.

Every user call on a worker host holds the read side for its whole duration; applying a
new weight version takes the write side. Concurrent calls stay concurrent, an apply waits
for the calls in flight to end, and calls that arrive meanwhile wait for the apply (the
writer is preferred, so a busy worker cannot starve it). Torch-free on purpose: the
worker host imports it in every process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


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


def model_lock(host: object) -> ReadWriteLock:
    """The host's lock guarding its worker's model (created on first use)."""
    lock = host.__dict__.get("_px_rw")
    if lock is None:
        with _create_lock:
            lock = host.__dict__.setdefault("_px_rw", ReadWriteLock())
    return lock


def holds_model_lock(fn):  # noqa: ANN001, ANN201 - wraps host methods of any signature
    """Decorate a host entry point so the user's code runs under the model's read lock.

    Generator entry points keep the lock until the stream ends, so weights are never
    applied in the middle of a method call.
    """
    import functools
    import inspect

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            with model_lock(self).read():
                yield from fn(self, *args, **kwargs)

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        with model_lock(self).read():
            return fn(self, *args, **kwargs)

    return wrapper
