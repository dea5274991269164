"""A bounded buffer of trajectory batches, each tagged with the weights version that
generated it; the trainer takes the oldest batch young enough for its step.

Age is NeMo-RL's: a batch generated with weights version ``v`` has age ``current - v``
when the policy is at version ``current``; with ``max_age_steps=1`` a batch of version 10
trains at version 10 or 11 and is dropped (and counted in ``dropped_stale``) at 12.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from phalanx._base.checks import check_int, check_timeout


class TrajectoryBuffer:
    """Batches in generation order; ``put`` blocks while ``capacity`` batches wait."""

    def __init__(self, capacity: int) -> None:
        self.capacity = check_int(capacity, "capacity", minimum=1)
        self._items: deque[tuple[int, Any]] = deque()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.dropped_stale = 0  # trajectories (rows) dropped for age, over the buffer's life

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def put(self, batch: Any, version: int) -> None:
        """Append ``batch`` (a ``BatchedDataDict``) generated with weights ``version``."""
        version = check_int(version, "version", minimum=0)
        with self._cv:
            self._cv.wait_for(lambda: len(self._items) < self.capacity or self._done())
            self._raise_if_done()
            self._items.append((version, batch))
            self._cv.notify_all()

    def take(
        self, current_version: int, max_age_steps: int, timeout: float | None = None
    ) -> tuple[Any, int]:
        """The oldest batch whose age at ``current_version`` is at most ``max_age_steps``,
        and its version; older batches are dropped first. Waits for one (``TimeoutError``
        after ``timeout`` s); raises the collector's error once it failed."""
        current_version = check_int(current_version, "current_version", minimum=0)
        max_age_steps = check_int(max_age_steps, "max_age_steps", minimum=0)
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                while self._items and current_version - self._items[0][0] > max_age_steps:
                    _, stale = self._items.popleft()
                    self.dropped_stale += stale.size
                    self._cv.notify_all()
                if self._items:
                    version, batch = self._items.popleft()
                    self._cv.notify_all()
                    return batch, version
                self._raise_if_done()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"no trajectory batch for weights version {current_version} arrived "
                        f"within {timeout} s"
                    )
                self._cv.wait(left)

    def fail(self, error: BaseException) -> None:
        """Make every waiting and later ``put``/``take`` raise ``error``."""
        with self._cv:
            self._error = self._error or error
            self._cv.notify_all()

    def close(self) -> None:
        """Wake every waiter; later calls raise ``RuntimeError``."""
        with self._cv:
            self._closed = True
            self._items.clear()
            self._cv.notify_all()

    def _done(self) -> bool:
        return self._error is not None or self._closed

    def _raise_if_done(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the trajectory buffer is closed")
