"""A run: the session that prepares it, the loop, the PPO update, state, checkpoints, metrics, ranks."""
