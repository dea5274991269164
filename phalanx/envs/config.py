"""Configuration of env runners and their group, with RLlib's knob names.

Defaults favour fast recovery on small machines: a dead env runner is restarted at once
(RLlib waits 60 s), probes give up after 10 s, and one sample request per runner is in
flight at a time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from phalanx._base.checks import check_int, check_number

DEFAULT_POLICY_ID = "default_policy"


@dataclass
class EnvRunnerGroupConfig:
    """Everything an :class:`~phalanx.envs.EnvRunnerGroup` and its runners need.

    Fault tolerance follows RLlib's rules: any error from a remote runner - its env
    raised, its process died - takes it out of service and drops its result.

    Attributes:
        env: a gymnasium env id (``"CartPole-v1"``), or ``None`` when an ``env_creator``
            is given to the group.
        env_config: passed to ``env_creator`` inside the :class:`EnvContext` (and as
            keyword arguments to ``gymnasium.make`` for an env id).
        num_envs_per_env_runner: sub-environments of each runner's vector env (1).
        rollout_fragment_length: vector steps per ``sample()`` call when no count is
            given; a call returns ``rollout_fragment_length * num_envs_per_env_runner``
            timesteps (128).
        normalize_observations: keep a running mean/std of observations on every runner,
            merged across runners by ``sync_env_runner_states`` (False).
        seed: base seed; runner ``i`` seeds its envs with ``seed + 1000 * i + vector_index``
            and torch with ``seed + i`` (None: unseeded).
        explore: sample actions stochastically (True) or greedily.
        policy_config: keyword arguments of the default policy class (e.g. ``hidden``).
        policies_to_train: policy ids the learner trains (None: all of them).
        num_env_runners: remote runner processes (0: sample on the local runner only).
        num_cpus_per_env_runner: logical CPUs each runner reserves in Ray (1).
        num_standby_env_runners: hot standby runner processes started beside the
            ``num_env_runners`` (each reserves ``num_cpus_per_env_runner``); a standby
            takes over the id, state and weights of a runner that fails, in one call
            instead of a new process, and the failed runner's restarted process becomes
            a standby (0: off; see :mod:`phalanx.envs.runner_ids`).
        restart_failed_env_runners: replace a failed runner's process (its env raised
            or it died) at once; the call it failed in goes on without it and it is back
            in service at the next probe (``sample`` probes every round) (True).
        max_num_env_runner_restarts: restarts allowed per runner before it is given up
            (100; stops a crash loop, not a run with the odd failure).
        delay_between_env_runner_restarts_s: wait before recreating a runner (0.0 s: a new
            runner is ready once its process starts; RLlib's default is 60 s).
        env_runner_health_probe_timeout_s: how long a probe waits for a restart under way
            and for a ping, and how long a state restore may take (10 s).
        max_requests_in_flight_per_env_runner: async requests per runner at a time (1).
        ignore_env_runner_failures: without restarts, go on with the runners left when
            one fails (a probe brings it back if it answers) instead of raising (False).
            With both this and ``restart_failed_env_runners`` off, a runner's error
            raises (the runner is out of service all the same).
        sample_timeout_s: how long a ``sample`` round waits; a runner still sampling then
            loses its batch for the round and is taken out of service, and restarted if
            ``restart_failed_env_runners``; a stall never raises (60 s).
        max_consecutive_env_runner_failures: a runner that fails (raises, dies or
            stalls in) this many ``sample`` rounds in a row stops the run with an error
            naming it and its last error, instead of restarting forever (3; None: no
            limit).
    """

    env: str | None = None
    env_config: dict[str, Any] = field(default_factory=dict)
    num_env_runners: int = 0
    num_envs_per_env_runner: int = 1
    rollout_fragment_length: int = 128
    num_cpus_per_env_runner: float = 1.0
    num_standby_env_runners: int = 0
    normalize_observations: bool = False
    seed: int | None = None
    explore: bool = True
    policy_config: dict[str, Any] = field(default_factory=dict)
    policies_to_train: list[str] | None = None
    restart_failed_env_runners: bool = True
    max_num_env_runner_restarts: int = 100
    delay_between_env_runner_restarts_s: float = 0.0
    env_runner_health_probe_timeout_s: float = 10.0
    max_requests_in_flight_per_env_runner: int = 1
    ignore_env_runner_failures: bool = False
    sample_timeout_s: float = 60.0
    max_consecutive_env_runner_failures: int | None = 3

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first bad option (done when the
        config is constructed; call again after changing a field in place)."""
        check_int(self.num_env_runners, "num_env_runners", minimum=0)
        check_int(self.num_standby_env_runners, "num_standby_env_runners", minimum=0)
        for name in (
            "num_envs_per_env_runner",
            "rollout_fragment_length",
            "max_requests_in_flight_per_env_runner",
        ):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.max_num_env_runner_restarts, "max_num_env_runner_restarts", minimum=0)
        if self.max_consecutive_env_runner_failures is not None:
            check_int(
                self.max_consecutive_env_runner_failures,
                "max_consecutive_env_runner_failures",
                minimum=1,
            )
        check_number(self.num_cpus_per_env_runner, "num_cpus_per_env_runner", minimum=0)
        check_number(
            self.delay_between_env_runner_restarts_s,
            "delay_between_env_runner_restarts_s",
            minimum=0,
        )
        for name in ("env_runner_health_probe_timeout_s", "sample_timeout_s"):
            if check_number(getattr(self, name), name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "normalize_observations",
            "explore",
            "restart_failed_env_runners",
            "ignore_env_runner_failures",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.env is not None and not isinstance(self.env, str):
            raise TypeError(f"env must be a gymnasium env id (str) or None, got {self.env!r}")
        for name in ("env_config", "policy_config"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}")
        if self.seed is not None:
            check_int(self.seed, "seed")
        if self.policies_to_train is not None and not isinstance(
            self.policies_to_train, (list, tuple, set)
        ):
            raise TypeError("policies_to_train must be a list of policy ids or None")

    def to_dict(self) -> dict[str, Any]:
        """The config as a dict of its fields.

        Returns:
            The dict.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EnvRunnerGroupConfig:
        """A config from a dict of its fields.

        Args:
            d: the fields.

        Returns:
            The config.

        Raises:
            ValueError: a key is not a field (it names the unknown keys).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown env runner config keys {unknown} (known: {sorted(known)})")
        return cls(**d)


class EnvContext(dict):
    """What an ``env_creator`` receives: the ``env_config`` dict plus where the env lives.

    As in RLlib: ``worker_index`` is 0 for the local runner and ``1..n`` for remote
    runners, ``vector_index`` is the sub-environment's index in its runner's vector env,
    ``num_workers`` the number of remote runners.

    Args:
        env_config: the env's configuration.
        worker_index: the runner's id (0: the local runner).
        vector_index: the sub-environment's index in the runner's vector env.
        num_workers: the number of remote runners.
        remote: whether the runner is a remote one.
        recreated_worker: whether the runner replaces a failed one.
    """

    def __init__(
        self,
        env_config: dict[str, Any] | None = None,
        worker_index: int = 0,
        vector_index: int = 0,
        num_workers: int = 0,
        remote: bool = False,
        recreated_worker: bool = False,
    ):
        super().__init__(env_config or {})
        self.worker_index = worker_index
        self.vector_index = vector_index
        self.num_workers = num_workers
        self.remote = remote
        self.recreated_worker = recreated_worker

    def copy_with_overrides(self, **kw: Any) -> EnvContext:
        """A copy with some of its fields replaced.

        Args:
            **kw: the fields to replace.

        Returns:
            The new ``EnvContext``.
        """
        args = dict(
            env_config=dict(self),
            worker_index=self.worker_index,
            vector_index=self.vector_index,
            num_workers=self.num_workers,
            remote=self.remote,
            recreated_worker=self.recreated_worker,
        )
        args.update(kw)
        return EnvContext(**args)

    def __reduce__(self) -> Any:
        return (
            EnvContext,
            (
                dict(self),
                self.worker_index,
                self.vector_index,
                self.num_workers,
                self.remote,
                self.recreated_worker,
            ),
        )
