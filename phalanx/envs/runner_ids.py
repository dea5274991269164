"""Runner ids over the ranks of an ``EnvRunnerGroup``'s remote runners, and hot standby
runners.

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
from collections.abc import Callable
from typing import Any

from phalanx._base.checks import check_ranks
from phalanx.group.group import WorkerGroup

logger = logging.getLogger(__name__)


class RunnerIds:
    """Which rank of ``group`` serves which runner id, and standby take-overs.

    Args:
        group: the remote runners (None: there are none).
        num_standby: how many of the group's last ranks stand by.
        probe_timeout_s: how long a take-over may take.
        restore_state: what a standby runner taking over an id gets (``EnvRunner.set_state``).
        takeovers: take-overs counted so far (carried over from the runners' previous group).
    """

    def __init__(
        self,
        group: WorkerGroup | None = None,
        num_standby: int = 0,
        *,
        probe_timeout_s: float = 0.0,
        restore_state: Callable[[], dict[str, Any]] | None = None,
        takeovers: int = 0,
    ) -> None:
        self.group = group
        n = 0 if group is None else group.world_size - num_standby
        self.active = list(range(n))  # active[id - 1]: the rank serving runner id ``id``
        self.spares = list(range(n, n + num_standby))  # standby ranks, up or on their way back
        self.handed_over: list[int] = []  # ids a standby took over since the last probe
        self.takeovers = takeovers
        self._probe_timeout_s = probe_timeout_s
        self._restore_state = restore_state

    def id_of(self, rank: int) -> int | None:
        """The runner id that ``rank`` serves (None for a standby runner)."""
        try:
            return self.active.index(rank) + 1
        except ValueError:
            return None

    def label(self, rank: int) -> str:
        """``"env runner <id>"``, or ``"standby runner (rank r)"``, for messages."""
        wid = self.id_of(rank)
        return f"env runner {wid}" if wid is not None else f"standby runner (rank {rank})"

    def all_ranks(self) -> list[int]:
        """Every rank of the runners' group: serving ones in id order, then standby ones."""
        return [*self.active, *self.spares]

    def ranks(
        self, worker_ids: list[int] | int | None, arg: str = "remote_worker_ids"
    ) -> list[int] | None:
        """RLlib's remote ids (1..n) as the ranks that serve them (None stays None)."""
        if worker_ids is None:
            return None
        if isinstance(worker_ids, int):
            worker_ids = [worker_ids]
        ids = check_ranks(worker_ids, self.num_serving(), arg, repeats="allow", first=1)
        return [self.active[i - 1] for i in ids]

    def num_serving(self) -> int:
        """How many runner ids there are (0 without remote runners)."""
        return 0 if self.group is None else len(self.active)

    def in_service(self) -> list[int]:
        """Ranks serving a runner id and in service, in id order (after any take-over)."""
        if self.group is None:
            return []
        up = set(self.group.healthy_worker_ids())
        if self.spares and any(r not in up for r in self.active):
            self._take_over(up)
        return [r for r in self.active if r in up]

    def up_ranks(self) -> list[int]:
        """Every rank in service, standby runners included (weights go to all of them)."""
        if self.group is None:
            return []
        self.in_service()
        up = set(self.group.healthy_worker_ids())
        return [r for r in self.all_ranks() if r in up]

    def num_healthy_standby(self) -> int:
        """Standby runners in service, ready to take over a failed runner's id."""
        if self.group is None:
            return 0
        up = set(self.group.healthy_worker_ids())
        return sum(1 for r in self.spares if r in up)

    def take_handed_over(self) -> list[int]:
        """The ids a standby took over since the last call."""
        ids, self.handed_over = self.handed_over, []
        return ids

    def _take_over(self, up: set[int]) -> None:
        """Give each serving rank out of service a standby runner in service, if any."""
        for i, rank in enumerate(self.active):
            if rank in up:
                continue
            for spare in [s for s in self.spares if s in up]:
                up.discard(spare)
                if self._hand_over(spare, i + 1):
                    self.active[i] = spare
                    self.spares.remove(spare)
                    self.spares.append(rank)
                    self.handed_over.append(i + 1)
                    self.takeovers += 1
                    break

    def _hand_over(self, spare: int, runner_id: int) -> bool:
        """Make standby rank ``spare`` runner ``runner_id``; False if it failed (the
        group's policy then took it out of service)."""
        t0 = time.perf_counter()
        state = self._restore_state() if self._restore_state is not None else {}
        results = self.group.foreach_actor(
            "take_over",
            kwargs={"worker_index": runner_id, "state": state},
            remote_actor_ids=[spare],
            timeout_seconds=self._probe_timeout_s,
        )
        if not any(r.ok for r in results):
            if not results:  # still running: the group restarts it per policy
                self.group.take_out_of_service(spare, "take_over() stalled")
            logger.warning("standby runner (rank %d) failed to take over id %d", spare, runner_id)
            return False
        logger.info(
            "env runner %d: standby rank %d took over in %.3f s",
            runner_id,
            spare,
            time.perf_counter() - t0,
        )
        return True
