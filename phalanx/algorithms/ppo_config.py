"""PPO's hyperparameters and run options (``PPOConfig``; its field docstrings are the
``phalanx train ppo --help``) and the values tuned per env (``TUNED``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import tyro

from phalanx._base.checks import check_int, check_number
from phalanx.algorithms import _harness as harness
from phalanx.algorithms._harness import alias


@dataclass
class PPOConfig:
    """PPO hyperparameters and run options; PPOConfig.for_env(env) starts from the values
    tuned for that env (TUNED), as the command line does."""

    # --- environment and env runners
    env: str = "CartPole-v1"
    """gymnasium env id"""
    env_config: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """keyword arguments of gymnasium.make (YAML --config only)"""
    num_env_runners: Annotated[int, alias("--env-runners")] = 2
    """remote env runner processes; 0 samples in this process"""
    num_envs_per_env_runner: Annotated[int, alias("--envs-per-runner")] = 8
    """vectorised envs per runner"""
    rollout_fragment_length: Annotated[int, alias("--rollout-length")] = 32
    """vector steps per runner per iteration"""
    normalize_observations: Annotated[bool, alias("--normalize-obs")] = False
    """running mean/std observation normaliser, merged across runners"""
    # --- budget and stopping
    max_timesteps: int = 200_000
    """stop after this many env steps"""
    stop_return: float | None = None
    """stop (exit 0) once the mean return of the last stop_window episodes reaches this"""
    stop_window: int = 20
    """episodes averaged for stop_return"""
    stop_min_episodes: int = 10
    """episodes that must have finished before stop_return is checked (capped at stop_window)"""
    seed: int = 1
    """random seed of the learner and the envs"""
    # --- PPO
    learning_rate: Annotated[float, alias("--lr")] = 2.5e-3
    """Adam learning rate"""
    anneal_lr: bool = True
    """decay the learning rate linearly with timesteps / max_timesteps"""
    lr_floor: float = 0.05
    """annealing never goes below this fraction of learning_rate"""
    adam_eps: float = 1e-5
    """Adam epsilon"""
    gamma: float = 0.99
    """discount"""
    gae_lambda: float = 0.95
    """GAE lambda"""
    minibatch_size: int = 128
    """SGD minibatch size"""
    update_epochs: Annotated[int, alias("--epochs")] = 4
    """SGD passes over each batch"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    clip_coef: float = 0.2
    """PPO ratio clip"""
    clip_vloss: bool = True
    """clip the value loss around the sampling-time values"""
    vf_clip_coef: float | None = None
    """value clip (None: same as clip_coef)"""
    ent_coef: float = 0.0
    """entropy bonus"""
    vf_coef: float = 0.5
    """value loss weight"""
    max_grad_norm: float = 0.5
    """gradient norm clip"""
    target_kl: float | None = None
    """stop the epochs of an update once the approximate KL exceeds this"""
    reward_scale: float = 1.0
    """rewards are multiplied by this before GAE"""
    # --- policy network
    hidden: tuple[int, ...] = (64, 64)
    """hidden layer sizes of the actor and the critic"""
    activation: str = "tanh"
    """tanh or relu"""
    init_log_std: float = 0.0
    """initial log std of a Gaussian policy (continuous actions)"""
    # --- runtime
    num_learners: int = 0
    """0: the learner trains in this process; 1: in a worker restarted in place if it dies"""
    max_restarts: int = 3
    """learner restarts per run (num_learners=1); the next death ends the run (exit 4)"""
    async_sampling: Annotated[bool, alias("--async")] = False
    """sample the next batch while the learner trains (one weights version behind)"""
    restart_failed_env_runners: bool = True
    """restart a dead env runner (the round it died in goes on without it)"""
    num_standby_env_runners: Annotated[int, alias("--standby-env-runners")] = 0
    """hot standby runner processes: one takes over a dead runner's place in one call"""
    max_num_env_runner_restarts: int = 100
    """restarts allowed per runner"""
    sample_timeout_s: float = 60.0
    """seconds to wait for a round of samples before a runner counts as hung"""
    torch_threads: int = 1
    """torch threads of the learner (the networks are tiny; more threads fight the runners)"""
    name: str | None = None
    """run name: output goes to <runs_dir>/<name> (None: a fresh ppo-<env>[-N])"""
    runs_dir: str = "runs"
    """folder of runs"""
    checkpoint_every: int = 10
    """iterations between checkpoints; one is also written at the end"""
    wandb: bool = False
    """also log to Weights & Biases (TensorBoard is on when the package is installed)"""

    @classmethod
    def for_env(cls, env: str, **overrides: Any) -> PPOConfig:
        """Tuned starting points for a few environments; anything else uses the defaults.

        Args:
            env: the gymnasium env id.
            **overrides: fields that replace the tuned values.

        Returns:
            The config.
        """
        return cls(**{"env": env, **TUNED.get(env, {}), **overrides})

    @property
    def batch_size(self) -> int:
        """Env steps per iteration: runners x envs per runner x fragment length."""
        runners = max(self.num_env_runners, 1)
        return runners * self.num_envs_per_env_runner * self.rollout_fragment_length

    def validate(self) -> None:
        """``ValueError``/``TypeError`` naming the first bad option (before anything starts)."""
        harness.check_run_name(self.name)
        check_int(self.num_env_runners, "num_env_runners", minimum=0)
        check_int(self.num_standby_env_runners, "num_standby_env_runners", minimum=0)
        check_int(self.num_learners, "num_learners", minimum=0)
        if self.num_learners > 1:
            raise ValueError(
                f"num_learners must be 0 or 1, got {self.num_learners}: data-parallel "
                "learners are not implemented (PPO's CartPole-sized networks train in "
                "milliseconds; one learner process is the restartable unit)"
            )
        check_int(self.max_restarts, "max_restarts", minimum=0)
        for name in ("num_envs_per_env_runner", "rollout_fragment_length", "max_timesteps",
                     "stop_window", "stop_min_episodes", "minibatch_size", "update_epochs",
                     "checkpoint_every", "torch_threads"):  # fmt: skip
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.seed, "seed")
        check_int(self.max_num_env_runner_restarts, "max_num_env_runner_restarts")
        if self.minibatch_size > self.batch_size:
            raise ValueError(
                f"minibatch_size={self.minibatch_size} is larger than the batch "
                f"({self.batch_size} = max(num_env_runners, 1) * num_envs_per_env_runner * "
                "rollout_fragment_length)"
            )
        ranges = {
            "learning_rate": (0, None), "gamma": (0, 1), "gae_lambda": (0, 1),
            "clip_coef": (0, None), "vf_coef": (0, None), "max_grad_norm": (0, None),
            "reward_scale": (0, None), "sample_timeout_s": (0, None), "adam_eps": (0, None),
            "lr_floor": (0, 1),
        }  # fmt: skip
        for name, (lo, hi) in ranges.items():
            v = check_number(getattr(self, name), name)
            if v <= lo if name not in ("gae_lambda", "lr_floor") else v < lo:
                raise ValueError(f"{name} must be > {lo}, got {v}")
            if hi is not None and v > hi:
                raise ValueError(f"{name} must be <= {hi}, got {v}")
        if check_number(self.ent_coef, "ent_coef") < 0:
            raise ValueError(f"ent_coef must be >= 0, got {self.ent_coef}")
        for name in ("target_kl", "vf_clip_coef", "stop_return"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), name)
        if self.target_kl is not None and self.target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 or None, got {self.target_kl}")
        if not self.hidden or not all(type(h) is int and h > 0 for h in self.hidden):
            raise ValueError(
                f"hidden must be a non-empty list of positive ints, got {self.hidden!r}"
            )
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be 'tanh' or 'relu', got {self.activation!r}")
        if self.name is not None and (
            not isinstance(self.name, str) or not self.name or "/" in self.name
        ):
            raise ValueError(f"name must be a non-empty str without '/', got {self.name!r}")
        if not isinstance(self.env_config, dict):
            raise TypeError(f"env_config must be a mapping, got {self.env_config!r}")
        if not isinstance(self.env, str):
            raise TypeError(f"env must be a gymnasium env id, got {self.env!r}")
        from phalanx.envs.env_runner import check_env_id

        check_env_id(self.env)

    def env_runner_config(self) -> Any:
        """The ``EnvRunnerGroupConfig`` of this run's env runners.

        Returns:
            The config.
        """
        from phalanx.envs import EnvRunnerGroupConfig

        return EnvRunnerGroupConfig(
            env=self.env,
            env_config=dict(self.env_config),
            num_env_runners=self.num_env_runners,
            num_envs_per_env_runner=self.num_envs_per_env_runner,
            rollout_fragment_length=self.rollout_fragment_length,
            normalize_observations=self.normalize_observations,
            seed=self.seed,
            policy_config={
                "hidden": tuple(self.hidden),
                "activation": self.activation,
                "init_log_std": self.init_log_std,
            },
            restart_failed_env_runners=self.restart_failed_env_runners,
            num_standby_env_runners=self.num_standby_env_runners,
            max_num_env_runner_restarts=self.max_num_env_runner_restarts,
            sample_timeout_s=self.sample_timeout_s,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "PPO config") -> PPOConfig:
        """A config from a mapping (a YAML file, a checkpoint); unknown keys are an error.

        Args:
            d: the fields.
            source: what ``d`` came from, for the error.

        Returns:
            The config.

        Raises:
            ValueError: a key is not a field.
        """
        return cls(**harness.check_keys(d, cls, source))


TUNED: dict[str, dict[str, Any]] = {
    # CartPole-v1 (2 runners x 8 envs x 32 steps = 512 steps per update). Start: CleanRL's
    # ppo.py (4 epochs, clip 0.2, tanh 64x64, advantage normalisation) with lr 2.5e-3.
    # Changed from it because each reached a 20-episode mean of 450 in fewer env steps
    # (seeds 1-5; benchmarks/bench_ppo.py says what else was tried): value clipping off
    # (returns of ~100 moved at most 0.2 per update hold the critic back), gamma 0.98 and
    # lambda 0.9 (RL Zoo's CartPole horizon), and 6 epochs.
    "CartPole-v1": {
        "clip_vloss": False,
        "gamma": 0.98,
        "gae_lambda": 0.9,
        "update_epochs": 6,
    },
    # Pendulum: normalised observations, small rewards, short horizon, longer updates.
    "Pendulum-v1": {
        "num_envs_per_env_runner": 8,
        "rollout_fragment_length": 128,
        "normalize_observations": True,
        "max_timesteps": 600_000,
        "learning_rate": 1e-3,
        "gamma": 0.95,
        "gae_lambda": 0.95,
        "minibatch_size": 256,
        "update_epochs": 10,
        "ent_coef": 0.0,
        "reward_scale": 0.1,
        "clip_vloss": False,
        "hidden": (64, 64),
        "init_log_std": -0.5,
    },
    # HalfCheetah-v5 (pip install "gymnasium[mujoco]"; 2 runners x 4 envs x 256 steps =
    # 2048 steps per update, CleanRL's batch). Start: CleanRL's ppo_continuous_action.py
    # MuJoCo settings (1M steps, lr 3e-4 annealed, gamma 0.99, lambda 0.95, 32 minibatches
    # of 64, 10 epochs, clip 0.2, entropy 0, value weight 0.5, grad norm 0.5, tanh 64x64,
    # log-std 0, observations normalised and clipped to +-10). phalanx has no running
    # return normaliser (CleanRL's NormalizeReward): rewards are scaled by 0.1 instead and
    # value clipping is off (as for Pendulum: clipping targets of tens by 0.2 per update
    # held the critic back). Stop: CleanRL's reported evaluation return of its HalfCheetah
    # PPO agents at 1M steps is ~1.5-1.9k; 1500 over 10 episodes. Not swept.
    "HalfCheetah-v5": {
        "num_envs_per_env_runner": 4,
        "rollout_fragment_length": 256,
        "normalize_observations": True,
        "max_timesteps": 1_000_000,
        "stop_return": 1500.0,
        "stop_window": 10,
        "learning_rate": 3e-4,
        "gamma": 0.99,
        "gae_lambda": 0.95,
        "minibatch_size": 64,
        "update_epochs": 10,
        "ent_coef": 0.0,
        "reward_scale": 0.1,
        "clip_vloss": False,
    },
}
