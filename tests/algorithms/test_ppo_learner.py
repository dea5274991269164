"""PPO's learner in a restartable worker (``num_learners=1``): a learner killed inside an
update is restarted with the state kept after the previous one and the update is done
again, so the run ends with the weights of a run nobody disturbed; past ``max_restarts``
the run ends with exit 4 and a folder that resumes.

The learner dies by its own hand at a known point: a hook installed on its optimizer
before the update (``train(on_update=...)``) sends SIGKILL to its own process after the
update's second optimizer step, never after a sleep.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo import PPOConfig, load_checkpoint, train
from phalanx.algorithms.ppo_learner import LearnerRestartBudgetSpentError
from phalanx.observe.metrics import read_metrics


def _cfg(runs_dir: Path, name: str, **kw: Any) -> PPOConfig:
    base = dict(name=name, runs_dir=str(runs_dir), num_env_runners=1, max_timesteps=1024,
                num_learners=1, checkpoint_every=1)  # fmt: skip
    return PPOConfig.for_env("CartPole-v1", **{**base, **kw})


def die_after_second_step(worker: Any) -> None:
    """(On the learner's worker) SIGKILL this process after the next update's second
    optimizer step: inside the update, the weights half trained."""
    steps = []

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    worker.optimizer.register_step_post_hook(hook)


def kill_in_updates(iterations: set[int]) -> Any:
    """A ``train(on_update=...)`` hook: the update of each of ``iterations`` is killed."""

    def on_update(learner: Any) -> None:
        if learner.iteration in iterations:
            group = learner.remote.group
            group.apply(die_after_second_step, [(0, (), {})], label="die").wait(timeout=60)

    return on_update


def _iteration_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "return_mean" in r]


def _recoveries(run_dir: Path) -> list[dict[str, Any]]:
    keys = ("step", "recovery/group", "recovery/rank", "recovery/iteration", "recovery/repeated")
    return [{k: r[k] for k in keys} for r in read_metrics(run_dir) if "recovery/seconds" in r]


@pytest.mark.slow(reason="two PPO runs, one with a learner restart (about 50 s on 2 loaded cores)")
@pytest.mark.timeout(180)
def test_learner_killed_inside_an_update_redoes_it_and_ends_with_undisturbed_weights(
    cluster, tmp_path
):
    local = train(_cfg(tmp_path, "local", num_learners=0), cluster=cluster, progress=False)
    hit = train(
        _cfg(tmp_path, "hit"), cluster=cluster, progress=False, on_update=kill_in_updates({2})
    )

    assert hit["learner_restarts"] == 1 and local["learner_restarts"] == 0
    assert _recoveries(tmp_path / "hit") == [
        {"step": 512, "recovery/group": "learner", "recovery/rank": 0,
         "recovery/iteration": 2, "recovery/repeated": "update"},
    ]  # fmt: skip
    (row,) = [r for r in read_metrics(tmp_path / "hit") if "recovery/seconds" in r]
    assert row["recovery/load_seconds"] > 0 and row["recovery/start_seconds"] > 0
    assert row["recovery/start_seconds"] + row["recovery/load_seconds"] < row["recovery/seconds"]
    rows, calm_rows = _iteration_rows(tmp_path / "hit"), _iteration_rows(tmp_path / "local")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]  # each once: none skipped or twice
    assert [r["learner_restarts"] for r in rows] == [0, 1, 1, 1]
    for key in ("loss/policy", "loss/value", "return_mean_recent"):  # the same batches
        assert [r[key] for r in rows] == [r[key] for r in calm_rows], key
    # The remote learner, killed or not, trains as the local one: weights and Adam's
    # moments equal to fp32 tolerance (torch.testing's defaults: rtol 1.3e-6, atol 1e-5).
    want, got = load_checkpoint(tmp_path / "local"), load_checkpoint(tmp_path / "hit")
    assert got["timesteps"] == want["timesteps"] == 1024
    for name, tensor in want["policy"].items():
        torch.testing.assert_close(got["policy"][name], tensor, msg=name)
    for i, state in want["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got["optimizer"]["state"][i][k], state[k], msg=(i, k))


@pytest.mark.slow(reason="a PPO run with a learner restart, then its resume (about 50 s loaded)")
@pytest.mark.timeout(180)
def test_a_death_past_max_restarts_ends_the_run_with_exit_4_and_a_resumable_folder(
    cluster, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    cfg = _cfg(tmp_path, "run", max_restarts=1)
    errors: list[BaseException] = []

    def body() -> int:
        try:
            train(cfg, cluster=cluster, progress=False, on_update=kill_in_updates({2, 3}))
        except BaseException as e:
            errors.append(e)
            raise
        return harness.DONE

    code = harness.run_command("phalanx train ppo", PPOConfig, run_dir, body)

    assert code == harness.RUNTIME_FAILURE == 4
    (error,) = errors
    assert isinstance(error, LearnerRestartBudgetSpentError)
    assert error.group == f"ppo_learner_run_{os.getpid()}"
    assert (error.rank, error.method) == (0, "update")
    first_line = str(error).splitlines()[0]
    assert first_line.startswith(f"ppo_learner_run_{os.getpid()}[rank 0].update() failed with ")
    assert "the learner died after it was restarted 1 time(s) (max_restarts=1)" in first_line
    assert error.remote_traceback == error.__cause__.remote_traceback
    status = json.loads((run_dir / "status.json").read_text())
    assert status == {"status": "failed", "exit_code": 4,
                      "message": f"LearnerRestartBudgetSpentError: {first_line}"}  # fmt: skip
    assert f"phalanx train ppo: error: {status['message']}\n" in capsys.readouterr().err
    assert _recoveries(run_dir) == [
        {"step": 512, "recovery/group": "learner", "recovery/rank": 0,
         "recovery/iteration": 2, "recovery/repeated": "update"},
    ]  # fmt: skip
    # The checkpoint holds the state after iteration 2, and says so: iteration 3, whose
    # update never finished, is sampled and trained again by the resumed run.
    ckpt = load_checkpoint(run_dir)
    assert (ckpt["iteration"], ckpt["timesteps"]) == (2, 512)

    out = train(_cfg(tmp_path, "run"), resume=True, cluster=cluster, progress=False)
    assert out["timesteps"] == 1024
    assert [r["iteration"] for r in _iteration_rows(run_dir)] == [1, 2, 3, 4]


@pytest.mark.timeout(30)
def test_bad_learner_options_name_the_key():
    with pytest.raises(ValueError, match="num_learners must be 0 or 1, got 2: data-parallel"):
        PPOConfig(num_learners=2).validate()
    with pytest.raises(ValueError, match="num_learners must be >= 0, got -1"):
        PPOConfig(num_learners=-1).validate()
    with pytest.raises(ValueError, match="max_restarts must be >= 0, got -1"):
        PPOConfig(max_restarts=-1).validate()


@pytest.mark.timeout(60)
def test_chaos_benchmark_splits_each_ppo_kill_into_start_up_load_and_rest(monkeypatch):
    """benchmarks/chaos_training.py --algo ppo pairs each kill with the next recovery row
    of its group: a learner killed inside an update counts to the update's new start,
    one killed between updates and a runner count the restart's own seconds."""
    from tests.helpers import BENCHMARKS, benchmark_module

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    chaos = benchmark_module("chaos_training")
    rows = [
        {"wall_time": 110.5, "group": "learner", "iteration": 4, "repeated": "update",
         "resumed_at": 110.0, "seconds": 9.5, "start_seconds": 6.0, "load_seconds": 0.5},
        {"wall_time": 121.0, "group": "env_runner", "iteration": 6,
         "seconds": 3.0, "start_seconds": 2.5},
        {"wall_time": 140.0, "group": "learner", "iteration": 9,
         "repeated": "nothing (it died between updates)",
         "seconds": 4.0, "start_seconds": 3.0, "load_seconds": 0.25},
    ]  # fmt: skip
    kills = [(100.0, "learner"), (117.0, "env_runner"), (130.0, "learner")]
    assert chaos.per_kill_ppo(kills, rows) == [
        {"group": "learner", "iteration": 4, "redone": True, "kill_to_resume_s": 10.0,
         "startup_s": 6.0, "load_s": 0.5, "rest_s": 3.5},
        {"group": "learner", "iteration": 9, "redone": False, "kill_to_resume_s": 4.0,
         "startup_s": 3.0, "load_s": 0.25, "rest_s": 0.75},
        {"group": "env_runner", "iteration": 6, "redone": False, "kill_to_resume_s": 3.0,
         "startup_s": 2.5, "load_s": 0.0, "rest_s": 0.5},
    ]  # fmt: skip
    assert chaos.per_kill_ppo([(100.0, "learner")], []) == []  # a kill not recovered
