"""What one rank's call produced: a value or a phalanx error, and RLlib's result containers.

``unwrap_error`` turns Ray's wrappers into errors naming group, rank and method: an
exception raised by the worker's code becomes a :class:`~phalanx.WorkerError`, a dead
process a :class:`~phalanx.WorkerDiedError`. ``RemoteCallResults`` is the form RLlib's
``FaultTolerantActorManager`` returns (``.ok``, ``.get()``, ``.actor_id``, errors included);
the plain-values form is built from it by the collect path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from phalanx._base.errors import WorkerDiedError, WorkerError


def unwrap_error(group: str, method: str, rank: int, err: BaseException) -> BaseException:
    """Ray's ``RayTaskError``/``RayActorError`` as a phalanx error naming group, rank, method."""
    if isinstance(err, RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, WorkerError):
            return cause
        if isinstance(cause, RayActorError):
            err = cause
        else:
            return WorkerError(
                group,
                rank,
                method,
                str(err),
                type(cause).__name__ if cause else "RayTaskError",
                str(cause),
            )
    if isinstance(err, RayActorError):
        return WorkerDiedError(group, rank, method, "", type(err).__name__, first_line(err))
    return err


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def is_death(err: BaseException) -> bool:
    """The error says the worker's process is gone (not that its code raised)."""
    return isinstance(err, (WorkerDiedError, RayActorError))


class ResultOrError:
    """One call's result, or the error it raised (RLlib's ``ResultOrError``)."""

    __slots__ = ("_result", "_error")

    def __init__(self, result: Any = None, error: BaseException | None = None):
        self._result = result
        self._error = error

    @property
    def ok(self) -> bool:
        return self._error is None

    def get(self) -> Any:
        """The result, or the error (returned, not raised, as RLlib does)."""
        return self._result if self._error is None else self._error

    def __repr__(self) -> str:
        return f"ResultOrError({'ok' if self.ok else 'error'}: {self.get()!r})"


@dataclass
class CallResult:
    """The outcome of one call on one worker: ``actor_id`` is the rank."""

    actor_id: int
    result_or_error: ResultOrError

    @property
    def ok(self) -> bool:
        return self.result_or_error.ok

    def get(self) -> Any:
        return self.result_or_error.get()


class RemoteCallResults:
    """The outcomes of one call on several workers, in the order they were collected.

    Iterating yields :class:`CallResult` objects; ``ignore_errors()`` skips failed calls,
    ``ignore_ray_errors()`` skips only calls whose worker died.
    """

    def __init__(self, results: list[CallResult] | None = None):
        self.result_or_errors: list[CallResult] = list(results or [])

    def add_result(self, actor_id: int, result_or_error: ResultOrError) -> None:
        self.result_or_errors.append(CallResult(actor_id, result_or_error))

    def __iter__(self) -> Iterator[CallResult]:
        return iter(list(self.result_or_errors))

    def __len__(self) -> int:
        return len(self.result_or_errors)

    def ignore_errors(self) -> Iterator[CallResult]:
        return iter([r for r in self.result_or_errors if r.ok])

    def ignore_ray_errors(self) -> Iterator[CallResult]:
        return iter(
            [r for r in self.result_or_errors if r.ok or not is_death(r.result_or_error.get())]
        )

    @property
    def errors(self) -> list[CallResult]:
        return [r for r in self.result_or_errors if not r.ok]

    def __repr__(self) -> str:
        ok = sum(1 for r in self.result_or_errors if r.ok)
        return f"RemoteCallResults({ok} ok, {len(self) - ok} errors)"


__all__ = ["CallResult", "RemoteCallResults", "ResultOrError", "unwrap_error"]
