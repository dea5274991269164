"""Async work objects returned by ``async_op=True`` communication calls.

A ``Work`` wraps a ``concurrent.futures.Future`` completed by the communication
threads; waiting never polls: ``wait`` blocks on the future, ``async_wait`` awaits it
through the running event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any

from phalanx._base.checks import check_timeout


class Work:
    """Handle of one asynchronous send, receive or channel operation.

    Messages between one pair of workers complete in the order they were posted.

    Args:
        what: the operation's description, for errors.
        future: the future it completes (a new one if None).
        post: applied to the result before ``wait`` returns it.
    """

    __slots__ = ("_future", "_what", "_post")

    def __init__(
        self,
        what: str,
        future: concurrent.futures.Future | None = None,
        post: Callable[[Any], Any] | None = None,
    ):
        self._what = what
        self._future = future if future is not None else concurrent.futures.Future()
        self._post = post

    @classmethod
    def completed(cls, what: str, value: Any = None) -> Work:
        """A ``Work`` already finished with ``value``.

        Args:
            what: the operation's description, for errors.
            value: its result.

        Returns:
            The finished ``Work``.
        """
        work = cls(what)
        work._future.set_result(value)
        return work

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation finished; returns its result (the object for a receive).

        Raises ``TimeoutError`` after ``timeout`` seconds (the operation stays posted: wait
        again to get its result), or the operation's error (e.g. ``PeerDiedError``).

        Args:
            timeout: seconds to wait (no bound if None).

        Returns:
            The operation's result.

        Raises:
            TimeoutError: it did not finish within ``timeout``.
            PeerDiedError: the peer died.
        """
        timeout = check_timeout(timeout)
        try:
            value = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self._what} did not complete within {timeout}s") from None
        return self._post(value) if self._post is not None else value

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], None]) -> None:
        """Call ``fn(future)`` once the operation finished (at once if it has).

        Args:
            fn: called with the underlying future.
        """
        self._future.add_done_callback(fn)

    def done(self) -> bool:
        """True once the operation finished (successfully or not).

        Returns:
            Whether it finished.
        """
        return self._future.done()

    async def async_wait(self) -> Any:
        """Await the result without blocking the event loop.

        Returns:
            The operation's result.
        """
        value = await asyncio.wrap_future(self._future)
        return self._post(value) if self._post is not None else value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.async_wait().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Work {self._what} {state}>"
