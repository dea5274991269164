"""PPO on gymnasium environments with phalanx env runners (CleanRL style).

Read top to bottom: advantage estimation (``gae``), the loss and update (``ppo_update``),
checkpoints, start-up, the training loop (``train``) and the command line (``cli``). The
hyperparameters (``PPOConfig``) and the values tuned per env (``TUNED``) are in
``ppo_config.py``.

Sampling runs on an :class:`~phalanx.envs.EnvRunnerGroup`: ``num_env_runners`` remote
runners (or the local runner when 0), each stepping ``num_envs_per_env_runner`` envs for
``rollout_fragment_length`` steps per iteration. The learner is this process. In
``async_sampling`` mode the runners sample the next batch while the learner trains on
the current one, so each batch was collected with weights one version behind the
learner (``policy_lag`` in the metrics). A runner that dies is left out of that round,
restarted by the group, and given the current weights and normaliser before it samples
again; ``restarts`` in the metrics counts it.

Start-up overlaps: Ray and the env runners start on a helper thread while this thread
imports torch and builds the learner (torch is therefore imported inside the functions
that use it). Every run ends with a breakdown of its wall time (``WallBreakdown``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo_config import TUNED, PPOConfig
from phalanx.observe.breakdown import WallBreakdown, process_age_s

if TYPE_CHECKING:
    import torch

CHECKPOINT_FILE = "checkpoint.pt"
__all__ = ["TUNED", "PPOConfig", "build_policy", "cli", "gae", "load_checkpoint", "train"]


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


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, policy: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    connector: dict[str, Any], timesteps: int, iteration: int, episodes: int,
                    cfg: PPOConfig, spaces: tuple[Any, Any]) -> None:  # fmt: skip
    """Policy, optimizer, normaliser and counters; written atomically.

    A write that fails (a full disk) raises ``OSError`` naming ``path`` and the errno
    (``ENOSPC``); the previous checkpoint stays and no partial file is left.
    """
    import torch

    tmp = path.with_suffix(".tmp")
    buf = io.BytesIO()  # serialised first: a failed write then is a plain OSError
    torch.save(
        {
            "policy": policy.state_dict(),
            "optimizer": optimizer.state_dict(),
            "connector": connector,
            "timesteps": timesteps,
            "iteration": iteration,
            "episodes": episodes,
            "config": asdict(cfg),
            "observation_space": spaces[0],
            "action_space": spaces[1],
        },
        buf,
    )
    try:
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
        raise OSError(
            e.errno,
            f"could not write the checkpoint {path} ({code}: {e.strerror or e}); the "
            "previous checkpoint is kept",
        ) from None


_CHECKPOINT_KEYS = ("policy", "optimizer", "connector", "timesteps", "iteration", "episodes",
                    "config", "observation_space", "action_space")  # fmt: skip


def load_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint of ``run_dir`` (a ``runs/<name>`` folder or the file itself).

    ``FileNotFoundError`` or ``ValueError`` naming the file when it is missing, unreadable
    or not a PPO checkpoint.
    """
    import torch

    path = Path(run_dir)
    if path.is_dir() or (not path.exists() and path.suffix != ".pt"):
        path = path / CHECKPOINT_FILE
    if not path.exists():
        raise FileNotFoundError(f"no PPO checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a damaged file
        raise ValueError(
            f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}: {e})"
        ) from None
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {path} is not a PPO checkpoint (missing {missing})")
    harness.check_keys(ckpt["config"], PPOConfig, f"checkpoint {path}")
    return ckpt


_NETWORK_FIELDS = ("env", "env_config", "hidden", "activation")  # what shapes the policy


def check_resumable(ckpt: dict[str, Any], cfg: PPOConfig, path: Path) -> None:
    """``ValueError`` naming the field and ``path`` when the checkpoint's policy was built
    for another environment or network than ``cfg``'s (checked before anything starts)."""
    saved = ckpt["config"]
    for name in _NETWORK_FIELDS:
        was, now = saved.get(name), getattr(cfg, name)
        if isinstance(was, list):
            was = tuple(was)
        if name in saved and was != now:
            raise ValueError(
                f"{name}: the checkpoint {path} was trained with {name}={was!r}, not "
                f"{now!r}; --resume continues a run with its own environment and network "
                "(start a new run under another --name)"
            )


def build_policy(cfg: PPOConfig, observation_space: Any, action_space: Any) -> torch.nn.Module:
    from phalanx.envs.policy import ActorCritic

    return ActorCritic(
        observation_space, action_space, cfg.hidden, cfg.activation, cfg.init_log_std
    )


# ---------------------------------------------------------------------------- start-up
@dataclass
class Learner:
    """The learner's state: policy, optimizer, spaces and counters."""

    policy: Any
    optimizer: Any
    spaces: tuple[Any, Any]
    timesteps: int = 0
    iteration: int = 0
    episodes: int = 0


def build_learner(cfg: PPOConfig, ckpt: dict[str, Any] | None) -> Learner:
    """Policy and optimizer (from the checkpoint when given); runs on the start-up thread
    while Ray and the runners start, so torch is imported here."""
    import gymnasium as gym
    import torch

    import phalanx.weights.sender  # noqa: F401  (imported now, not at the first sync)

    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    env = gym.make(cfg.env, disable_env_checker=True, **cfg.env_config)
    spaces = (env.observation_space, env.action_space)
    env.close()
    policy = build_policy(cfg, *spaces)
    # foreach: one kernel per step for all tensors (not the CPU default), a shorter update
    optimizer = torch.optim.Adam(
        policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, foreach=True
    )
    learner = Learner(policy, optimizer, spaces)
    if ckpt is not None:
        policy.load_state_dict(ckpt["policy"])
        optimizer.load_state_dict(ckpt["optimizer"])
        learner.timesteps, learner.iteration = ckpt["timesteps"], ckpt["iteration"]
        learner.episodes = ckpt["episodes"]
    return learner


# ---------------------------------------------------------------------------- training
def train(
    cfg: PPOConfig,
    *,
    resume: bool = False,
    cluster: Any = None,
    progress: bool | None = None,
    on_iteration: Callable[[dict[str, Any], Any], bool | None] | None = None,
    times: WallBreakdown | None = None,
) -> dict[str, Any]:
    """Run PPO until ``max_timesteps`` or ``stop_return``; returns a summary dict.

    Writes ``runs_dir/name/metrics.jsonl``, ``checkpoint.pt`` and ``learning_curve.png``.
    ``resume`` continues from that checkpoint (step count, policy, optimizer, normaliser).
    ``on_iteration(metrics, env_runner_group)`` is called after every iteration; a true
    return value stops the run there. ``times`` collects the wall-time breakdown (the
    summary's ``breakdown``; a new one when not given).
    """
    t_start = time.perf_counter()
    times = times if times is not None else WallBreakdown()
    cfg.validate()
    if cfg.name is None:
        cfg = replace(cfg, name=harness.fresh_run_name(f"ppo-{cfg.env}", cfg.runs_dir))
    run_dir = Path(cfg.runs_dir) / cfg.name
    ckpt_path = run_dir / CHECKPOINT_FILE
    if not resume and ckpt_path.exists():
        raise ValueError(
            f"name: {run_dir} already has a checkpoint; pass --resume to continue it or "
            "choose another --name"
        )

    ckpt = load_checkpoint(ckpt_path) if resume else None
    if ckpt is not None:
        check_resumable(ckpt, cfg, ckpt_path)

    # 1. start-up: the learner is built on a helper thread while Ray and the runners start
    learner_future: Future[Learner] = harness.in_background(
        "ppo-learner-init", _timed, times, "learner init", build_learner, cfg, ckpt
    )
    runners = None
    try:
        if cluster is None and cfg.num_env_runners > 0:
            from phalanx.resources.ray_start import start_ray

            with times.phase("ray start"):
                runners_and_standby = cfg.num_env_runners + cfg.num_standby_env_runners
                slots = runners_and_standby * cfg.env_runner_config().num_cpus_per_env_runner
                start_ray(math.ceil(slots) + 1)  # the runners' slots and a spare
        from phalanx.envs import EnvRunnerGroup

        with times.phase("env runners start"):
            runners = EnvRunnerGroup(
                config=cfg.env_runner_config(),
                local_env_runner=cfg.num_env_runners == 0,
                cluster=cluster,
                name=f"ppo_{cfg.name}_{os.getpid()}",
            )
        with times.phase("waiting for learner init"):
            learner = learner_future.result()
        import torch  # imported by the learner's thread by now

        # The count is kept per thread (OpenMP, MKL): the learner was built on the start-up
        # thread and trains on this one.
        torch.set_num_threads(cfg.torch_threads)
        policy, optimizer = learner.policy, learner.optimizer
        obs_space, act_space = learner.spaces
        timesteps, iteration, episodes = learner.timesteps, learner.iteration, learner.episodes
        remote_spaces = runners.get_spaces()["__env__"]
        if remote_spaces != learner.spaces:
            raise ValueError(
                f"env: the runners' spaces {remote_spaces} differ from the learner's "
                f"{learner.spaces}"
            )
        with times.phase("first weight sync"):
            if ckpt is not None:
                runners.set_connector_state(ckpt["connector"])
            runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
    except BaseException:
        if runners is not None:
            runners.stop()
        raise
    from phalanx.observe import trace
    from phalanx.observe.metrics import MetricsLogger
    from phalanx.observe.progress import Progress

    log = MetricsLogger(run_dir, use_wandb=cfg.wandb)
    if ckpt is not None:  # rows of iterations after the checkpoint are redone now
        log.drop_after(timesteps)
    log.log_config({**asdict(cfg), "resumed_from": timesteps if ckpt else None})
    bar = Progress(
        total=cfg.max_timesteps, start=timesteps, title=f"PPO {cfg.env}", enabled=progress
    )
    recent: deque[float] = deque(maxlen=cfg.stop_window)
    min_episodes = min(cfg.stop_window, cfg.stop_min_episodes)
    first_iteration_at = timesteps
    t_loop = time.perf_counter()
    pending = runners.sample_async()
    reached = stopped = False
    reached_at: float | None = None
    synced = True  # the runners hold the learner's current weights
    last: dict[str, Any] = {}
    try:
        while timesteps < cfg.max_timesteps and not (reached or stopped):
            t_iter = time.perf_counter()
            # 1. collect the round in flight
            with bar.waiting("rollouts from the env runners"), times.phase("sampling (waited)"):
                batches = runners.collect_samples(pending)
            t_sampled = time.perf_counter()
            t_sync = 0.0
            with times.phase("weight sync"):
                if cfg.normalize_observations:
                    runners.sync_env_runner_states(env_steps_sampled=timesteps)
                if cfg.async_sampling:
                    # The runners are idle now: give them the weights trained on the previous
                    # batch and start the next round, which samples while we train on this one.
                    if not synced:
                        runners.sync_weights(
                            from_worker_or_learner_group=policy, timeout_seconds=None
                        )
                        synced = True
                    t_sync = time.perf_counter() - t_sampled
                    pending = runners.sample_async()
            if not batches:  # every runner died during the round; they are being restarted
                if not cfg.async_sampling:
                    pending = runners.sample_async()
                continue
            # 2. learn
            learner_version = runners.weights_version
            steps = sum(b["timesteps"] for b in batches)
            timesteps += steps
            iteration += 1
            new_returns = [r for b in batches for r in b["episode_returns"]]
            episodes += len(new_returns)
            recent.extend(new_returns)
            mean_recent = float(np.mean(recent)) if recent else float("nan")
            if (
                cfg.stop_return is not None
                and len(recent) >= min_episodes
                and mean_recent >= cfg.stop_return
            ):
                reached = True  # this batch's policy made it; the update below still runs
                reached_at = time.perf_counter() - t_start
            if cfg.anneal_lr:
                frac = max(1.0 - timesteps / cfg.max_timesteps, cfg.lr_floor)
                optimizer.param_groups[0]["lr"] = frac * cfg.learning_rate
            t_learn = time.perf_counter()
            with times.phase("learning"), trace.span("ppo.update", iteration=iteration):
                stats = ppo_update(policy, optimizer, flatten_batches(batches, cfg), cfg)
            synced = False
            t_trained = time.perf_counter()
            # 3. synchronous mode: weights out, next round in
            if not cfg.async_sampling:
                with times.phase("weight sync"):
                    runners.sync_weights(from_worker_or_learner_group=policy, timeout_seconds=None)
                    synced = True
                    t_sync = time.perf_counter() - t_trained
                    pending = runners.sample_async()
            with times.phase("metrics and progress"):
                lengths = [x for b in batches for x in b["episode_lengths"]]
                metrics = {
                    "timesteps": timesteps,
                    "iteration": iteration,
                    "episodes": episodes,
                    "return_mean": float(np.mean(new_returns)) if new_returns else float("nan"),
                    "return_std": float(np.std(new_returns)) if new_returns else float("nan"),
                    "return_mean_recent": mean_recent,
                    "episode_len_mean": float(np.mean(lengths)) if lengths else float("nan"),
                    **stats,
                    "lr": optimizer.param_groups[0]["lr"],
                    "time/rollout": t_sampled - t_iter,
                    "time/train": t_trained - t_learn,
                    "time/weight_sync": t_sync,
                    "time/step": time.perf_counter() - t_iter,
                    "time/total": time.perf_counter() - t_start,
                    "throughput/steps_per_s": (timesteps - first_iteration_at)
                    / max(time.perf_counter() - t_loop, 1e-9),
                    "restarts": runners.num_remote_worker_restarts(),
                    "healthy_env_runners": runners.num_healthy_remote_workers(),
                    "weights_version": runners.weights_version,
                    # versions the learner was ahead of the weights that sampled this batch
                    "policy_lag": learner_version - min(b["weights_version"] for b in batches),
                    "batch_runners": len(batches),
                }
                log.log(timesteps, metrics)
                bar.update(timesteps, {**metrics, "return_mean": mean_recent})
            last = metrics
            if on_iteration is not None and on_iteration(metrics, runners):
                stopped = True
            if iteration % cfg.checkpoint_every == 0 and not (reached or stopped):
                with times.phase("checkpoints"):
                    save_checkpoint(ckpt_path, policy, optimizer, runners.get_connector_state(),
                                    timesteps, iteration, episodes, cfg, (obs_space, act_space))  # fmt: skip
    finally:
        bar.close()
        log.close()
        t_loop_end = time.perf_counter()
        with times.phase("checkpoints"):
            save_checkpoint(ckpt_path, policy, optimizer, runners.get_connector_state(),
                            timesteps, iteration, episodes, cfg, (obs_space, act_space))  # fmt: skip
        restarts = runners.num_remote_worker_restarts()
        with times.phase("env runners stop"):
            runners.stop()
    with times.phase("plotting"):
        from phalanx.observe.metrics import read_metrics
        from phalanx.observe.plots import plot_learning_curve

        plot_learning_curve(read_metrics(run_dir), run_dir / "learning_curve.png", run_dir.name)
    wall = time.perf_counter() - t_start
    times.save(run_dir, wall)
    return {
        "timesteps": timesteps,
        "iterations": iteration,
        "episodes": episodes,
        "return_mean_recent": float(np.mean(recent)) if recent else float("nan"),
        "reached_stop_return": reached,
        "stopped_by_callback": stopped,
        "time_to_stop_return_s": reached_at,
        "wall_time_s": wall,
        "train_loop_s": t_loop_end - t_loop,
        "steps_per_s": last.get("throughput/steps_per_s", float("nan")),
        "restarts": restarts,
        "run_dir": str(run_dir),
        "breakdown": times.as_dict(wall),
    }


def _timed(times: WallBreakdown, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
    with times.phase(phase, overlapped=True):
        return fn(*args)


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
        + f", {summary['steps_per_s']:,.0f} env steps/s, {summary['restarts']} restarts; "
        f"run folder {summary['run_dir']}"
    )
    if cfg.stop_return is not None and not summary["reached_stop_return"]:
        print(f"stop return {cfg.stop_return} not reached within {cfg.max_timesteps} timesteps")
        return harness.BUDGET_SPENT
    return harness.DONE
