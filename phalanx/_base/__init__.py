"""Bottom layer: small utilities every layer uses (errors, timing, argument checks,
worker addresses, lazy exports). Imports nothing else from phalanx."""
