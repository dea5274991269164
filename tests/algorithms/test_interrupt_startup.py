"""Ctrl-C during ``phalanx train ppo``'s start-up: exit 130 with one line, never a raw
traceback, never a process that waits at exit for start-up work that cannot finish.

The SIGINT is a real one, sent by the process to itself at a chosen point of its imports
(an import finder placed first on ``sys.meta_path``), so the test does not depend on
timing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# argv[1]: the module whose import sends the SIGINT; argv[2]: "main" (only on the main
# thread) or a thread-name prefix: then that thread stays inside the import for good, as
# a thread left in an import that an interrupt broke does; argv[3]: "-m" runs
# ``python -m phalanx.cli``, "module:function" does what an installed console script does.
LAUNCHER = textwrap.dedent(
    """
    import importlib.util, os, runpy, signal, sys, threading

    module, where = sys.argv[1], sys.argv[2]

    class SigintOnImport:
        fired = False

        def find_spec(self, name, path=None, target=None):
            me = threading.current_thread()
            here = me is threading.main_thread() if where == "main" else me.name.startswith(where)
            if name != module or not here or SigintOnImport.fired:
                return None
            SigintOnImport.fired = True
            os.kill(os.getpid(), signal.SIGINT)
            return None if where == "main" else importlib.util.spec_from_loader(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, mod):  # holds this module's import lock, never returns
            threading.Event().wait()

    sys.meta_path.insert(0, SigintOnImport())
    entry = sys.argv[3]
    sys.argv = ["phalanx", *sys.argv[4:]]
    if entry == "-m":
        runpy.run_module("phalanx.cli", run_name="__main__")
    else:
        path, _, function = entry.partition(":")
        sys.exit(getattr(importlib.import_module(path), function)())
    """
)


def _run(tmp_path, module: str, where: str, entry: str = "-m") -> subprocess.CompletedProcess:
    argv = ["train", "ppo", "--env-runners", "0", "--max-timesteps", "100000000",
            "--runs-dir", str(tmp_path), "--name", "r", "--no-progress"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-c", LAUNCHER, module, where, entry, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_ctrl_c_while_the_command_imports_its_modules(tmp_path):
    proc = _run(tmp_path, "phalanx.algorithms.ppo", "main")
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "phalanx: interrupted by SIGINT (nothing was started)"
    )


def _console_script() -> str:
    """The ``phalanx`` command's entry point, as ``pyproject.toml`` declares it."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        scripts = f.read().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^phalanx = "([^"]+)"', scripts, re.M).group(1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("module", ["ray", "torch", "gymnasium"])
def test_ctrl_c_while_the_installed_command_starts(tmp_path, module):
    # The console script imports its entry module, then calls it: the first heavy import
    # must come after the command's own SIGINT handling is in place.
    proc = _run(tmp_path, module, "main", _console_script())
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "phalanx: interrupted by SIGINT (nothing was started)"
    ]


# The command's SIGINT handler, called as if the signal had stopped the import system's
# own code (the frame of importlib's ``_find_spec``, where Python can drop an exception).
IN_THE_IMPORT_SYSTEM = textwrap.dedent(
    """
    import signal, sys

    class HandlerInsideImportlib:
        def find_spec(self, name, path=None, target=None):
            if name == "gymnasium" and not hasattr(self, "done"):
                self.done = True
                signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe(1))
                print("handler returned", file=sys.stderr, flush=True)
            return None

    sys.meta_path.insert(0, HandlerInsideImportlib())
    from phalanx.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.timeout(90)
def test_ctrl_c_inside_the_import_system_is_sent_again_after_it(tmp_path):
    argv = ["train", "ppo", "--env-runners", "0", "--max-timesteps", "100000000",
            "--runs-dir", str(tmp_path), "--name", "r", "--no-progress"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", IN_THE_IMPORT_SYSTEM, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "handler returned", proc.stderr[-3000:]
    assert lines[-1] in (
        "phalanx: interrupted by SIGINT (nothing was started)",
        "phalanx train ppo: nothing was written",
    )


@pytest.mark.timeout(90)
def test_ctrl_c_while_the_learner_thread_is_stuck_in_an_import(tmp_path):
    # torch.optim.Adam imports torch._dynamo on the learner's start-up thread.
    proc = _run(tmp_path, "torch._dynamo", "ppo-learner-init")
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "phalanx train ppo: interrupted by SIGINT" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "r").exists()  # nothing was written: no folder left


class _Stop(Exception):
    """What the test's SIGINT handler raises (a KeyboardInterrupt would stop pytest)."""


@pytest.mark.timeout(30)
def test_a_signal_handed_to_another_thread_stops_the_wait_for_start_up_work():
    import concurrent.futures
    import signal
    import threading
    import time

    from phalanx.algorithms._harness import result_of

    def handler(signum, frame):
        raise _Stop

    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    stopped = threading.Event()
    outlasted: list[bool] = []

    def signal_this_thread() -> None:  # as when the kernel picks a thread other than main
        deadline = time.monotonic() + 10
        while not never._condition._waiters and time.monotonic() < deadline:
            stopped.wait(0.01)  # poll until the main thread waits on the future
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        if not stopped.wait(10):  # an untimed wait would still be waiting: end it
            never.set_result(0)
            outlasted.append(True)

    old = signal.signal(signal.SIGINT, handler)
    try:
        threading.Thread(target=signal_this_thread, daemon=True).start()
        with pytest.raises(_Stop):
            result_of(never)
        assert outlasted == []  # the signal stopped the wait, not the future's result
    finally:
        stopped.set()
        signal.signal(signal.SIGINT, old)


class _SignalledWhileDropped:
    """Sends SIGINT to its own process from ``__del__``: the handler runs there and Python
    drops its exception ("Exception ignored"), as in the import system's weakref callback."""

    def __del__(self) -> None:
        import signal

        signal.raise_signal(signal.SIGINT)


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost one
def test_a_signal_whose_exception_was_lost_still_stops_the_run(tmp_path, capsys):
    import concurrent.futures
    import threading

    from phalanx.algorithms import _harness as harness
    from phalanx.algorithms.ppo_config import PPOConfig

    learner: concurrent.futures.Future[int] = concurrent.futures.Future()
    stopped = threading.Event()

    def end_the_wait() -> None:  # without the fix the wait would outlast the run
        if not stopped.wait(10):
            learner.set_result(0)

    def body() -> int:
        _SignalledWhileDropped()  # dropped at once
        harness.result_of(learner)
        return harness.DONE

    threading.Thread(target=end_the_wait, daemon=True).start()
    try:
        code = harness.run_command("p", PPOConfig, tmp_path / "run", body)
    finally:
        stopped.set()
    assert code == harness.SIGINT_EXIT
    err = capsys.readouterr().err
    assert "p: interrupted by SIGINT\np: nothing was written\n" in err


class _SigintWhileImported:
    """An import finder for ``phalanx_test_interrupted``: its module sends SIGINT to this
    process halfway through being executed, then finishes."""

    def find_spec(self, name, path=None, target=None):
        import importlib.util

        if name != "phalanx_test_interrupted":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        import signal

        signal.raise_signal(signal.SIGINT)
        module.finished = True


@pytest.mark.timeout(30)
def test_a_signal_inside_an_import_stops_the_run_once_the_import_is_done(tmp_path, capsys):
    import concurrent.futures

    from phalanx.algorithms import _harness as harness
    from phalanx.algorithms.ppo_config import PPOConfig

    def body() -> int:
        import phalanx_test_interrupted  # noqa: F401

        harness.result_of(concurrent.futures.Future())  # stopped by the signal, sent again
        return harness.DONE

    finder = _SigintWhileImported()
    sys.meta_path.insert(0, finder)
    try:
        code = harness.run_command("p", PPOConfig, tmp_path / "run", body)
        assert code == harness.SIGINT_EXIT
        assert sys.modules["phalanx_test_interrupted"].finished is True
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("phalanx_test_interrupted", None)
    assert "p: interrupted by SIGINT\n" in capsys.readouterr().err
