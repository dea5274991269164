"""Data layer: ``BatchedDataDict`` (NeMo-RL's batch container), its sharding and packing."""

from __future__ import annotations

from phalanx.data.batched_data_dict import BatchedDataDict

__all__ = ["BatchedDataDict"]
