"""Top layer: the ``phalanx`` command line, run reports and cluster status."""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "main": ".main",
    },
)
