"""SIGINT/SIGTERM stop a real PPO or GRPO run (a subprocess with its own Ray) within 10 s:
exit 130/143, the run folder keeps its checkpoint and metrics, nothing left running, no
/dev/shm segment of the run left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from phalanx.algorithms.run_checkpoints import latest_checkpoint
from tests.helpers import until

# What these runs check (their own Ray stopped with them) needs a fresh process and Ray.
_OWN_RAY = "a CLI run in a fresh process that starts its own Ray, then is signalled"


def _metrics_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _run_and_interrupt(
    argv: list[str], run: Path, sig: int, started, whole_job: bool = False
) -> tuple[int, float, str]:
    """Start ``phalanx train`` with ``argv`` (in a session of its own), wait for
    ``started(rows)``, send ``sig`` to it (``whole_job``: to every process of its session,
    Ray's included, as Slurm and ``timeout`` do); returns (exit status, seconds from the
    signal to exit, stderr), after checking that none of its processes and none of their
    /dev/shm segments outlive it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "train", *argv], start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert until(lambda: started(_metrics_rows(run)) or proc.poll() is not None, 240), (
            "the run reported no progress"
        )
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        family = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        t_signal = time.monotonic()
        if whole_job:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not exit within 60 s of the signal\n{_stuck(proc)}")
        elapsed = time.monotonic() - t_signal
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert until(lambda: not [p for p in family if psutil.pid_exists(p) and _alive(p)], 30), [
        psutil.Process(p).cmdline() for p in family if psutil.pid_exists(p)
    ]
    left = [n for n in os.listdir("/dev/shm") if any(f"_{p}-" in n for p in family)]
    assert left == [], left
    return code, elapsed, err


def _stuck(proc: subprocess.Popen) -> str:
    """What a run that does not exit is doing: its threads' Python stacks (py-spy) and the
    end of what it wrote to stderr so far."""
    exe = shutil.which("py-spy")
    if exe is None:
        stacks = "(py-spy is not installed)"
    else:
        dump = subprocess.run(
            [exe, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60
        )
        stacks = (dump.stdout or dump.stderr)[-8000:]
    os.set_blocking(proc.stderr.fileno(), False)
    err = proc.stderr.read() or ""
    return f"py-spy dump of pid {proc.pid}:\n{stacks}\nstderr:\n{err[-3000:]}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _check_ppo_run_folder(run: Path, err: str, sig: int, code: int) -> None:
    """What an interrupted PPO run leaves: one line naming the signal, the folder's
    checkpoint and metrics, and a ``status.json`` saying it was interrupted."""
    assert f"interrupted by {signal.Signals(sig).name}" in err
    assert f"{run} keeps " in err and "checkpoints" in err
    assert latest_checkpoint(run) is not None and len(_metrics_rows(run)) >= 2
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "interrupted" and status["exit_code"] == code


_PPO_ARGV = ["ppo", "--env-runners", "1", "--max-timesteps", "100000000", "--name", "r",
             "--checkpoint-every", "1", "--no-progress"]  # fmt: skip


@pytest.mark.slow(reason=_OWN_RAY)
@pytest.mark.timeout(300)
def test_ppo_run_stops_on_ctrl_c(tmp_path):
    run = tmp_path / "r"
    argv = [*_PPO_ARGV, "--runs-dir", str(tmp_path)]
    code, elapsed, err = _run_and_interrupt(argv, run, signal.SIGINT, lambda rows: len(rows) >= 2)
    assert code == 130, err[-3000:]
    assert elapsed < 10, elapsed
    _check_ppo_run_folder(run, err, signal.SIGINT, 130)


@pytest.mark.slow(reason=_OWN_RAY)
@pytest.mark.timeout(300)
def test_ppo_run_stops_when_the_whole_job_gets_sigterm(tmp_path):
    """SIGTERM to every process of the run's session, Ray's own included, as Slurm and
    ``timeout`` send it (a SIGTERM to the run alone takes the same path in the run as the
    Ctrl-C above). The clean-up's actor-name lookups would block for good on the dead
    raylet; they give up, and the run still exits 143 in bounded time."""
    run = tmp_path / "r"
    argv = [*_PPO_ARGV, "--runs-dir", str(tmp_path)]
    code, elapsed, err = _run_and_interrupt(
        argv, run, signal.SIGTERM, lambda rows: len(rows) >= 2, whole_job=True
    )
    assert code == 143, err[-3000:]
    assert elapsed < 25, elapsed
    _check_ppo_run_folder(run, err, signal.SIGTERM, 143)


@pytest.mark.slow(reason=_OWN_RAY)
@pytest.mark.timeout(400)
def test_grpo_run_stops_on_ctrl_c(tmp_path):
    argv = ["grpo", "--model", "tiny", "--name", "g", "--runs-dir", str(tmp_path),
            "--steps", "1000", "--prompts-per-step", "2", "--samples-per-prompt", "2",
            "--train-micro-batch-size", "2", "--warmup-steps", "0", "--eval-every", "0",
            "--checkpoint-every", "1", "--num-policy-workers", "1", "--no-progress"]  # fmt: skip
    run = tmp_path / "g"
    first_checkpoint = run / "checkpoints" / "step_1" / "state.json"  # written after the row

    def started(rows: list[dict]) -> bool:
        return any("reward_mean" in r for r in rows) and first_checkpoint.exists()

    code, elapsed, err = _run_and_interrupt(argv, run, signal.SIGINT, started)
    assert code == 130, err[-3000:]
    assert elapsed < 10, elapsed
    assert "interrupted by SIGINT" in err and f"{run} keeps " in err
    assert (run / "checkpoints").is_dir() and (run / "status.json").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_that_arrives_inside_ray_get_is_named(cluster, tmp_path, capsys, sig, code):
    """Ray replaces whatever a signal handler raises inside ``ray.get`` with a plain
    ``KeyboardInterrupt``; the harness still exits with the status of the signal that came
    (a real GRPO run spends most of its driver time in ``ray.get``)."""
    import asyncio

    import ray

    from phalanx.algorithms import _harness as harness
    from phalanx.algorithms.ppo import PPOConfig

    @ray.remote(num_cpus=0)
    class Never:
        async def finish(self) -> None:
            await asyncio.Event().wait()  # nothing sets it: the driver's get stays blocked

    never = Never.remote()
    main = threading.main_thread().ident

    def main_thread_in_ray_get() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "get" and f"ray{os.sep}_private" in code.co_filename:
                return True
            frame = frame.f_back
        return False

    def signal_once_waiting() -> None:
        if until(main_thread_in_ray_get, 30):
            os.kill(os.getpid(), sig)

    def body() -> int:
        threading.Thread(target=signal_once_waiting, daemon=True).start()
        ray.get(never.finish.remote(), timeout=60)
        raise AssertionError("the signal did not interrupt")

    try:
        assert harness.run_command("p", PPOConfig, tmp_path / "run", body) == code
    finally:
        ray.kill(never)
    assert f"p: interrupted by {signal.Signals(sig).name}" in capsys.readouterr().err
