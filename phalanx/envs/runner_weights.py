"""Weights and connector state of an ``EnvRunnerGroup`` (RLlib's ``sync_weights`` and
``sync_env_runner_states``).

Weights go through one ``phalanx.weights.WeightSender`` per group of remote runners
(transport ``auto``: same-node runners view the sender's shared buffer). The connector
state (the observation normaliser) is merged across runners here and, with the extra
policies and ``global_vars``, registered on the runners' group as the state a runner
gets back when a probe returns it to service (``register_state``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from phalanx._base.checks import check_int, check_timeout
from phalanx.envs.config import DEFAULT_POLICY_ID, EnvRunnerGroupConfig
from phalanx.envs.env_runner import EnvRunner
from phalanx.envs.normalize import RunningMeanStd
from phalanx.group.group import WorkerGroup

logger = logging.getLogger(__name__)


class RunnerWeights:
    """Mixin of ``EnvRunnerGroup``: weight sync and connector state.

    The group provides the attributes annotated here and the methods used below
    (``_ranks``, ``_in_service``, ``_foreach_remote``, ``_first_answer``, ``get_spaces``,
    ``foreach_worker``, ``healthy_worker_ids``, ``num_remote_workers``).
    """

    config: EnvRunnerGroupConfig
    global_vars: dict[str, Any]
    _group: WorkerGroup | None
    _local: EnvRunner | None
    _sender: Any
    _sync_pending: bool
    _weights_version: int
    _obs_norm: RunningMeanStd | None
    _added_policies: dict[str, dict[str, Any]]
    _policies_to_train: list[str] | None

    @property
    def weights_version(self) -> int:
        """Version of the weights last sent by ``sync_weights`` (0: none yet)."""
        return self._weights_version

    def sync_weights(
        self,
        policies: list[str] | None = None,
        from_worker_or_learner_group: Any = None,
        to_worker_indices: list[int] | None = None,
        global_vars: dict[str, Any] | None = None,
        timeout_seconds: float | None = 0.0,
        inference_only: bool = False,
    ) -> Any:
        """Send policy weights to the remote runners (and the local one) with a new version.

        Source (``from_worker_or_learner_group``): None (the local runner), an
        ``EnvRunner``, a remote worker id (int), an ``nn.Module`` (the default policy), or
        ``{policy_id: nn.Module | state dict}``. ``policies`` limits which policies go.
        ``to_worker_indices``: remote ids (1..n) to update (default: all in service).
        ``timeout_seconds``: 0 starts the transfer and returns (RLlib's fire-and-forget;
        the next sync completes it), None or > 0 blocks until applied. Returns the
        weight layer's ``SyncResult`` (None while a fire-and-forget send is in flight).
        ``global_vars`` are set on every runner (``runner.global_vars``).

        Args:
            policies: the policies to send (every policy if None).
            from_worker_or_learner_group: where the weights come from, as above.
            to_worker_indices: the remote ids (1..n) to update.
            global_vars: values set as every runner's ``global_vars``.
            timeout_seconds: 0 returns once the send started; None or > 0 waits.
            inference_only: accepted for RLlib's signature.

        Returns:
            The ``SyncResult``, or None while a fire-and-forget send is in flight.

        Raises:
            WeightMismatchError: a runner's policy does not match the weights.
        """
        from phalanx.weights import WeightSender

        weights = self._weights_from(from_worker_or_learner_group, policies)
        ranks = self._ranks(to_worker_indices, "to_worker_indices")
        timeout = check_timeout(timeout_seconds, "timeout_seconds")
        result = None
        if self._group is not None:
            if self._sender is None:
                self._sender = WeightSender(
                    self._group, transport="auto", timeout_s=self.config.sample_timeout_s
                )
            if self._sync_pending:
                self._sync_pending = False
                self._sender.wait_async()
            healthy = set(self._up_ranks())  # standby runners keep current weights too
            everyone = self._all_ranks()
            targets = [r for r in (everyone if ranks is None else ranks) if r in healthy]
            flat = {f"{pid}.{k}": v for pid, sd in weights.items() for k, v in sd.items()}
            if targets and timeout == 0:
                self._sender.send_async(flat, worker_ids=targets)
                self._sync_pending = True
            elif targets:
                if timeout is not None:
                    self._sender.timeout_s = timeout
                result = self._sender.send(flat, worker_ids=targets)
                if result.failed:
                    logger.warning("sync_weights: runners failed to apply: %s", result.failed)
        self._weights_version = (
            self._sender.version if self._sender is not None else self._weights_version + 1
        )
        if self._local is not None:
            if from_worker_or_learner_group is None or from_worker_or_learner_group is self._local:
                self._local._px_weights_version = self._weights_version
            else:
                self._local.set_weights(weights, weights_version=self._weights_version)
        if global_vars is not None:
            self.global_vars = dict(global_vars)
            self.foreach_worker(_set_global_vars, kwargs={"global_vars": self.global_vars})
            self._register_restore_state()
        return result

    def _weights_from(self, source: Any, policies: list[str] | None) -> dict[str, dict[str, Any]]:
        if source is None:
            if self._local is None:
                raise ValueError(
                    "from_worker_or_learner_group: there is no local runner to take weights "
                    "from; pass a module, a {policy_id: module} dict or a worker id"
                )
            weights = {pid: _state(p) for pid, p in self._local.policies.items()}
        elif isinstance(source, EnvRunner):
            weights = {pid: _state(p) for pid, p in source.policies.items()}
        elif isinstance(source, int) and not isinstance(source, bool):
            rank = self._ranks([source], "from_worker_or_learner_group")[0]
            weights = self._first_answer("get_weights", [rank + 1])
        elif isinstance(source, torch.nn.Module):
            weights = {DEFAULT_POLICY_ID: _state(source)}
        elif isinstance(source, dict):
            weights = {}
            for pid, w in source.items():
                if isinstance(w, torch.nn.Module):
                    weights[pid] = _state(w)
                elif isinstance(w, dict):
                    weights[pid] = w
                else:
                    raise TypeError(
                        f"from_worker_or_learner_group[{pid!r}] must be an nn.Module or a state dict"
                    )
        else:
            raise TypeError(
                "from_worker_or_learner_group must be None, an EnvRunner, a worker id, an "
                f"nn.Module or a dict, got {type(source).__name__}"
            )
        if policies is not None:
            missing = [p for p in policies if p not in weights]
            if missing:
                raise ValueError(f"policies: no weights for {missing} (have {sorted(weights)})")
            weights = {p: weights[p] for p in policies}
        return {
            pid: {
                k: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
                for k, v in sd.items()
            }
            for pid, sd in weights.items()
        }

    def _remote_weights(self) -> dict[str, dict[str, np.ndarray]]:
        ids = self.healthy_worker_ids()
        if not ids:
            raise RuntimeError("no healthy remote runner to read weights from")
        return self._first_answer("get_weights", ids)

    # ------------------------------------------------------------------ connector state
    def sync_env_runner_states(
        self,
        *,
        config: Any = None,
        from_worker: EnvRunner | None = None,
        env_steps_sampled: int | None = None,
        connector_states: list[dict[str, Any]] | None = None,
        rl_module_state: dict[str, Any] | None = None,
        env_runner_indices_to_update: list[int] | None = None,
        env_to_module: Any = None,
        module_to_env: Any = None,
    ) -> dict[str, Any]:
        """Merge the runners' connector states and give every runner the merged state.

        The observation normaliser's per-runner deltas since the last sync are folded into
        one global mean/std (from ``connector_states`` if given, else fetched from the
        runners in service and ``from_worker``/the local runner); the result goes to the
        local runner and the remote runners ``env_runner_indices_to_update`` (default all
        in service) and is registered so runners returning to service get it too.

        RLlib's other keywords: ``config`` (an RLlib ``AlgorithmConfig`` or any object)
        is read for ``merge_env_runner_states`` (True, False or ``"training_only"`` with
        its ``in_evaluation``) and ``broadcast_env_runner_states``; None merges and
        broadcasts. ``env_steps_sampled`` becomes every runner's ``num_env_steps_sampled``.
        ``rl_module_state`` (``{"rl_module": {policy_id: state dict}}`` or
        ``{policy_id: state dict}``) is sent as weights to the same runners (a blocking
        ``sync_weights``). ``env_to_module``/``module_to_env`` (RLlib's connector pipeline
        objects) have no counterpart here and raise ``ValueError``.
        Returns the merged connector state (``{}`` without observation normalisation).

        Args:
            config: an object read for ``merge_env_runner_states`` and
                ``broadcast_env_runner_states``.
            from_worker: a runner whose state joins the merge.
            env_steps_sampled: every runner's new ``num_env_steps_sampled``.
            connector_states: the runners' states to merge (fetched if None).
            rl_module_state: weights sent to the same runners.
            env_runner_indices_to_update: the remote ids (1..n) to update.
            env_to_module: not supported.
            module_to_env: not supported.

        Returns:
            The merged connector state.

        Raises:
            ValueError: ``env_to_module`` or ``module_to_env`` is given.
            TypeError: ``rl_module_state`` is not a dict.
        """
        for name, value in (("env_to_module", env_to_module), ("module_to_env", module_to_env)):
            if value is not None:
                raise ValueError(
                    f"{name}: phalanx env runners have no connector pipeline objects; their "
                    "connector state is the observation normaliser (normalize_observations), "
                    "merged from the runners or from connector_states"
                )
        merge, broadcast = _merge_and_broadcast(config)
        ranks = self._ranks(env_runner_indices_to_update, "env_runner_indices_to_update")
        if env_steps_sampled is not None:
            self.num_env_steps_sampled = check_int(
                env_steps_sampled, "env_steps_sampled", minimum=0
            )
        if rl_module_state is not None:
            if not isinstance(rl_module_state, dict):
                raise TypeError(
                    f"rl_module_state must be a dict, got {type(rl_module_state).__name__}"
                )
            self.sync_weights(
                from_worker_or_learner_group=rl_module_state.get("rl_module", rl_module_state),
                to_worker_indices=env_runner_indices_to_update,
                timeout_seconds=None,
            )
        state: dict[str, Any] = {}
        if env_steps_sampled is not None:
            state["num_env_steps_sampled"] = self.num_env_steps_sampled
        if self.config.normalize_observations and merge:
            state["connector"] = self._merge_connector_states(from_worker, connector_states)
            if self._local is not None:
                self._local.set_connector_state(state["connector"])
        if self._local is not None and "num_env_steps_sampled" in state:
            self._local.num_env_steps_sampled = self.num_env_steps_sampled
        if self._group is not None and state and broadcast:
            self._foreach_remote(
                "set_state",
                kwargs={"state": state},
                ranks=ranks,
                timeout_seconds=self.config.sample_timeout_s,
            )
            self._register_restore_state()
        return state.get("connector", {})

    def _merge_connector_states(
        self, from_worker: EnvRunner | None, connector_states: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        """Fold the runners' normaliser deltas into the global statistics."""
        if connector_states is None:
            connector_states = []
            if self._group is not None:
                connector_states.extend(
                    self._foreach_remote(
                        "get_connector_state", timeout_seconds=self.config.sample_timeout_s
                    )
                )
            src = from_worker if from_worker is not None else self._local
            if src is not None:
                connector_states.append(src.get_connector_state())
        if self._obs_norm is None:
            shape = self.get_spaces()["__env__"][0].shape or ()
            self._obs_norm = RunningMeanStd(shape)
        for st in connector_states:
            if st and st.get("obs_norm_delta") is not None:
                self._obs_norm.merge(st["obs_norm_delta"])
        return {"obs_norm": self._obs_norm.get_state()}

    def get_connector_state(self) -> dict[str, Any]:
        """The merged connector state (what a checkpoint keeps).

        Returns:
            ``{"obs_norm": state}``, or ``{}`` without observation normalisation.
        """
        return {} if self._obs_norm is None else {"obs_norm": self._obs_norm.get_state()}

    def set_connector_state(self, state: dict[str, Any]) -> None:
        """Set the merged connector state on every runner (e.g. from a checkpoint).

        Args:
            state: a state from ``get_connector_state``.
        """
        if not state or state.get("obs_norm") is None or not self.config.normalize_observations:
            return
        shape = np.asarray(state["obs_norm"]["mean"]).shape
        self._obs_norm = RunningMeanStd(shape)
        self._obs_norm.set_state(state["obs_norm"])
        self.sync_env_runner_states(connector_states=[])

    def _restore_state(self) -> dict[str, Any]:
        """What a runner returning to service gets (``EnvRunner.set_state``)."""
        return {
            "connector": {
                "obs_norm": None if self._obs_norm is None else self._obs_norm.get_state()
            },
            "policies": dict(self._added_policies),
            "policies_to_train": self._policies_to_train,
            "global_vars": dict(self.global_vars),
        }

    def _register_restore_state(self) -> None:
        if self._group is not None:
            self._group.register_state(None, self._restore_state())

    def _close_sender(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as e:  # noqa: BLE001 - closing is best effort; the group goes
                logger.warning("closing the weight sender: %s", e)
            self._sender = None
            self._sync_pending = False


def _merge_and_broadcast(config: Any) -> tuple[bool, bool]:
    """RLlib's ``merge_env_runner_states``/``broadcast_env_runner_states`` of ``config``."""
    if config is None:
        return True, True
    merge = getattr(config, "merge_env_runner_states", True)
    if merge == "training_only":
        merge = not getattr(config, "in_evaluation", False)
    broadcast = getattr(config, "broadcast_env_runner_states", True)
    for name, v in (("merge_env_runner_states", merge), ("broadcast_env_runner_states", broadcast)):
        if not isinstance(v, bool):
            raise TypeError(
                f"config.{name} must be a bool (or 'training_only' for merging), got {v!r}"
            )
    return merge, broadcast


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


def _set_global_vars(runner: EnvRunner, global_vars: dict[str, Any]) -> None:
    runner.global_vars = dict(global_vars)
