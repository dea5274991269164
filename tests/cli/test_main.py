"""``phalanx train <algo>``: flags go to the algorithm module's ``cli(argv)``."""

from __future__ import annotations

import pytest

from phalanx.cli.main import main


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
