"""``phalanx train <algo>``: flags go to the algorithm module's ``cli(argv)``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from phalanx.cli.main import main, run


@pytest.mark.timeout(120)
@pytest.mark.smoke
def test_train_ppo_flags_come_from_the_config_dataclass(capsys):
    assert main(["train", "ppo", "--help"]) == 0
    out = capsys.readouterr().out
    # field docstrings are the help text; the short spellings are aliases of the fields
    assert "--env-runners INT, --num-env-runners INT" in out
    assert "annealing never goes below this fraction of learning_rate" in out
    assert "--lr FLOAT, --learning-rate FLOAT" in out
    # an unknown flag: exit status 2 (a usage error), the flag named, nothing started
    assert main(["train", "ppo", "--env-runnerz", "2"]) == 2
    assert "--env-runnerz" in capsys.readouterr().err
    # a bad value names the option before anything starts
    assert main(["train", "ppo", "--gamma", "1.5"]) == 1
    assert "gamma must be <= 1" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.smoke
def test_train_lists_the_algorithms(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "ppo" in out and "grpo" in out


@pytest.mark.timeout(120)
def test_the_program_exits_with_mains_status_and_its_objects_frozen(monkeypatch, capsys):
    """``run`` (the ``phalanx`` script, ``python -m phalanx.cli``) freezes what is alive so
    that the interpreter's collections at exit skip it."""
    import gc

    monkeypatch.setattr(sys, "argv", ["phalanx", "train", "ppo", "--gamma", "1.5"])
    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 1  # main's status for the bad value
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert "gamma must be <= 1" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.smoke
def test_importing_phalanx_or_its_command_loads_no_heavy_package():
    # Ctrl-C before the command's entry point runs would be Python's own traceback, so
    # nothing slow may be imported before it: Ray, torch and gymnasium come on first use.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    check = (
        "import sys, phalanx, phalanx.cli.main; "
        "print(sorted(m for m in ('gymnasium', 'numpy', 'ray', 'torch') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout) == (0, "[]\n"), out.stderr[-3000:]
