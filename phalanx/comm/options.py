"""``CollectiveGroupOptions``: RLinf's tuning of a collective group, honoured where it means something.

RLinf passes it as ``options=`` to ``send``/``recv``/``broadcast`` (and phalanx's
``get_group`` takes it too). Each field, here:

- ``accel_cluster_size``, ``accel_max_ctas``, ``accel_min_ctas`` (NCCL's
  ``cga_cluster_size``, ``max_ctas``, ``min_ctas``) and ``is_high_priority_stream``: set
  on the NCCL process group phalanx builds (a collective group, or the first NCCL group of
  a point-to-point pair, which keeps the options it was built with). Gloo and shared
  memory have no such settings: on CPU paths they have no effect, as in RLinf.
- ``use_ring_broadcast``: accepted, no effect: phalanx's ``broadcast`` sends from the
  source to every member at once (shared memory on one node), with the same result.
- ``timeout_s`` (phalanx's, not RLinf's): the operation timeout of the process group built
  with these options (default 1800 s, or ``PHALANX_COMM_CONNECT_TIMEOUT_S`` if larger).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from phalanx._base.checks import check_int, check_timeout


@dataclass
class CollectiveGroupOptions:
    """Options of a collective group (RLinf's name and fields; see the module docstring)."""

    accel_cluster_size: int | None = None
    accel_max_ctas: int | None = None
    accel_min_ctas: int | None = None
    is_high_priority_stream: bool = False
    use_ring_broadcast: bool = False
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("accel_cluster_size", "accel_max_ctas", "accel_min_ctas"):
            value = getattr(self, name)
            if value is not None:
                check_int(value, name, minimum=1)
        for name in ("is_high_priority_stream", "use_ring_broadcast"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        check_timeout(self.timeout_s, "timeout_s")
        if (
            self.accel_max_ctas is not None
            and self.accel_min_ctas is not None
            and self.accel_min_ctas > self.accel_max_ctas
        ):
            raise ValueError(
                f"accel_min_ctas ({self.accel_min_ctas}) must be <= accel_max_ctas "
                f"({self.accel_max_ctas})"
            )

    def is_empty_options(self) -> bool:
        """True when every field has its default (RLinf's helper)."""
        return self == CollectiveGroupOptions()

    def apply_nccl(self, opts: Any) -> None:
        """Set these options on a ``ProcessGroupNCCL.Options``."""
        opts.is_high_priority_stream = self.is_high_priority_stream
        for ours, nccl in (
            ("accel_cluster_size", "cga_cluster_size"),
            ("accel_max_ctas", "max_ctas"),
            ("accel_min_ctas", "min_ctas"),
        ):
            if getattr(self, ours) is not None:
                setattr(opts.config, nccl, getattr(self, ours))


def check_options(options: Any, arg: str = "options") -> CollectiveGroupOptions | None:
    """``None`` or a ``CollectiveGroupOptions`` (``TypeError`` naming ``arg`` otherwise)."""
    if options is not None and not isinstance(options, CollectiveGroupOptions):
        names = ", ".join(f.name for f in fields(CollectiveGroupOptions))
        raise TypeError(
            f"{arg} must be a CollectiveGroupOptions ({names}) or None, got "
            f"{type(options).__name__}"
        )
    return options
