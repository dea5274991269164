"""The algorithms' command-line harness: exit codes, config files, run folders, tracing,
signals; and precision auto-detection. No Ray is started here."""

from __future__ import annotations

import json
import os
import signal

import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo import GRPOConfig
from phalanx.algorithms.grpo import cli as grpo_cli
from phalanx.algorithms.ppo import PPOConfig
from phalanx.algorithms.precision import cpu_flags, has_fast_bf16, resolve_precision
from phalanx.cli.main import main
from phalanx.resources.ray_start import RayStartError


@pytest.mark.smoke
def test_exit_codes_are_distinct_and_documented():
    codes = (harness.DONE, harness.BAD_INPUT, harness.USAGE, harness.BUDGET_SPENT,
             harness.RUNTIME_FAILURE, harness.SIGINT_EXIT, harness.SIGTERM_EXIT)  # fmt: skip
    assert codes == (0, 1, 2, 3, 4, 130, 143)
    assert sorted(harness.EXIT_CODES) == sorted(codes)
    text = harness.exit_codes_help()
    for code in codes:
        assert f"{code} " in text


@pytest.mark.timeout(60)
@pytest.mark.smoke
def test_help_usage_and_bad_input_exit_codes(tmp_path, capsys):
    for prog in ("ppo", "grpo"):
        assert main(["train", prog, "--help"]) == 0
        assert "Exit status: 0 done" in capsys.readouterr().out
        assert main(["train", prog, "--no-such-flag", "--runs-dir", str(tmp_path)]) == 2
        assert "--no-such-flag" in capsys.readouterr().err
        assert main(["train", prog, "--seed", "x", "--runs-dir", str(tmp_path)]) == 2
    assert main(["train", "ppo", "--gamma", "2", "--runs-dir", str(tmp_path)]) == 1
    assert "gamma must be <= 1, got 2.0 (flag --gamma)" in capsys.readouterr().err
    assert main(["train", "grpo", "--precision", "float16", "--runs-dir", str(tmp_path)]) == 2
    assert main(["train", "grpo", "--top-p", "0", "--runs-dir", str(tmp_path)]) == 1
    assert "top_p must be in (0, 1], got 0.0 (flag --top-p)" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing started, no run folder


def test_config_file_aliases_and_unknown_keys(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("lr: 0.01\nenv-runners: 3\nhidden: [8, 8]\n")
    got = harness.read_config_file(str(f), PPOConfig)
    assert got == {"learning_rate": 0.01, "num_env_runners": 3, "hidden": (8, 8)}
    f.write_text("model: tiny\nsteps: 3\nadam_betas: [0.8, 0.9]\n")
    assert harness.read_config_file(str(f), GRPOConfig) == {
        "model": "tiny", "steps": 3, "adam_betas": (0.8, 0.9)
    }  # fmt: skip
    f.write_text("steps: 3\nstepz: 4\n")
    with pytest.raises(ValueError, match=f"--config {f}: unknown GRPO config key 'stepz'"):
        harness.read_config_file(str(f), GRPOConfig)
    assert grpo_cli(["--config", str(f), "--runs-dir", str(tmp_path)]) == 1
    assert "unknown GRPO config key 'stepz'" in capsys.readouterr().err
    f.write_text("- a list\n")
    with pytest.raises(ValueError, match="must hold a mapping of GRPOConfig fields"):
        harness.read_config_file(str(f), GRPOConfig)


def test_grpo_config_file_flags_win_and_tiny_preset(tmp_path):
    from phalanx.algorithms.grpo import _defaults

    f = tmp_path / "run.yaml"
    f.write_text("model: tiny\nsteps: 7\nlr: 0.002\n")
    d = _defaults(["--config", str(f)])
    assert (d.grpo.model, d.grpo.task, d.grpo.steps, d.grpo.lr) == (
        "tiny",
        "tiny-addition",
        7,
        0.002,
    )
    args = harness.parse_flags(type(d), ["--config", str(f), "--steps", "9"], d, "p", "")
    assert args.grpo.steps == 9 and args.grpo.lr == 0.002 and args.config == f


def test_fresh_run_names_never_reuse_a_folder(tmp_path):
    from phalanx.algorithms.grpo import resolve_run_dir

    assert harness.fresh_run_name("grpo-addition", tmp_path) == "grpo-addition"
    (tmp_path / "grpo-addition").mkdir()
    assert harness.fresh_run_name("grpo-addition", tmp_path) == "grpo-addition"  # empty
    (tmp_path / "grpo-addition" / "metrics.jsonl").write_text("")
    assert harness.fresh_run_name("grpo-addition", tmp_path) == "grpo-addition-2"
    cfg = resolve_run_dir(GRPOConfig(runs_dir=str(tmp_path), task="x/probs.jsonl"))
    assert (cfg.name, cfg.run_dir) == ("grpo-probs", str(tmp_path / "grpo-probs"))
    cfg = resolve_run_dir(GRPOConfig(runs_dir=str(tmp_path)))
    assert cfg.run_dir == str(tmp_path / "grpo-addition-2")
    assert resolve_run_dir(GRPOConfig(run_dir="elsewhere")).run_dir == "elsewhere"


def test_run_command_maps_outcomes_to_exit_codes(tmp_path, capsys):
    run = tmp_path / "run"

    def fail_at_start() -> int:
        run.mkdir()
        (run / "trace.json").write_text("{}")
        raise RayStartError("Ray did not start in 3 tries within 1 s")

    assert harness.run_command("p", PPOConfig, run, fail_at_start) == harness.RUNTIME_FAILURE
    assert "p: error: RayStartError: Ray did not start" in capsys.readouterr().err
    assert not run.exists()  # it had not started: no folder left behind

    def bad_value() -> int:
        raise ValueError("learning_rate must be > 0, got -1")

    assert harness.run_command("p", PPOConfig, run, bad_value) == harness.BAD_INPUT
    assert "(flag --learning-rate/--lr)" in capsys.readouterr().err

    def budget_spent() -> int:
        run.mkdir(exist_ok=True)
        (run / "metrics.jsonl").write_text("{}\n")
        return harness.BUDGET_SPENT

    assert harness.run_command("p", PPOConfig, run, budget_spent) == harness.BUDGET_SPENT
    status = json.loads((run / "status.json").read_text())
    assert status == {"status": "done", "exit_code": 3, "message": ""}


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_run_command_turns_signals_into_exit_codes(tmp_path, capsys, sig, code):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    cleaned = []
    # what was installed before (SIG_IGN for SIGINT when pytest runs as a background job)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def body() -> int:
        try:
            os.kill(os.getpid(), sig)
            raise AssertionError("the signal did not interrupt")
        finally:
            cleaned.append(True)

    assert harness.run_command("p", PPOConfig, run, body) == code
    assert cleaned == [True]
    err = capsys.readouterr().err
    assert f"p: interrupted by {signal.Signals(sig).name}" in err
    assert f"p: {run} keeps metrics.jsonl (resume with --resume --name run)" in err
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "interrupted" and status["exit_code"] == code
    assert {s: signal.getsignal(s) for s in before} == before  # restored


def test_tracing_announces_only_a_written_trace(tmp_path, capsys):
    from phalanx.observe import trace

    with harness.tracing(True, tmp_path):
        pass  # nothing traced (e.g. Ray never started)
    assert not (tmp_path / "trace.json").exists()
    assert "trace written" not in capsys.readouterr().out
    with harness.tracing(True, tmp_path), trace.span("phase"):
        pass
    assert (tmp_path / "trace.json").exists()
    assert f"trace written to {tmp_path / 'trace.json'}" in capsys.readouterr().out


def test_precision_auto_picks_bf16_only_on_fast_hardware(tmp_path):
    avx2 = {"fpu", "avx", "avx2", "fma"}
    assert resolve_precision("auto", cuda=False, flags=avx2) == "float32"
    assert resolve_precision("auto", cuda=False, flags=avx2 | {"avx512_bf16"}) == "bfloat16"
    assert resolve_precision("auto", cuda=False, flags=avx2 | {"amx_bf16"}) == "bfloat16"
    assert resolve_precision("auto", cuda=True, flags=avx2) == "bfloat16"
    assert resolve_precision("bfloat16", cuda=False, flags=avx2) == "bfloat16"  # forced
    assert resolve_precision("float32", cuda=True) == "float32"
    with pytest.raises(ValueError, match="generation_precision must be one of auto, float32"):
        resolve_precision("fp16", "generation_precision")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "none")) == set()
    # this machine (AVX2, no AVX-512 BF16/AMX, no GPU) gets fp32
    if not ({"avx512_bf16", "amx_bf16"} & cpu_flags()):
        assert not has_fast_bf16(cuda=False)
    assert GRPOConfig().precision == "auto"


@pytest.mark.timeout(120)
@pytest.mark.smoke
def test_ppo_budget_spent_exits_3_with_tensorboard_events(tmp_path, capsys):
    """In this process (no env runner processes, no Ray): the budget ends before
    --stop-return, exit 3; TensorBoard's event files are written when it is installed."""
    argv = ["train", "ppo", "--env-runners", "0", "--envs-per-runner", "4",
            "--rollout-length", "32", "--minibatch-size", "64", "--max-timesteps", "256",
            "--stop-return", "1e9", "--name", "b", "--runs-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(argv) == harness.BUDGET_SPENT
    assert "stop return 1000000000.0 not reached within 256 timesteps" in capsys.readouterr().out
    run = tmp_path / "b"
    assert json.loads((run / "status.json").read_text())["exit_code"] == 3
    pytest.importorskip("tensorboard")
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 100


def test_generation_precision_follows_the_policys_and_a_mismatch_is_refused():
    """A refit sends the policy's dtype and the generators hold it as is: on a GPU the tiny
    config once gave a bf16 policy and fp32 generators, and the first refit failed."""
    from phalanx.algorithms.grpo_config import GRPOConfig

    assert GRPOConfig.tiny(precision="bfloat16").precisions() == ("bfloat16", "bfloat16")
    assert GRPOConfig.tiny(precision="float32").precisions() == ("float32", "float32")
    both = GRPOConfig.tiny(precision="bfloat16", generation_precision="bfloat16")
    assert both.precisions() == ("bfloat16", "bfloat16")
    bad = GRPOConfig.tiny(precision="bfloat16", generation_precision="float32")
    with pytest.raises(ValueError, match="generation_precision=float32 resolves to float32 but"):
        bad.validate()
