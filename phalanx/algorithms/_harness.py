"""What ``phalanx train ppo`` and ``phalanx train grpo`` share around their algorithm.

Flags come from the algorithm's config dataclass (tyro; a field's docstring is its help,
``alias("--lr")`` adds a spelling); a ``--config`` YAML file sets any field (aliases work
there too, an unknown key names itself) and flags win over it; ``--resume`` takes the
defaults from the run's checkpoint. :func:`run_command` runs the algorithm and turns what
happened into one exit status (:data:`EXIT_CODES`), one line on stderr, and a
``status.json`` in the run folder; a run that fails before it writes anything leaves no
folder behind. SIGINT and SIGTERM stop a run: the algorithm's ``finally`` blocks stop
its workers, the run folder keeps its last checkpoint and metrics.
"""

from __future__ import annotations

import argparse
import builtins
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import tyro

C = TypeVar("C")
R = TypeVar("R")

DONE = 0
BAD_INPUT = 1
USAGE = 2
BUDGET_SPENT = 3
RUNTIME_FAILURE = 4
SIGINT_EXIT = 128 + signal.SIGINT  # 130
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143

EXIT_CODES: dict[int, str] = {
    DONE: "done (the budget was used, or the stop criterion was reached)",
    BAD_INPUT: "bad input: a config error or a missing file; nothing was started",
    USAGE: "usage error: an unknown flag or a flag value of the wrong type",
    BUDGET_SPENT: "the budget was spent before the stop criterion (--stop-return) was met",
    RUNTIME_FAILURE: (
        "runtime failure: Ray could not start, a worker group failed (GRPO: a policy rank "
        "died once more after --max-restarts relaunches), or the run folder could not be "
        "written (a full disk: the error names the file and ENOSPC)"
    ),
    SIGINT_EXIT: "interrupted by SIGINT (Ctrl-C)",
    SIGTERM_EXIT: "terminated by SIGTERM",
}
STATUS_FILE = "status.json"
TRACE_FILE = "trace.json"


def exit_codes_help() -> str:
    """The exit statuses, one per line, for a command's ``--help``."""
    return "Exit status: " + "; ".join(f"{code} {text}" for code, text in EXIT_CODES.items())


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (its name is the message)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


def in_background(name: str, fn: Callable[..., R], *args: Any) -> concurrent.futures.Future[R]:
    """Run ``fn(*args)`` on a daemon thread named ``name``; its future.

    Not a thread pool's thread: the interpreter joins those at exit, so an interrupted
    run would wait for start-up work that may never finish (a thread left inside an
    import that the interrupt broke); a daemon thread is left behind at exit.
    """
    fut: concurrent.futures.Future[R] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


# SIGINT/SIGTERM received during run_command. The handler's exception is lost when the
# signal lands in a finalizer or weakref callback (Python prints "Exception ignored"),
# e.g. the import system's, which can also leave the import lock held by the main thread;
# waits in the main thread read this list so that such a signal still stops the run.
_signalled: list[int] = []


def result_of(fut: concurrent.futures.Future[R]) -> R:
    """``fut.result()``, waited for in short slices so that SIGINT and SIGTERM stop the
    wait: the kernel may hand a signal to any thread, and Python runs its handler only
    when the main thread next runs Python code, which an untimed wait never does. A
    signal whose exception was lost (see ``_signalled``) raises :class:`Interrupted` here."""
    while True:
        if _signalled:
            raise Interrupted(_signalled[-1])
        try:
            return fut.result(timeout=0.1)
        except concurrent.futures.TimeoutError:
            continue


# ------------------------------------------------------------------ flags and config files
def alias(*spellings: str) -> Any:
    """Extra command-line spellings of a config field (``--lr`` for ``--learning-rate``)."""
    return tyro.conf.arg(aliases=spellings)


def flag_names(config_cls: type, field: str) -> list[str]:
    """The flags that set ``field`` of the dataclass ``config_cls`` (empty if not a field)."""
    if field not in {f.name for f in dataclasses.fields(config_cls)}:
        return []
    flags = ["--" + field.replace("_", "-")]
    hint = typing.get_type_hints(config_cls, include_extras=True).get(field)
    for meta in getattr(hint, "__metadata__", ()):
        flags.extend(a for a in (getattr(meta, "aliases", None) or ()) if a not in flags)
    return flags


def name_the_flag(message: str, config_cls: type) -> str:
    """``message`` followed by the flags of the field it starts with, if it starts with one."""
    match = re.match(r"[A-Za-z_][A-Za-z0-9_]*", message)
    flags = flag_names(config_cls, match.group(0)) if match else []
    return f"{message} (flag {'/'.join(flags)})" if flags else message


def check_keys(
    d: dict[str, Any], config_cls: type, source: str, *, aliases: bool = False
) -> dict[str, Any]:
    """``d``'s keys as field names (``-`` read as ``_``; flag aliases too when ``aliases``),
    lists turned into tuples where the field is a tuple; ``ValueError`` naming the first
    key the config lacks."""
    label = config_cls.__name__.removesuffix("Config")
    known = {f.name: f.name for f in dataclasses.fields(config_cls)}
    if aliases:
        for name in list(known):
            for flag in flag_names(config_cls, name):
                known.setdefault(flag.lstrip("-").replace("-", "_"), name)
    hints = typing.get_type_hints(config_cls)
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = known.get(str(key).replace("-", "_"))
        if name is None:
            raise ValueError(
                f"{source}: unknown {label} config key {key!r} "
                f"(known: {sorted(f.name for f in dataclasses.fields(config_cls))})"
            )
        origin = typing.get_origin(hints[name]) or hints[name]
        if origin is tuple and not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list (in {source}), got {value!r}")
        if origin is dict and not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping (in {source}), got {value!r}")
        if isinstance(value, list) and origin is tuple:
            value = tuple(value)
        out[name] = value
    return out


def read_config_file(path: str, config_cls: type) -> dict[str, Any]:
    """The fields a ``--config`` YAML file sets (``ValueError`` naming the file or key).

    A flat mapping of fields (or their flag names); or another system's form where the
    config class reads one: ``config_cls.config_file_fields(path, mapping)`` returns the
    fields of such a file, or None for a flat one.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config: cannot read {path}: {e}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--config: {path} must hold a mapping of {config_cls.__name__} fields")
    other_form = getattr(config_cls, "config_file_fields", None)
    fields = other_form(path, loaded) if other_form is not None else None
    if fields is not None:
        return check_keys(fields, config_cls, f"--config {path}")
    return check_keys(loaded, config_cls, f"--config {path}", aliases=True)


def preparse(argv: list[str], *flags: str) -> argparse.Namespace:
    """The values of a few flags (``--resume`` is a switch) before the full parse, which
    needs the defaults they decide; other flags are left for tyro."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in flags:
        if flag == "--resume":
            pre.add_argument(flag, action="store_true")
        else:
            underscored = "--" + flag[2:].replace("-", "_")
            pre.add_argument(*dict.fromkeys((flag, underscored)), dest=flag[2:].replace("-", "_"))
    return pre.parse_known_args(argv)[0]


def parse_flags(cls: type[C], argv: list[str], default: C, prog: str, description: str) -> C:
    """``tyro.cli`` of ``cls`` over ``default``; ``SystemExit(0)`` after ``--help``,
    ``SystemExit(USAGE)`` for an unknown flag or an unparsable value (tyro says why)."""
    try:
        return tyro.cli(
            cls,
            args=argv,
            default=default,
            prog=prog,
            description=f"{description}\n\n{exit_codes_help()}",
            config=(tyro.conf.OmitArgPrefixes,),
        )
    except SystemExit as e:
        raise SystemExit(DONE if e.code in (0, None) else USAGE) from None


RUN_NAME_FORBIDDEN = ":/\\"  # a run name is a folder and part of worker-group names


def check_run_name(name: str | None) -> None:
    """``ValueError`` naming ``name`` when it cannot name a run (before anything starts)."""
    if name is None:
        return
    if not isinstance(name, str) or not name.strip() or name in (".", ".."):
        raise ValueError(f"name must be a non-empty folder name, got {name!r}")
    bad = sorted({c for c in name if c in RUN_NAME_FORBIDDEN or c.isspace()})
    if bad:
        raise ValueError(f"name may not contain {' '.join(map(repr, bad))}, got {name!r}")


def fresh_run_name(prefix: str, runs_dir: str | Path) -> str:
    """``prefix``, or ``prefix-2``, ``prefix-3``...: the first whose folder is absent or
    empty, so a new run never writes into an earlier one. Characters a run name may not
    hold (``module:EnvId``, ``ALE/Pong-v5``) become ``-``."""
    prefix = re.sub(rf"[{re.escape(RUN_NAME_FORBIDDEN)}\s]+", "-", prefix)
    name, i = prefix, 1
    while (Path(runs_dir) / name).is_dir() and any((Path(runs_dir) / name).iterdir()):
        i += 1
        name = f"{prefix}-{i}"
    return name


# ------------------------------------------------------------------ checkpoints
def checkpoint_write_error(path: str | os.PathLike[str], error: OSError) -> OSError:
    """The error for a checkpoint at ``path`` that could not be written: ``error``'s errno
    (``ENOSPC`` for a full disk) and its name in the message, which says that the previous
    checkpoint is kept (writers replace a checkpoint only once the new one is complete)."""
    code = (
        errno.errorcode.get(error.errno, str(error.errno)) if error.errno else type(error).__name__
    )
    return OSError(
        error.errno,
        f"could not write the checkpoint {path} ({code}: {error.strerror or error}); the "
        "previous checkpoint is kept",
    )


def os_error_of(error: BaseException) -> OSError | None:
    """``error`` if it is an ``OSError`` with an errno, or the ``OSError`` a worker raised
    (it arrives as a ``WorkerError`` with the error's type name and text); None for
    anything else (a ``GroupTimeoutError`` is a ``TimeoutError``, an errno-less
    ``OSError``: it keeps its own type and hang report)."""
    from phalanx._base.errors import WorkerError

    if isinstance(error, OSError):
        return error if error.errno is not None else None
    cause = getattr(builtins, getattr(error, "cause_type", ""), None)
    if not (isinstance(error, WorkerError) and isinstance(cause, type)):
        return None
    match = re.match(r"\[Errno (\d+)\] ", error.message)
    if not issubclass(cause, OSError) or match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code))


# ------------------------------------------------------------------ running a command
@contextlib.contextmanager
def tracing(enabled: bool, run_dir: Path) -> Iterator[None]:
    """Trace group calls into ``run_dir/trace.json`` (Perfetto) when ``enabled``; the file
    is kept, and announced, only when something was recorded."""
    if not enabled:
        yield
        return
    from phalanx.observe import trace

    path = Path(trace.enable(run_dir / TRACE_FILE))
    try:
        yield
    finally:
        trace.dump(path)
        trace.disable()
        if any(e.get("ph") != "M" for e in trace.load(path)):
            print(f"trace written to {path} (open it in https://ui.perfetto.dev)")
        else:
            path.unlink()


def _unsafe_to_raise(frame: Any) -> bool:
    """Whether raising an interrupt in ``frame`` (the code the signal stopped) could break
    Python's own locking: inside the import system (a module lock's weakref callback
    drops the exception and leaves the import lock held) or inside logging (its at-fork
    hook ``_releaseLock`` drops it and leaves the logging lock held); another thread then
    waits for that lock forever. The signal is sent to the main thread again shortly."""
    if frame is not None and frame.f_code.co_filename == _logging_file():
        return True
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _logging_file() -> str:
    """The file of the standard library's ``logging`` package."""
    import logging

    return logging.__file__ or ""


@contextlib.contextmanager
def _signals_interrupt(received: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread and are appended to
    ``received``: inside ``ray.get`` Ray replaces whatever a handler raises with a plain
    ``KeyboardInterrupt``, so the list is what still tells which signal came. (phalanx's
    Ray start keeps these handlers; a Ray started elsewhere by plain ``ray.init`` installs
    its own SIGTERM handler, which raises ``SystemExit(15)``: handled as SIGTERM too.)"""

    def handler(signum: int, frame: Any) -> None:
        if _unsafe_to_raise(frame):
            later = threading.Timer(0.05, resend, (signum,))
            later.daemon = True
            later.start()
            return
        received.append(signum)
        _signalled.append(signum)
        raise Interrupted(signum)

    def resend(signum: int) -> None:
        if active:  # only to this handler, never to the one restored after the run
            signal.pthread_kill(threading.main_thread().ident or 0, signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    active = [True]
    _signalled.clear()
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        active.clear()
        for s, h in old.items():
            signal.signal(s, h)
        _signalled.clear()


def bad_input(prog: str, error: BaseException, config_cls: type) -> int:
    """Print ``error`` (with the flag that sets the value it names) and return BAD_INPUT."""
    print(f"{prog}: error: {name_the_flag(str(error), config_cls)}", file=sys.stderr)
    return BAD_INPUT


def _runtime_failures() -> tuple[type[BaseException], ...]:
    import ray.exceptions

    from phalanx._base.errors import GroupTimeoutError, WorkerError
    from phalanx.resources.ray_start import RayStartError

    return (RayStartError, WorkerError, GroupTimeoutError, ray.exceptions.RayError)


def run_command(prog: str, config_cls: type, run_dir: Path, body: Callable[[], int]) -> int:
    """Run ``body`` (the algorithm; it returns DONE or BUDGET_SPENT) and return the exit
    status: bad input (ValueError, TypeError, a missing file) is 1 with the flag named,
    a Ray or worker-group failure 4, SIGINT 130 and SIGTERM 143. A Ray this run started
    is stopped after a failure. The run folder gets ``status.json``, unless the run wrote
    nothing there: then a folder this run created is removed."""
    import ray

    existed, ray_was_up = run_dir.exists(), ray.is_initialized()
    message, received = "", []
    try:
        with _signals_interrupt(received):
            code = body()
    except KeyboardInterrupt:  # Interrupted, or what Ray raised for it inside ray.get
        signum = signal.Signals(received[-1] if received else signal.SIGINT)
        code, message = 128 + signum, f"interrupted by {signum.name}"
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        code, message = SIGTERM_EXIT, "interrupted by SIGTERM"
    except (ValueError, TypeError, FileNotFoundError) as e:
        code, message = BAD_INPUT, name_the_flag(str(e), config_cls)
    except OSError as e:  # writing the run folder failed (a full disk)
        code, message = RUNTIME_FAILURE, f"{type(e).__name__}: {e}"
    except _runtime_failures() as e:
        code, message = RUNTIME_FAILURE, f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    if code != DONE and not ray_was_up:
        with contextlib.suppress(Exception):
            ray.shutdown()
    if message:
        print(f"{prog}: {'error: ' if code < 128 else ''}{message}", file=sys.stderr, flush=True)
    kept = _leave_run_folder(run_dir, existed, code, message)
    if code >= 128:
        print(f"{prog}: {kept}", file=sys.stderr, flush=True)
    return code


def _leave_run_folder(run_dir: Path, existed: bool, code: int, message: str) -> str:
    """Write ``status.json``, or remove a folder this run made and left without results;
    returns a line saying what the folder keeps."""
    if not run_dir.is_dir():
        return "nothing was written"
    if code == BAD_INPUT and existed:  # refused before it started: not this run's folder
        return f"{run_dir} was left as it was"
    if not existed and not (run_dir / "metrics.jsonl").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        return f"nothing was kept ({run_dir} removed: the run had not started)"
    status = "done" if code in (DONE, BUDGET_SPENT) else "interrupted" if code >= 128 else "failed"
    kept = sorted(p.name for p in run_dir.iterdir() if p.name != STATUS_FILE)
    try:
        (run_dir / STATUS_FILE).write_text(
            json.dumps({"status": status, "exit_code": code, "message": message}) + "\n"
        )
    except OSError as e:  # the disk is full: say so instead of failing here
        with contextlib.suppress(OSError):
            (run_dir / STATUS_FILE).unlink()
        print(f"{run_dir / STATUS_FILE} could not be written: {e}", file=sys.stderr, flush=True)
    return f"{run_dir} keeps {', '.join(kept)} (resume with --resume --name {run_dir.name})"
