"""Rewards: rule scorers by data source, user functions, reward models."""
