"""Run names: one derived from ``--env module:EnvId`` (gymnasium's documented form) or a
namespaced id is a valid folder and group name; a bad ``--name`` is refused before
anything starts."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms import ppo
from phalanx.algorithms.grpo_config import GRPOConfig
from phalanx.algorithms.ppo_config import PPOConfig

MODULE_ENV = "tests.envs.registered_env:PhalanxCountdown-v0"


def test_derived_names_replace_what_a_run_name_may_not_hold(tmp_path):
    assert harness.fresh_run_name(f"ppo-{MODULE_ENV}", tmp_path) == (
        "ppo-tests.envs.registered_env-PhalanxCountdown-v0"
    )
    assert harness.fresh_run_name("ppo-ALE/Pong-v5", tmp_path) == "ppo-ALE-Pong-v5"


@pytest.mark.parametrize("cfg_cls", [PPOConfig, GRPOConfig])
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a:b", "name may not contain ':', got 'a:b'"),
        ("runs/x", "name may not contain '/', got 'runs/x'"),
        ("a b", "name may not contain ' ', got 'a b'"),
        ("", "name must be a non-empty folder name, got ''"),
    ],
)
def test_a_bad_name_is_refused_by_validate(cfg_cls, name, why):
    with pytest.raises(ValueError) as info:
        cfg_cls(name=name).validate()
    assert str(info.value) == why


@pytest.fixture
def forget_module_env():
    """Undo the module env's import and registration in this process afterwards (another
    test checks that naming it imports the module)."""
    yield
    gym.registry.pop(MODULE_ENV.split(":")[1], None)
    sys.modules.pop(MODULE_ENV.split(":")[0], None)


@pytest.mark.timeout(120)
def test_ppo_with_a_module_env_id_runs_under_a_derived_name(cluster, tmp_path, forget_module_env):
    cfg = PPOConfig(env=MODULE_ENV, num_env_runners=1, max_timesteps=64, runs_dir=str(tmp_path))
    summary = ppo.train(cfg, cluster=cluster, progress=False)
    assert summary["timesteps"] >= 64
    assert [p.name for p in tmp_path.iterdir()] == [
        "ppo-tests.envs.registered_env-PhalanxCountdown-v0"
    ]
