"""Top layer: the ``phalanx`` command line, run reports and cluster status."""

from __future__ import annotations

from phalanx.cli.main import main

__all__ = ["main"]
