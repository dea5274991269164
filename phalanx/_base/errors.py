"""Errors raised by phalanx groups: each names the group, rank and method it came from."""

from __future__ import annotations

from ray.exceptions import RayError


class WorkerError(RuntimeError, RayError):
    """A worker method raised; carries the group, rank, method and the remote traceback.

    Also a ``ray.exceptions.RayError``, so code written for Ray/RLlib that catches Ray's
    errors from remote calls catches it too.

    Args:
        group: the group's name.
        rank: the worker's rank.
        method: the method that raised.
        remote_traceback: the worker's traceback.
        cause_type: the name of the exception's type.
        message: the exception's message.
    """

    def __init__(
        self,
        group: str,
        rank: int,
        method: str,
        remote_traceback: str = "",
        cause_type: str = "",
        message: str = "",
    ):
        self.group = group
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.cause_type = cause_type
        self.message = message
        text = f"{group}[rank {rank}].{method}() failed"
        if cause_type:
            text += f" with {cause_type}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback (group {group}, rank {rank}) ---\n{remote_traceback}"
        super().__init__(text)

    def __reduce__(self):
        return (
            type(self),
            (
                self.group,
                self.rank,
                self.method,
                self.remote_traceback,
                self.cause_type,
                self.message,
            ),
        )


class WorkerDiedError(WorkerError):
    """The worker's process died (crash, kill, OOM) while or before running a method."""


class GroupTimeoutError(TimeoutError):
    """A group call did not finish in time; names the ranks that did not finish.

    Args:
        group: the group's name.
        method: the method's name.
        pending_ranks: the ranks still running.
        timeout: the seconds waited.
        report: a hang report's text.
    """

    def __init__(
        self, group: str, method: str, pending_ranks: list[int], timeout: float, report: str = ""
    ):
        self.group = group
        self.method = method
        self.pending_ranks = list(pending_ranks)
        self.timeout = timeout
        self.report = report
        text = f"{group}.{method}() did not finish within {timeout}s on ranks {self.pending_ranks}"
        if report:
            text += f"\n{report}"
        super().__init__(text)

    def __reduce__(self):
        return (
            type(self),
            (self.group, self.method, self.pending_ranks, self.timeout, self.report),
        )
