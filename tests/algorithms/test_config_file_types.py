"""A ``--config`` YAML value of the wrong type names its field (and flag) and the file,
before anything starts."""

from __future__ import annotations

import pytest

from phalanx.algorithms import ppo


@pytest.mark.parametrize(
    ("yaml_text", "why"),
    [
        ("hidden: 64\n", "hidden must be a list (in --config {path}), got 64 (flag --hidden)"),
        (
            "env_config: 5\n",
            "env_config must be a mapping (in --config {path}), got 5 (flag --env-config)",
        ),
    ],
)
def test_a_wrong_type_in_the_config_file_names_the_field(tmp_path, capsys, yaml_text, why):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    code = ppo.cli(["--config", str(path), "--runs-dir", str(tmp_path / "runs")])
    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"phalanx train ppo: error: {why.format(path=path)}"
    ]
    assert not (tmp_path / "runs").exists()


def test_a_list_for_a_tuple_field_still_loads(tmp_path):
    from phalanx.algorithms._harness import read_config_file
    from phalanx.algorithms.ppo_config import PPOConfig

    path = tmp_path / "c.yaml"
    path.write_text("hidden: [32, 16]\nenv_config: {max_episode_steps: 50}\n")
    assert read_config_file(str(path), PPOConfig) == {
        "hidden": (32, 16),
        "env_config": {"max_episode_steps": 50},
    }
