"""Observability: the metrics logger, the live progress display, the trace recorder, plots."""
