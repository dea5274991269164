"""Observability used by the algorithms: the metrics logger and the live progress display."""
