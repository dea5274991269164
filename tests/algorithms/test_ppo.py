"""PPO on CartPole with phalanx env runners: learning, fault tolerance, checkpoints, CLI."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import deque

import numpy as np
import pytest
import torch

from phalanx.algorithms.ppo import (
    Learner,
    PPOConfig,
    RunClock,
    annealed_lr,
    build_policy,
    gae,
    iteration_row,
    load_checkpoint,
    run_summary,
    train,
)
from phalanx.cli.main import main
from phalanx.observe.breakdown import WallBreakdown
from phalanx.observe.metrics import read_metrics


def _cfg(tmp_path, **kw) -> PPOConfig:
    base = dict(name="t", runs_dir=str(tmp_path), num_env_runners=1, max_timesteps=2048)
    return PPOConfig.for_env(kw.pop("env", "CartPole-v1"), **{**base, **kw})


@pytest.mark.timeout(30)
@pytest.mark.smoke
def test_bad_config_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="minibatch_size=9999 is larger than the batch"):
        _cfg(tmp_path, minibatch_size=9999).validate()
    with pytest.raises(ValueError, match="env: unknown gymnasium env id"):
        _cfg(tmp_path, env="Nope-v0").validate()
    with pytest.raises(ValueError, match="gamma"):
        _cfg(tmp_path, gamma=1.5).validate()
    with pytest.raises(TypeError, match="update_epochs"):
        _cfg(tmp_path, update_epochs=2.5).validate()
    with pytest.raises(ValueError, match="unknown PPO config key 'lr'"):
        PPOConfig.from_dict({"lr": 1.0})
    with pytest.raises(ValueError, match="lr_floor"):
        _cfg(tmp_path, lr_floor=1.5).validate()


@pytest.mark.timeout(30)
@pytest.mark.smoke
def test_gae_bootstraps_truncation_only():
    T = 3
    b = {
        "rewards": np.ones((T, 1), np.float32),
        "values": np.full((T, 1), 2.0, np.float32),
        "terminateds": np.array([[False], [False], [False]]),
        "truncateds": np.array([[False], [True], [False]]),
        "final_values": np.array([[0.0], [10.0], [0.0]], np.float32),
        "last_values": np.array([5.0], np.float32),
    }
    adv, ret = gae(b, gamma=0.5, lam=1.0)
    # t=2: 1 + 0.5*5 - 2 = 1.5; t=1 (truncated, bootstrap V(final)=10): 1 + 0.5*10 - 2 = 4;
    # t=0: delta 1 + 0.5*2 - 2 = 0, plus 0.5*4 = 2
    np.testing.assert_allclose(adv[:, 0], [2.0, 4.0, 1.5])
    np.testing.assert_allclose(ret, adv + b["values"])
    b["terminateds"], b["truncateds"] = b["truncateds"], b["terminateds"]  # terminated instead
    adv, _ = gae(b, gamma=0.5, lam=1.0)
    np.testing.assert_allclose(adv[:, 0], [0.0 + 0.5 * -1.0, -1.0, 1.5])


@pytest.mark.timeout(30)
@pytest.mark.smoke
def test_annealed_lr_falls_linearly_to_its_floor(tmp_path):
    cfg = _cfg(tmp_path, learning_rate=1e-3, max_timesteps=1000, lr_floor=0.1)
    assert annealed_lr(cfg, 0) == 1e-3
    assert annealed_lr(cfg, 500) == 0.5 * 1e-3
    assert annealed_lr(cfg, 880) == (1.0 - 880 / 1000) * 1e-3
    assert annealed_lr(cfg, 950) == 0.1 * 1e-3  # 0.05 of the way left: the floor
    assert annealed_lr(cfg, 1000) == 0.1 * 1e-3


def _learner(cfg: PPOConfig) -> Learner:
    import gymnasium as gym

    spaces = (gym.spaces.Box(-1.0, 1.0, (4,)), gym.spaces.Discrete(2))
    policy = build_policy(cfg, *spaces)
    return Learner(policy, torch.optim.Adam(policy.parameters(), lr=cfg.learning_rate), spaces)


@pytest.mark.timeout(30)
@pytest.mark.smoke
def test_iteration_row_and_summary_keep_their_keys_in_order(tmp_path):
    """The metrics row and the summary (printed as JSON by the CLI) keep their keys and
    their order: counters, episodes, update, learning rate, timing, runners, restarts."""
    cfg = _cfg(tmp_path, learning_rate=1e-3)
    learner = _learner(cfg)
    learner.timesteps, learner.iteration, learner.episodes = 512, 2, 7
    learner.optimizer.param_groups[0]["lr"] = 4e-4
    row = iteration_row(
        learner, {"return_mean": 20.0}, {"loss/policy": 0.5}, {"time/step": 2.0}, {"restarts": 1}
    )
    assert row == {
        "timesteps": 512, "iteration": 2, "episodes": 7, "return_mean": 20.0,
        "loss/policy": 0.5, "lr": 4e-4, "time/step": 2.0, "restarts": 1, "learner_restarts": 0,
    }  # fmt: skip
    assert list(row) == ["timesteps", "iteration", "episodes", "return_mean", "loss/policy",
                         "lr", "time/step", "restarts", "learner_restarts"]  # fmt: skip

    times = WallBreakdown()
    times.add("learning", 3.0)
    summary = run_summary(learner, deque([10.0, 30.0]), tmp_path, times, wall=8.0,
                          train_loop_s=6.0, reached_at=5.5, stopped=False, steps_per_s=100.0,
                          restarts=1)  # fmt: skip
    assert list(summary) == [
        "timesteps", "iterations", "episodes", "return_mean_recent", "reached_stop_return",
        "stopped_by_callback", "time_to_stop_return_s", "wall_time_s", "train_loop_s",
        "steps_per_s", "restarts", "learner_restarts", "run_dir", "breakdown",
    ]  # fmt: skip
    assert summary["timesteps"] == 512 and summary["iterations"] == 2
    assert summary["return_mean_recent"] == 20.0 and summary["reached_stop_return"] is True
    assert summary["time_to_stop_return_s"] == 5.5 and summary["run_dir"] == str(tmp_path)
    assert summary["breakdown"] == times.as_dict(8.0)
    empty = run_summary(learner, deque(), tmp_path, times, wall=8.0, train_loop_s=6.0,
                        reached_at=None, stopped=True, steps_per_s=100.0, restarts=0)  # fmt: skip
    assert np.isnan(empty["return_mean_recent"]) and empty["reached_stop_return"] is False
    assert empty["stopped_by_callback"] is True


@pytest.mark.timeout(30)
@pytest.mark.smoke
def test_run_clock_times_the_iteration_and_the_loop():
    start = time.perf_counter()
    clock = RunClock(start=start - 10.0, loop=start - 5.0, loop_timesteps=100)
    m = clock.metrics({"rollout": 1.5, "train": 2.5}, t_iter=start - 1.0, timesteps=600)
    elapsed = time.perf_counter() - start
    assert list(m) == ["time/rollout", "time/train", "time/weight_sync", "time/step",
                       "time/total", "throughput/steps_per_s"]  # fmt: skip
    assert (m["time/rollout"], m["time/train"], m["time/weight_sync"]) == (1.5, 2.5, 0.0)
    assert 1.0 <= m["time/step"] <= 1.0 + elapsed
    assert 10.0 <= m["time/total"] <= 10.0 + elapsed
    assert 500 / (5.0 + elapsed) <= m["throughput/steps_per_s"] <= 500 / 5.0


@pytest.mark.timeout(150)
def test_ppo_beats_random_on_cartpole(cluster, tmp_path):
    cfg = _cfg(tmp_path, num_env_runners=2, max_timesteps=60_000, stop_return=200.0)
    out = train(cfg, cluster=cluster, progress=False)
    # a random policy averages ~22 on CartPole-v1
    assert out["return_mean_recent"] >= 200.0, out
    assert out["reached_stop_return"]
    rows = read_metrics(tmp_path / "t")
    assert rows[0]["return_mean_recent"] < 60
    assert {"loss/policy", "loss/value", "throughput/steps_per_s", "restarts"} <= set(rows[-1])
    assert (tmp_path / "t" / "learning_curve.png").stat().st_size > 1000


@pytest.mark.timeout(150)
def test_killed_runner_restarts_and_training_completes(cluster, tmp_path):
    killed = []

    def kill_once(metrics, runners):  # on_iteration: runs on the driver after each iteration
        if metrics["iteration"] == 2 and not killed:
            pid = runners.foreach_worker(lambda w: os.getpid(), remote_worker_ids=[1])[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        # stop once the restarted runner delivered a batch again
        return metrics["restarts"] == 1 and metrics["batch_runners"] == 2

    cfg = _cfg(tmp_path, num_env_runners=2, max_timesteps=400_000, anneal_lr=False)
    out = train(cfg, cluster=cluster, progress=False, on_iteration=kill_once)
    assert len(killed) == 1 and out["stopped_by_callback"], out
    assert out["restarts"] == 1  # exactly one kill, exactly one restart
    rows = [r for r in read_metrics(tmp_path / "t") if "return_mean" in r]
    assert min(r["batch_runners"] for r in rows) == 1  # the round it died in went on without it
    assert rows[-1]["restarts"] == 1 and rows[-1]["healthy_env_runners"] == 2
    assert rows[-1]["batch_runners"] == 2  # the restarted runner samples again
    # the restart's row: from the death being seen to the runner being back with weights
    (rec,) = [r for r in read_metrics(tmp_path / "t") if "recovery/seconds" in r]
    assert rec["recovery/group"] == "env_runner" and rec["recovery/rank"] == 0
    assert rec["recovery/step"] == rec["step"] and rec["recovery/iteration"] >= 2
    assert rec["recovery/reason"].startswith(f"ppo_t_{os.getpid()}[rank 0]: actor died")
    assert 0 < rec["recovery/start_seconds"] <= rec["recovery/seconds"]


@pytest.mark.timeout(150)
def test_async_sampling_is_one_version_behind(cluster, tmp_path):
    cfg = _cfg(tmp_path, num_env_runners=1, max_timesteps=2048, async_sampling=True)
    train(cfg, cluster=cluster, progress=False)
    rows = read_metrics(tmp_path / "t")
    assert rows[0]["policy_lag"] == 0
    assert [r["policy_lag"] for r in rows[1:]] == [1] * (len(rows) - 1)
    assert [r["weights_version"] for r in rows] == sorted(r["weights_version"] for r in rows)


@pytest.mark.timeout(150)
def test_checkpoint_resume_continues(cluster, tmp_path):
    cfg = _cfg(tmp_path, max_timesteps=1024, normalize_observations=True)
    train(cfg, cluster=cluster, progress=False)
    ck1 = load_checkpoint(tmp_path / "t")
    assert ck1["timesteps"] == 1024 and ck1["connector"]["obs_norm"]["count"] > 1000
    with pytest.raises(ValueError, match="--resume"):
        train(cfg, cluster=cluster, progress=False)
    # resuming at the budget trains nothing: the same policy comes back out
    train(cfg, resume=True, cluster=cluster, progress=False)
    ck2 = load_checkpoint(tmp_path / "t")
    for k, v in ck1["policy"].items():
        torch.testing.assert_close(ck2["policy"][k], v)
    np.testing.assert_allclose(
        ck2["connector"]["obs_norm"]["mean"], ck1["connector"]["obs_norm"]["mean"]
    )
    policy = build_policy(cfg, ck2["observation_space"], ck2["action_space"])
    policy.load_state_dict(ck2["policy"])
    # a longer budget continues the step count
    cfg.max_timesteps = 2048
    out = train(cfg, resume=True, cluster=cluster, progress=False)
    assert out["timesteps"] == 2048
    steps = [r["timesteps"] for r in read_metrics(tmp_path / "t")]
    assert steps == sorted(steps) and steps[-1] == 2048 and 1024 in steps
    assert load_checkpoint(tmp_path / "t")["optimizer"]["state"]


@pytest.mark.timeout(170)
def test_cli_end_to_end(cluster, tmp_path, capsys):
    cfg_file = tmp_path / "ppo.yaml"
    cfg_file.write_text(
        "num_envs_per_env_runner: 4\nrollout_fragment_length: 16\nminibatch_size: 32\n"
    )
    argv = ["train", "ppo", "--env", "CartPole-v1", "--env-runners", "1", "--seed", "3",
            "--max-timesteps", "512", "--name", "cli", "--runs-dir", str(tmp_path),
            "--config", str(cfg_file), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    run = tmp_path / "cli"
    assert {"metrics.jsonl", "checkpoints", "learning_curve.png", "config.json"} <= set(
        os.listdir(run)
    )
    assert sorted(os.listdir(run / "checkpoints" / "step_8")) == ["learner.pt", "state.json"]
    conf = json.loads((run / "config.json").read_text())
    assert conf["num_envs_per_env_runner"] == 4 and conf["seed"] == 3
    assert read_metrics(run)[-1]["timesteps"] == 512
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["episodes"] == 3 and res["trained_timesteps"] == 512
    # resume continues the same run
    assert main(["train", "ppo", "--name", "cli", "--runs-dir", str(tmp_path), "--resume",
                 "--max-timesteps", "1024", "--no-progress"]) == 0  # fmt: skip
    assert read_metrics(run)[-1]["timesteps"] == 1024
    # bad input: exit code 1 and a message naming the option, nothing started
    assert (
        main(["train", "ppo", "--env", "Nope-v1", "--name", "bad", "--runs-dir", str(tmp_path)])
        == 1
    )
    assert "env: unknown gymnasium env id" in capsys.readouterr().err
    assert main(["train", "ppo", "--minibatch-size", "100000", "--runs-dir", str(tmp_path)]) == 1
    assert "minibatch_size" in capsys.readouterr().err
    assert main(["train", "ppo", "--bogus", "1", "--runs-dir", str(tmp_path)]) == 2  # usage
    assert "--bogus" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main(["train", "ppo", "--help"]) == 0
    helptext = capsys.readouterr().out
    for flag in ("--env", "--env-runners", "--stop-return", "--max-timesteps", "--name",
                 "--seed", "--resume", "--config", "--trace", "--lr-floor", "--no-progress"):  # fmt: skip
        assert flag in helptext
    assert "annealing never goes below this fraction of learning_rate" in helptext


@pytest.mark.timeout(60)
def test_cli_config_errors_name_the_key_and_the_file(tmp_path, capsys):
    bad_key = tmp_path / "run.yaml"
    bad_key.write_text("num_envs_per_env_runner: 4\nlearning_rat: 0.1\n")
    argv = ["train", "ppo", "--config", str(bad_key), "--runs-dir", str(tmp_path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"--config {bad_key}: unknown PPO config key 'learning_rat'" in err
    # a corrupt checkpoint: the error names the file, nothing starts
    folder = tmp_path / "broken" / "checkpoints" / "step_3"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text('{"step": 3}')
    (folder / "learner.pt").write_bytes(b"not a torch file")
    argv = ["train", "ppo", "--name", "broken", "--runs-dir", str(tmp_path), "--resume"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"checkpoint {folder / 'learner.pt'} is corrupt or unreadable" in err
    with pytest.raises(ValueError, match="checkpoint .*step_3/learner.pt is corrupt"):
        load_checkpoint(tmp_path / "broken")
    assert main(["train", "ppo", "--resume", "--runs-dir", str(tmp_path)]) == 1
    assert "--resume needs --name" in capsys.readouterr().err
    assert main(["train", "ppo", "--name", "nope", "--runs-dir", str(tmp_path), "--resume"]) == 1
    assert f"no PPO checkpoint under {tmp_path / 'nope' / 'checkpoints'}" in capsys.readouterr().err
    # a bad value names the flags that set it, aliases included
    assert main(["train", "ppo", "--lr", "-1", "--runs-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "learning_rate must be > 0, got -1.0 (flag --learning-rate/--lr)" in err


@pytest.mark.timeout(60)
def test_cli_flags_override_file_and_tuned_values(tmp_path):
    from phalanx.algorithms.ppo import TUNED, _defaults

    conf = tmp_path / "run.yaml"
    conf.write_text("env: Pendulum-v1\nminibatch_size: 64\nlr_floor: 0.2\n")
    d = _defaults(["--config", str(conf)])
    assert d.ppo.env == "Pendulum-v1"
    assert d.ppo.update_epochs == TUNED["Pendulum-v1"]["update_epochs"]  # tuned for the env
    assert (d.ppo.minibatch_size, d.ppo.lr_floor) == (64, 0.2)  # the file over the tuned
    d = _defaults(["--config", str(conf), "--env", "CartPole-v1"])
    assert d.ppo.env == "CartPole-v1" and d.ppo.minibatch_size == 64


@pytest.mark.timeout(150)
@pytest.mark.smoke
def test_breakdown_covers_the_run(cluster, tmp_path):
    cfg = _cfg(tmp_path, num_env_runners=1, max_timesteps=1024)
    out = train(cfg, cluster=cluster, progress=False)
    b = out["breakdown"]
    for phase in ("env runners start", "learner init", "first weight sync", "sampling (waited)",
                  "learning", "weight sync", "checkpoints", "env runners stop", "plotting"):  # fmt: skip
        assert b[phase] > 0, (phase, b)
    assert "ray start" not in b  # the cluster was given: nothing to start
    # the learner is built on a helper thread while the runners start: not counted twice
    counted = sum(v for k, v in b.items() if k not in ("learner init", "other"))
    assert counted <= out["wall_time_s"] + 1e-3
    assert b["other"] == pytest.approx(out["wall_time_s"] - counted, abs=2e-3)


@pytest.mark.slow(reason="the README command in a fresh process that starts its own Ray")
@pytest.mark.timeout(240)
def test_readme_command_starts_its_own_ray(tmp_path):
    """The README command in a fresh process: its own embedded Ray (runner slots plus one,
    pre-started workers), two runners, and a breakdown that names the start-up phases."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-m", "phalanx.cli", "train", "ppo", "--env", "CartPole-v1",
            "--env-runners", "2", "--max-timesteps", "1024", "--name", "own",
            "--runs-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=220, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    summary = json.loads(out[out.index("{\n") : out.index("\n}") + 2])
    assert summary["timesteps"] == 1024 and summary["iterations"] == 2
    assert summary["restarts"] == 0
    b = json.loads((tmp_path / "own" / "breakdown.json").read_text())["phases"]
    for phase in ("python start-up and imports", "ray start", "env runners start", "learning"):
        assert b[phase] > 0, (phase, b)
