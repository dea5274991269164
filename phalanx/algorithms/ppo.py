"""PPO on gymnasium environments with phalanx env runners (CleanRL style).

Read top to bottom: advantage estimation (``gae``), the loss and update (``ppo_update``),
the training loop (``train``: one labelled phase per part of an iteration), what the loop
records (its metrics row and summary) and the command line (``cli``). Start-up,
checkpoints and the end of a run are in ``ppo_run.py``; the hyperparameters
(``PPOConfig``) and the values tuned per env (``TUNED``) in ``ppo_config.py``.

Sampling runs on an :class:`~phalanx.envs.EnvRunnerGroup`: ``num_env_runners`` remote
runners (or the local runner when 0), each stepping ``num_envs_per_env_runner`` envs for
``rollout_fragment_length`` steps per iteration. The learner trains in this process
(``num_learners=0``) or in a worker process that is restarted in place when it dies
(``num_learners=1``, ``ppo_learner.py``); either way this process keeps the policy that
the runners' weight sync and the checkpoints read. In ``async_sampling`` mode the
runners sample the next batch while the learner trains on the current one, so each
batch was collected with weights one version behind the learner (``policy_lag`` in the
metrics). A runner that dies is left out of that round, restarted by the group, and
given the current weights and normaliser before it samples again; ``restarts`` in the
metrics counts it and a ``recovery/*`` row says how long it took.

Start-up overlaps (``ppo_run.start_run``): a helper thread imports torch and builds the
learner while this thread starts Ray and the env runners, so torch is imported inside
the functions that use it. Every run ends with a breakdown of its wall time
(``WallBreakdown``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo_config import TUNED, PPOConfig
from phalanx.algorithms.ppo_learner import RemoteLearner
from phalanx.algorithms.ppo_run import (
    Learner,
    build_learner,
    build_policy,
    load_checkpoint,
    open_metrics,
    open_run,
    plot_run,
    save_checkpoint,
    save_learner,
    start_run,
    stop_run,
)
from phalanx.algorithms.worker_recoveries import RestartWatch, console_line, recovery_row
from phalanx.observe.breakdown import WallBreakdown, process_age_s

if TYPE_CHECKING:
    import torch

    from phalanx.envs import EnvRunnerGroup
__all__ = [
    "TUNED",
    "PPOConfig",
    "build_learner",
    "build_policy",
    "cli",
    "gae",
    "load_checkpoint",
    "save_checkpoint",
    "train",
]


# ---------------------------------------------------------------------------- advantages
def gae(batch: dict[str, np.ndarray], gamma: float, lam: float, reward_scale: float = 1.0):
    """Advantages and value targets of one runner's time-major batch ``[T, N]``.

    Truncated (not terminated) steps get ``gamma * V(final_obs)`` added to their reward:
    the episode was cut, not ended, so its return continues past the cut.
    """
    rewards = batch["rewards"] * reward_scale
    terms, truncs = batch["terminateds"], batch["truncateds"]
    rewards = rewards + gamma * batch["final_values"] * (truncs & ~terms)
    values = batch["values"]
    not_done = 1.0 - (terms | truncs).astype(np.float32)
    adv = np.zeros_like(rewards)
    last = np.zeros(rewards.shape[1], np.float32)
    next_values = batch["last_values"]
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_values * not_done[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        adv[t] = last
        next_values = values[t]
    return adv, adv + values


def flatten_batches(batches: list[dict[str, Any]], cfg: PPOConfig) -> dict[str, torch.Tensor]:
    """One learner batch: every runner's steps, with advantages, as flat tensors."""
    import torch

    parts: dict[str, list[np.ndarray]] = {
        k: [] for k in ("obs", "actions", "logp", "values", "adv", "ret")
    }
    for b in batches:
        adv, ret = gae(b, cfg.gamma, cfg.gae_lambda, cfg.reward_scale)
        T, N = b["rewards"].shape
        parts["obs"].append(b["obs"].reshape(T * N, *b["obs"].shape[2:]))
        parts["actions"].append(b["actions"].reshape(T * N, *b["actions"].shape[2:]))
        for k, v in (("logp", b["logp"]), ("values", b["values"]), ("adv", adv), ("ret", ret)):
            parts[k].append(v.reshape(T * N))
    return {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}


# ---------------------------------------------------------------------------- update
def ppo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: dict[str, torch.Tensor],
    cfg: PPOConfig,
) -> dict[str, float]:
    """``update_epochs`` passes of clipped-surrogate minibatch SGD over ``data``."""
    import torch

    n = data["obs"].shape[0]
    mb = min(cfg.minibatch_size, n)
    vf_clip = cfg.clip_coef if cfg.vf_clip_coef is None else cfg.vf_clip_coef
    stats: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("policy", "value", "entropy", "kl", "clipfrac")
    }
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for _epoch in range(cfg.update_epochs):
        perm = torch.randperm(n)
        for start in range(0, n - mb + 1, mb):
            idx = perm[start : start + mb]
            logp, entropy, values = policy.evaluate(data["obs"][idx], data["actions"][idx])
            log_ratio = logp - data["logp"][idx]
            ratio = log_ratio.exp()
            adv = data["adv"][idx]
            if cfg.norm_adv and len(idx) > 1:
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            # clipped surrogate
            pg_loss = torch.max(
                -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
            ).mean()
            # value loss, optionally clipped around the sampling-time values
            ret = data["ret"][idx]
            if cfg.clip_vloss:
                old_v = data["values"][idx]
                v_clipped = old_v + (values - old_v).clamp(-vf_clip, vf_clip)
                v_loss = 0.5 * torch.max((values - ret) ** 2, (v_clipped - ret) ** 2).mean()
            else:
                v_loss = 0.5 * ((values - ret) ** 2).mean()
            ent = entropy.mean()
            loss = pg_loss - cfg.ent_coef * ent + cfg.vf_coef * v_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=True)
            optimizer.step()
            with torch.no_grad():  # kept as tensors: one sync per update, not per minibatch
                stats["kl"].append(((ratio - 1) - log_ratio).mean())
                stats["clipfrac"].append(((ratio - 1).abs() > cfg.clip_coef).float().mean())
                stats["policy"].append(pg_loss.detach())
                stats["value"].append(v_loss.detach())
                stats["entropy"].append(ent.detach())
        if cfg.target_kl is not None:
            epoch_kl = torch.stack(stats["kl"][-(n // mb) :]).mean().item()
            if epoch_kl > cfg.target_kl:
                break
    y, v = data["ret"].numpy(), data["values"].numpy()
    var_y = float(np.var(y))
    means = {k: float(torch.stack(s).mean()) for k, s in stats.items()}
    out = {f"loss/{k}": means[k] for k in ("policy", "value", "entropy", "kl")}
    out["clipfrac"] = means["clipfrac"]
    out["explained_variance"] = float("nan") if var_y == 0 else 1 - float(np.var(y - v)) / var_y
    return out


# ---------------------------------------------------------------------------- training
def train(
    cfg: PPOConfig,
    *,
    resume: bool = False,
    cluster: Any = None,
    progress: bool | None = None,
    on_iteration: Callable[[dict[str, Any], Any], bool | None] | None = None,
    times: WallBreakdown | None = None,
    on_update: Callable[[Learner], None] | None = None,
) -> dict[str, Any]:
    """Run PPO until ``max_timesteps`` or ``stop_return``; returns a summary dict.

    Writes ``runs_dir/name/metrics.jsonl``, ``checkpoints/step_<iteration>`` and
    ``learning_curve.png``. ``resume`` continues from the newest checkpoint (step count,
    policy, optimizer, normaliser). ``on_iteration(metrics, env_runner_group)`` is called
    after every iteration; a true return value stops the run there. ``times`` collects
    the wall-time breakdown (the summary's ``breakdown``; a new one when not given).
    ``on_update(learner)`` is called before every update (tests act on the learner's
    worker, ``learner.remote``, there).
    """
    from phalanx.observe.phases import StepPhases
    from phalanx.observe.progress import Progress

    t_start = time.perf_counter()
    times = times if times is not None else WallBreakdown()
    cfg, run_dir, ckpt = open_run(cfg, resume)
    runners, learner = start_run(cfg, ckpt, cluster, times, start_learner_worker)
    policy, optimizer = learner.policy, learner.optimizer
    runner_restarts = RestartWatch(lambda: runners.remote_group)
    log = open_metrics(cfg, run_dir, learner, ckpt)
    bar = Progress(
        total=cfg.max_timesteps, start=learner.timesteps, title=f"PPO {cfg.env}", enabled=progress
    )
    phases = StepPhases(bar, breakdown=times)
    clock = RunClock(t_start, time.perf_counter(), learner.timesteps)
    recent: deque[float] = deque(maxlen=cfg.stop_window)
    reached_at: float | None = None
    stopped = False
    synced = True  # the runners hold the learner's current weights
    row: dict[str, Any] = {}
    pending = runners.sample_async()
    try:
        while learner.timesteps < cfg.max_timesteps and reached_at is None and not stopped:
            phases.new_step()
            t_iter = time.perf_counter()
            # 1. collect the round in flight
            with phases("rollout", "rollouts from the env runners", breakdown="sampling (waited)"):
                batches = runners.collect_samples(pending)
            # 2. asynchronous mode: the runners, idle now, get the weights trained on the
            #    previous batch and sample the next round while this one trains
            with phases("weight_sync", "weight sync", breakdown="weight sync"):
                if cfg.normalize_observations:
                    runners.sync_env_runner_states(env_steps_sampled=learner.timesteps)
                if cfg.async_sampling:
                    if not synced:
                        runners.sync_weights(
                            from_worker_or_learner_group=policy, timeout_seconds=None
                        )
                    synced = True
                    pending = runners.sample_async()
            if not batches:  # every runner died during the round; they are being restarted
                if not cfg.async_sampling:
                    pending = runners.sample_async()
                continue
            # 3. learn: advantages per runner (GAE), then clipped-surrogate minibatch epochs
            learner_version = runners.weights_version
            before = (learner.timesteps, learner.iteration, learner.episodes)
            new_returns = count_iteration(learner, batches)
            recent.extend(new_returns)
            if stop_return_reached(cfg, recent):  # this batch's policy made it; it still trains
                reached_at = time.perf_counter() - t_start
            if cfg.anneal_lr:
                optimizer.param_groups[0]["lr"] = annealed_lr(cfg, learner.timesteps)
            if on_update is not None:
                on_update(learner)
            with phases("train", "learning", breakdown="learning"):
                stats = learn(learner, flatten_batches(batches, cfg), cfg, before, bar, log)
            synced = False
            # 4. synchronous mode: weights out, next round in
            if not cfg.async_sampling:
                with phases("weight_sync", "weight sync", breakdown="weight sync"):
                    runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
                    synced = True
                    pending = runners.sample_async()
            # 5. metrics, the stop callback and the periodic checkpoint
            with phases("metrics", "metrics", breakdown="metrics and progress"):
                row = iteration_row(
                    learner,
                    episode_metrics(batches, new_returns, recent),
                    stats,
                    clock.metrics(phases.times, t_iter, learner.timesteps),
                    runner_metrics(runners, batches, learner_version),
                )
                log.log(learner.timesteps, row)
                log_runner_restarts(runner_restarts, runners, learner, bar, log)
                bar.update(learner.timesteps, {**row, "return_mean": row["return_mean_recent"]})
            stopped = on_iteration is not None and bool(on_iteration(row, runners))
            if learner.iteration % cfg.checkpoint_every == 0 and reached_at is None and not stopped:
                with phases("checkpoint", breakdown="checkpoints"):
                    save_learner(run_dir, learner, runners, cfg)
    finally:
        bar.close()
        log.close()
        train_loop_s = time.perf_counter() - clock.loop
        restarts = stop_run(run_dir, learner, runners, cfg, times)
    with times.phase("plotting"):
        plot_run(run_dir)
    wall = time.perf_counter() - t_start
    times.save(run_dir, wall)
    return run_summary(
        learner,
        recent,
        run_dir,
        times,
        wall=wall,
        train_loop_s=train_loop_s,
        reached_at=reached_at,
        stopped=stopped,
        steps_per_s=row.get("throughput/steps_per_s", float("nan")),
        restarts=restarts,
    )


def learn(learner: Learner, data: dict[str, torch.Tensor], cfg: PPOConfig,
          before: tuple[int, int, int], bar: Any, log: Any) -> dict[str, float]:  # fmt: skip
    """One update on the iteration's batch: in this process (``num_learners=0``) or on
    the learner's worker, redone there on the same batch if its process dies under it.
    If the update fails for good, the counters go back to ``before``, the last finished
    iteration's, which the kept state (and so the final checkpoint) holds."""
    remote = learner.remote
    if remote is None:
        return ppo_update(learner.policy, learner.optimizer, data, cfg)
    try:
        stats = remote.update(data, learner.optimizer.param_groups[0]["lr"], bar, log)
    except BaseException:
        learner.timesteps, learner.iteration, learner.episodes = before
        raise
    return {**stats, "time/keep_state": remote.keep_seconds}


def start_learner_worker(cfg: PPOConfig, cluster: Any, name: str) -> RemoteLearner:
    """The learner's worker (``num_learners=1``), running :func:`ppo_update`."""
    return RemoteLearner(cfg, cluster, name, ppo_update)


def count_iteration(learner: Learner, batches: list[dict[str, Any]]) -> list[float]:
    """Add one iteration's steps, episodes and the iteration itself to the learner's
    counters; returns the returns of the episodes that ended in it."""
    new_returns = [r for b in batches for r in b["episode_returns"]]
    learner.timesteps += sum(b["timesteps"] for b in batches)
    learner.iteration += 1
    learner.episodes += len(new_returns)
    return new_returns


def log_runner_restarts(
    watch: RestartWatch, runners: EnvRunnerGroup, learner: Learner, bar: Any, log: Any
) -> None:
    """A ``recovery/*`` row and a console line for each env runner restarted since the
    last iteration (the round it died in went on without it)."""
    for r in watch.new():
        reason = f"{runners.remote_group.name}[rank {r.rank}]: {r.reason}"
        extra = {"recovery/iteration": learner.iteration, "recovery/reason": reason}
        log.log(learner.timesteps, recovery_row(r, "env_runner", learner.timesteps, **extra))
        console_line(
            bar,
            f"[ppo] iteration {learner.iteration}: env runner {reason}; restarted and given "
            f"the current weights in {r.seconds:.1f} s (its new process: "
            f"{r.start_seconds:.1f} s)",
        )


def stop_return_reached(cfg: PPOConfig, recent: deque[float]) -> bool:
    """Whether the mean of the last ``stop_window`` returns reached ``stop_return``
    (over at least ``min(stop_window, stop_min_episodes)`` episodes)."""
    enough = len(recent) >= min(cfg.stop_window, cfg.stop_min_episodes)
    return cfg.stop_return is not None and enough and float(np.mean(recent)) >= cfg.stop_return


def annealed_lr(cfg: PPOConfig, timesteps: int) -> float:
    """The learning rate after ``timesteps`` steps with ``anneal_lr``: falling linearly
    from ``learning_rate`` to 0 at ``max_timesteps``, but not below ``lr_floor`` of it."""
    frac = max(1.0 - timesteps / cfg.max_timesteps, cfg.lr_floor)
    return frac * cfg.learning_rate


@dataclass
class RunClock:
    """The run's wall-clock marks, for the ``time/*`` and throughput metrics.

    Args:
        start: when ``train`` started (``time.perf_counter()``).
        loop: when its loop started.
        loop_timesteps: the step count then (a resumed run's is the checkpoint's).
    """

    start: float
    loop: float
    loop_timesteps: int

    def metrics(self, phases: dict[str, float], t_iter: float, timesteps: int) -> dict[str, float]:
        """The seconds of this iteration's phases (``phases``) and of the whole iteration
        (begun at ``t_iter``), the run's seconds so far, and the loop's env steps/s."""
        now = time.perf_counter()
        return {
            **{f"time/{k}": phases.get(k, 0.0) for k in ("rollout", "train", "weight_sync")},
            "time/step": now - t_iter,
            "time/total": now - self.start,
            "throughput/steps_per_s": (timesteps - self.loop_timesteps)
            / max(now - self.loop, 1e-9),
        }


def iteration_row(
    learner: Learner,
    episodes: dict[str, float],
    stats: dict[str, float],
    timing: dict[str, float],
    runners: dict[str, int],
) -> dict[str, Any]:
    """One iteration's row of ``metrics.jsonl``: the learner's counters, then the
    episodes' (``episode_metrics``), the update's ``stats``, the learning rate, the
    ``timing`` (``RunClock.metrics``), the runners' (``runner_metrics``) and the learner's
    worker's restarts."""
    return {
        "timesteps": learner.timesteps,
        "iteration": learner.iteration,
        "episodes": learner.episodes,
        **episodes,
        **stats,
        "lr": learner.optimizer.param_groups[0]["lr"],
        **timing,
        **runners,
        "learner_restarts": 0 if learner.remote is None else learner.remote.restarts,
    }


def run_summary(
    learner: Learner,
    recent: deque[float],
    run_dir: Path,
    times: WallBreakdown,
    *,
    wall: float,
    train_loop_s: float,
    reached_at: float | None,
    stopped: bool,
    steps_per_s: float,
    restarts: int,
) -> dict[str, Any]:
    """What ``train`` returns: the counters, the recent mean return, how the run ended
    (``reached_at``: seconds to the stop return, or None; ``stopped`` by the callback),
    its seconds, the last env steps/s, the restarts and the wall-time breakdown."""
    return {
        "timesteps": learner.timesteps,
        "iterations": learner.iteration,
        "episodes": learner.episodes,
        "return_mean_recent": float(np.mean(recent)) if recent else float("nan"),
        "reached_stop_return": reached_at is not None,
        "stopped_by_callback": stopped,
        "time_to_stop_return_s": reached_at,
        "wall_time_s": wall,
        "train_loop_s": train_loop_s,
        "steps_per_s": steps_per_s,
        "restarts": restarts,
        "learner_restarts": 0 if learner.remote is None else learner.remote.restarts,
        "run_dir": str(run_dir),
        "breakdown": times.as_dict(wall),
    }


def episode_metrics(
    batches: list[dict[str, Any]], new_returns: list[float], recent: deque[float]
) -> dict[str, float]:
    """Returns and lengths of the episodes that ended in this iteration, and the mean of
    the recent ones (NaN where there are none)."""
    lengths = [x for b in batches for x in b["episode_lengths"]]

    def mean(xs: Any) -> float:
        return float(np.mean(xs)) if len(xs) else float("nan")

    return {
        "return_mean": mean(new_returns),
        "return_std": float(np.std(new_returns)) if new_returns else float("nan"),
        "return_mean_recent": mean(recent),
        "episode_len_mean": mean(lengths),
    }


def runner_metrics(
    runners: EnvRunnerGroup, batches: list[dict[str, Any]], learner_version: int
) -> dict[str, int]:
    """The env runners' restarts and health, the weights' version, and how many versions
    the learner was ahead of the weights that sampled this batch (``policy_lag``)."""
    return {
        "restarts": runners.num_remote_worker_restarts(),
        "healthy_env_runners": runners.num_healthy_remote_workers(),
        "weights_version": runners.weights_version,
        "policy_lag": learner_version - min(b["weights_version"] for b in batches),
        "batch_runners": len(batches),
    }


# ---------------------------------------------------------------------------- command line
@dataclass
class TrainPPO:
    """PPO on a gymnasium env with phalanx env runners. Defaults shown are the values tuned
    for --env; a --config YAML file sets any PPOConfig field (env_config too) and flags win
    over it."""

    ppo: PPOConfig
    config: Path | None = None
    """YAML file of PPOConfig fields or their flag names (unknown keys are an error)"""
    resume: bool = False
    """continue <runs-dir>/<name> from its checkpoint (step count, policy, optimizer, normaliser)"""
    trace: bool = False
    """record a trace of group calls into the run folder (open it in ui.perfetto.dev)"""
    progress: bool = True
    """live progress display (--no-progress: none)"""


def _defaults(argv: list[str]) -> TrainPPO:
    """What flags not given fall back to: the checkpoint's config (``--resume``) or the
    tuned values of the env, then the ``--config`` file on top."""
    known = harness.preparse(argv, "--env", "--config", "--name", "--runs-dir", "--resume")
    from_file = harness.read_config_file(known.config, PPOConfig) if known.config else {}
    name = known.name or from_file.get("name")
    if known.resume:
        if not name:
            raise ValueError("--resume needs --name (the run to continue)")
        runs_dir = known.runs_dir or from_file.get("runs_dir") or PPOConfig.runs_dir
        ckpt = load_checkpoint(Path(runs_dir) / name)
        saved = harness.check_keys(ckpt["config"], PPOConfig, f"checkpoint of {name}")
        return TrainPPO(ppo=PPOConfig(**{**saved, **from_file}), resume=True)
    env = known.env or from_file.get("env") or PPOConfig.env
    return TrainPPO(
        ppo=PPOConfig.for_env(env, **{k: v for k, v in from_file.items() if k != "env"})
    )


def cli(argv: list[str]) -> int:
    """``phalanx train ppo [flags]``; returns the exit status (``_harness.EXIT_CODES``)."""
    prog = "phalanx train ppo"
    try:
        default = _defaults(argv)
        args = harness.parse_flags(TrainPPO, argv, default, prog, TrainPPO.__doc__ or "")
        cfg = args.ppo
        cfg.validate()
        if args.resume and not default.resume:
            raise ValueError("--resume needs --name (the run to continue)")
        if cfg.name is None:
            cfg = replace(cfg, name=harness.fresh_run_name(f"ppo-{cfg.env}", cfg.runs_dir))
    except SystemExit as e:  # --help, or a usage error tyro explained
        return int(e.code or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        return harness.bad_input(prog, e, PPOConfig)
    run_dir = Path(cfg.runs_dir) / cfg.name
    return harness.run_command(prog, PPOConfig, run_dir, lambda: _run(cfg, args, run_dir))


def _run(cfg: PPOConfig, args: TrainPPO, run_dir: Path) -> int:
    """Train, print the summary and the wall-time table; DONE or BUDGET_SPENT."""
    started_s = process_age_s()  # interpreter start-up, imports and parsing
    times = WallBreakdown()
    times.add("python start-up and imports", started_s)
    with harness.tracing(args.trace, run_dir):
        summary = train(cfg, resume=args.resume, progress=args.progress, times=times)
    total = process_age_s()
    if summary["time_to_stop_return_s"] is not None:
        summary["time_to_stop_return_s"] += started_s
    summary["process_wall_s"] = total
    summary["breakdown"] = times.as_dict(total)
    times.save(summary["run_dir"], total)
    print(json.dumps(summary, indent=2))
    print(times.table(total, title="wall time since the process started"))
    reached = summary["time_to_stop_return_s"]
    print(
        f"{cfg.env}: {summary['timesteps']:,} timesteps, mean return "
        f"{summary['return_mean_recent']:.1f}"
        + (f" (stop return reached {reached:.1f} s after start)" if reached is not None else "")
        + f", {summary['steps_per_s']:,.0f} env steps/s, {summary['restarts']} env runner "
        f"restarts, {summary['learner_restarts']} learner restarts; "
        f"run folder {summary['run_dir']}"
    )
    if cfg.stop_return is not None and not summary["reached_stop_return"]:
        print(f"stop return {cfg.stop_return} not reached within {cfg.max_timesteps} timesteps")
        return harness.BUDGET_SPENT
    return harness.DONE
