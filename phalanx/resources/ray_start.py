"""Start Ray, retrying its start-up on a busy machine.

Ray gives its GCS and raylet a fixed time to come up (30 s for the raylet to register);
on a small machine under load ``ray.init()`` then fails although nothing is wrong. Every
phalanx start of Ray (``Cluster()``, the algorithms, ``demo``, the test fixture) goes
through :func:`init_ray`, which retries those start-up failures, and only those, with
backoff for at most ``PHALANX_RAY_START_TIMEOUT_S`` seconds, printing one line per retry.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ray

from phalanx._base.checks import check_int

T = TypeVar("T")

NAMESPACE = "phalanx"
# Logical CPU slots of an embedded Ray. Workers are mostly waiting on each other, so the
# default lets a 2-core machine host the usual handful of workers; pass num_cpus to change.
DEFAULT_EMBEDDED_CPUS = 16
START_TIMEOUT_ENV = "PHALANX_RAY_START_TIMEOUT_S"
DEFAULT_START_TIMEOUT_S = 300.0
MAX_RETRY_DELAY_S = 15.0
# What Ray says when its GCS or raylet did not come up in time (ray/_private/node.py).
_START_FAILURES = (
    "timed out during startup",
    "Timed out waiting for file",
    "Failed to start GCS",
    "Failed to register worker",
)


class RayStartError(RuntimeError):
    """Ray did not start within ``PHALANX_RAY_START_TIMEOUT_S``; the message names the
    last cause and the setting."""


def start_timeout_s() -> float:
    """The start-up budget in seconds: ``PHALANX_RAY_START_TIMEOUT_S`` or 300."""
    raw = os.environ.get(START_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_START_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{START_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"{START_TIMEOUT_ENV} must be >= 0, got {raw!r}")
    return value


def is_start_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's GCS/raylet not coming up in time (worth another try)."""
    text = str(exc)
    return any(marker in text for marker in _START_FAILURES)


def retry_start(start: Callable[[], T], timeout_s: float | None = None) -> T:
    """``start()``, tried again after each Ray start-up failure until ``timeout_s``
    (default :func:`start_timeout_s`) has passed; no new try begins after that.

    Between tries the loop waits 1, 2, 4, ... s (at most 15 s). Other exceptions (bad arguments) propagate at
    once. Raises :class:`RayStartError` when the time is spent.
    """
    timeout = start_timeout_s() if timeout_s is None else float(timeout_s)
    deadline = time.monotonic() + timeout
    delay = 1.0
    attempt = 0
    while True:
        attempt += 1
        try:
            return start()
        except Exception as e:
            if not is_start_failure(e):
                raise
            cause = str(e).strip().splitlines()[0]
            left = deadline - time.monotonic()
            if left <= 0:
                raise RayStartError(
                    f"Ray did not start in {attempt} tries within {timeout:g} s "
                    f"({START_TIMEOUT_ENV}={timeout:g}); last cause: {cause} "
                    f"(a busy machine: raise {START_TIMEOUT_ENV})"
                ) from e
            wait = min(delay, left)
            print(
                f"phalanx: Ray start try {attempt} failed: {cause}; retrying in {wait:.1f} s "
                f"({left:.0f} s left of {START_TIMEOUT_ENV}={timeout:g})",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(wait)
            delay = min(2 * delay, MAX_RETRY_DELAY_S)


def init_ray(**ray_init_kwargs: Any) -> Any:
    """``ray.init(**ray_init_kwargs)`` with start-up failures retried (:func:`retry_start`);
    returns what ``ray.init`` returns."""

    def start() -> Any:
        try:
            with _keep_signal_handlers():
                return ray.init(**ray_init_kwargs)
        except Exception:
            ray.shutdown()  # a failed start may leave half of Ray up in this process
            raise

    return retry_start(start)


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """The caller's SIGINT/SIGTERM handlers survive Ray's start.

    ``ray.init`` installs its own SIGTERM handler and its core worker a native one that
    aborts the process after logging; a program that handles SIGTERM itself (the
    algorithms exit 143, keeping their run folder) gets its Python handler back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if callable(handler):  # a Python handler (not SIG_DFL/SIG_IGN or a native one)
                signal.signal(s, handler)


def start_ray(logical_cpus: int | None = None) -> None:
    """An embedded local Ray for this process, unless Ray is up or ``RAY_ADDRESS`` is set.

    A fresh local Ray even when a ``ray start`` cluster runs on this machine (plain
    ``ray.init()`` would join it), with ``logical_cpus`` CPU slots (None: phalanx's
    embedded default). With ``logical_cpus`` given, Ray pre-starts one idle worker
    process per slot as soon as this driver connects, and each imports torch and
    gymnasium before it takes work, so workers find a process with their heavy imports
    done; callers therefore ask for just the slots they need plus one spare. Workers run
    at nice 0, not Ray's 15: on a small, shared machine they are this job's work; results
    up to 1 MiB return inline (sample batches skip the object store). Call it
    on the main thread: Ray's daemons die with the thread that started them.
    """
    if logical_cpus is not None:
        check_int(logical_cpus, "logical_cpus", minimum=1)
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return
    prestart = logical_cpus is not None
    init_ray(
        address="local",
        num_cpus=logical_cpus if prestart else max(DEFAULT_EMBEDDED_CPUS, os.cpu_count() or 1),
        include_dashboard=False,
        namespace=NAMESPACE,
        _system_config={
            "prestart_worker_first_driver": prestart,
            "worker_niceness": 0,
            # results up to 1 MiB come back in the call's reply, not through the object
            # store: an env runner's batch (4 HalfCheetah envs x 256 steps) is over Ray's
            # 100 KiB default, and the store's round trip costs the raylet and the caller
            # CPU time while the runners sample
            "max_direct_call_object_size": 1 << 20,
            # an idle worker process has the workers' heavy imports done, so a worker
            # restarted there skips them (benchmarks/bench_recovery.py)
            "preload_python_modules": ["torch", "gymnasium"],
        },
    )
