"""Bottom layer: small utilities every layer uses (errors, timing, the trace recorder,
worker addresses, lazy exports). Imports nothing else from phalanx."""
