"""Data layer: ``BatchedDataDict`` (NeMo-RL's batch container), its sharding and packing."""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "BatchedDataDict": ".batched_data_dict",
    },
)
