"""Layer 8: algorithms (PPO, GRPO) built on phalanx groups."""
