"""Runner ids and hot standby runners of an ``EnvRunnerGroup``.

The remote runners are the ranks of one phalanx group: ``num_env_runners`` ranks serve
the runner ids ``1..n`` and ``num_standby_env_runners`` more are *standby* runners,
started with the others (process up, torch and gymnasium imported, envs built, weights
kept current by every ``sync_weights``) but never sampled. When the rank serving an id
fails (its process died, its env raised), a standby in service takes over that id at the
next look at the runners' health (every ``sample`` round, probe and health query): it
rebuilds its envs with the id's ``worker_index`` (``EnvContext.recreated_worker`` set)
and gets the connector state, extra policies and ``global_vars`` that a restarted runner
would get; it has the weights already. That is one call into a warm process instead of
a new process that imports torch and gymnasium (seconds). The failed rank is restarted
by the group's restart policy as usual and, once a probe brings it back, it is a standby
runner: the pool refills itself.

Without standby runners ids map to ranks as ``id = rank + 1``.
"""

from __future__ import annotations

import logging
import time

from phalanx.envs.config import EnvRunnerGroupConfig
from phalanx.group.group import WorkerGroup

logger = logging.getLogger(__name__)


class RunnerStandby:
    """Mixin of ``EnvRunnerGroup``: which rank serves which runner id, and take-overs.

    The group provides the attributes annotated here and ``_restore_state``.
    """

    config: EnvRunnerGroupConfig
    _group: WorkerGroup | None
    _active: list[int]  # _active[id - 1]: the rank serving runner id ``id``
    _spares: list[int]  # standby ranks, in service or on their way back
    _handed_over: list[int]
    num_standby_takeovers: int

    def _assign_ranks(self, world_size: int, num_standby: int) -> None:
        """The first ``world_size - num_standby`` ranks serve ids 1..n, the rest stand by."""
        n = world_size - num_standby
        self._active = list(range(n))
        self._spares = list(range(n, world_size))

    def _id_of(self, rank: int) -> int | None:
        """The runner id that ``rank`` serves (None for a standby runner)."""
        try:
            return self._active.index(rank) + 1
        except ValueError:
            return None

    def _label(self, rank: int) -> str:
        """``"env runner <id>"``, or ``"standby runner (rank r)"``, for messages."""
        wid = self._id_of(rank)
        return f"env runner {wid}" if wid is not None else f"standby runner (rank {rank})"

    def _all_ranks(self) -> list[int]:
        """Every rank of the runners' group: serving ones in id order, then standby ones."""
        return [*self._active, *self._spares]

    def _in_service(self) -> list[int]:
        """Ranks serving a runner id and in service, in id order (after any take-over)."""
        if self._group is None:
            return []
        up = set(self._group.healthy_worker_ids())
        if self._spares and any(r not in up for r in self._active):
            self._take_over(up)
        return [r for r in self._active if r in up]

    def _up_ranks(self) -> list[int]:
        """Every rank in service, standby runners included (weights go to all of them)."""
        if self._group is None:
            return []
        self._in_service()
        up = set(self._group.healthy_worker_ids())
        return [r for r in self._all_ranks() if r in up]

    def num_standby_env_runners(self) -> int:
        """Standby runners of the group (in service or being restarted).

        Returns:
            The number of runners.
        """
        return len(self._spares)

    def num_healthy_standby_env_runners(self) -> int:
        """Standby runners in service, ready to take over a failed runner's id.

        Returns:
            The number of runners.
        """
        if self._group is None:
            return 0
        up = set(self._group.healthy_worker_ids())
        return sum(1 for r in self._spares if r in up)

    def _take_over(self, up: set[int]) -> None:
        """Give each serving rank out of service a standby runner in service, if any."""
        for i, rank in enumerate(self._active):
            if rank in up:
                continue
            for spare in [s for s in self._spares if s in up]:
                up.discard(spare)
                if self._hand_over(spare, i + 1):
                    self._active[i] = spare
                    self._spares.remove(spare)
                    self._spares.append(rank)
                    self._handed_over.append(i + 1)
                    self.num_standby_takeovers += 1
                    break

    def _hand_over(self, spare: int, runner_id: int) -> bool:
        """Make standby rank ``spare`` runner ``runner_id``; False if it failed (the
        group's policy then took it out of service)."""
        t0 = time.perf_counter()
        results = self._group.foreach_actor(
            "take_over",
            kwargs={"worker_index": runner_id, "state": self._restore_state()},
            remote_actor_ids=[spare],
            timeout_seconds=self.config.env_runner_health_probe_timeout_s,
        )
        if not any(r.ok for r in results):
            if not results:  # still running: the group restarts it per policy
                self._group.take_out_of_service(spare, "take_over() stalled")
            logger.warning("standby runner (rank %d) failed to take over id %d", spare, runner_id)
            return False
        logger.info(
            "env runner %d: standby rank %d took over in %.3f s",
            runner_id,
            spare,
            time.perf_counter() - t0,
        )
        return True
