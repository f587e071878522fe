"""`edgerl doctor`: is this machine ready, and if not, what to fix."""
