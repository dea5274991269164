"""The ``phalanx`` command line.

Each subcommand lives in its own module, imported only when used. ``phalanx train <algo>``
hands the rest of the command line to ``cli(argv) -> int`` of the algorithm's module,
which builds its flags from its config dataclass (a module without ``cli`` provides
``add_arguments(parser)`` and ``run(args) -> int``, as the other subcommands do):

    phalanx demo                      runtime demonstration (phalanx.cli.demo)
    phalanx train ppo ...             PPO on gymnasium (phalanx.algorithms.ppo)
    phalanx train grpo ...            GRPO on a small language model (phalanx.algorithms.grpo)
    phalanx eval runs/<name>          evaluate a saved policy (phalanx.algorithms.evaluate)
    phalanx report runs/<name>        summary table and plots of a run (phalanx.cli.report)
    phalanx status                    live phalanx groups on the Ray cluster (phalanx.cli.status)
"""

from __future__ import annotations

import gc
import importlib
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import argparse

SIGINT_EXIT = 128 + signal.SIGINT  # 130, as a run interrupted by Ctrl-C
RESEND_S = 0.05  # how soon a SIGINT that came inside the import system is sent again

_COMMANDS = {
    "demo": ("phalanx.cli.demo", "run a short demonstration of the runtime on the embedded Ray"),
    "eval": ("phalanx.algorithms.evaluate", "run a saved policy and print its mean return"),
    "report": ("phalanx.cli.report", "summarise a run: table in the terminal, PNG plots"),
    "status": ("phalanx.cli.status", "list live phalanx groups on the current Ray cluster"),
    "models": ("phalanx.cli.models", "fetch or convert a pretrained model (no hub needed)"),
}
_TRAIN = {
    "ppo": ("phalanx.algorithms.ppo", "PPO on a gymnasium environment"),
    "grpo": ("phalanx.algorithms.grpo", "GRPO on a small local language model"),
}


def _module(path: str):
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name == path:
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (each subcommand's module is imported here)."""
    import argparse

    parser = argparse.ArgumentParser(prog="phalanx", description="Distributed RL runtime on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (path, help_text) in _COMMANDS.items():
        mod = _module(path)
        if mod is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    train = sub.add_parser(
        "train", help="train with an algorithm", description="Train with an algorithm."
    )
    algos = train.add_subparsers(dest="algorithm", required=True)
    for name, (path, help_text) in _TRAIN.items():
        mod = _module(path)
        if mod is None:
            continue
        p = algos.add_parser(name, help=help_text, description=help_text, add_help=False)
        if hasattr(mod, "cli"):  # the module parses its own flags: pass them through
            p.add_argument("argv", nargs=argparse.REMAINDER)
            p.set_defaults(_run=lambda args, mod=mod: mod.cli(list(args.argv)))
        else:
            p.add_argument("-h", "--help", action="help", help="show this help message and exit")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``phalanx`` command line; returns the exit status.

    Its first action is to take over SIGINT: a Ctrl-C before a command installs its own
    handling (while Ray, torch and gymnasium are imported and flags parsed) exits 130 with
    one line, as one during a run does. The modules imported before this point (``phalanx``
    and this one) import nothing slow."""
    active: list[bool] = []
    old = None
    if threading.current_thread() is threading.main_thread():
        active.append(True)
        old = signal.signal(signal.SIGINT, lambda signum, frame: _interrupt(frame, active))
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("phalanx: interrupted by SIGINT (nothing was started)", file=sys.stderr, flush=True)
        return SIGINT_EXIT
    finally:
        if active:
            active.clear()
            signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)


def _interrupt(frame: Any, active: list[bool]) -> None:
    """Raise ``KeyboardInterrupt``, unless ``frame`` (the code the signal stopped) is the
    import system's own: an exception raised there can be dropped (a module lock's weakref
    callback prints "Exception ignored" and goes on), losing the Ctrl-C. The signal is then
    sent again shortly, while ``active`` (this command's handler is still installed)."""
    if frame is None or not frame.f_code.co_filename.startswith("<frozen importlib"):
        raise KeyboardInterrupt

    def resend() -> None:
        if active:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    later = threading.Timer(RESEND_S, resend)
    later.daemon = True
    later.start()


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "train" and argv[1] in _TRAIN:
        # ``phalanx train <algo> ...``: only that algorithm's module is imported
        mod = _module(_TRAIN[argv[1]][0])
        if mod is not None and hasattr(mod, "cli"):
            return int(mod.cli(argv[2:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


def run() -> NoReturn:
    """The ``phalanx`` program: :func:`main`, then exit with its status.

    Garbage is collected once and what is still alive is frozen (``gc.freeze``) before the
    interpreter exits: its own collections at exit would walk every object that torch,
    transformers and Ray made, 1-1.5 s of a finished or Ctrl-C'd run's exit on an idle
    2-core machine and several times that on a loaded one."""
    code = main()
    gc.collect()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
