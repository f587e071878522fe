"""Errors a user can cause, and the files edgerl writes for them (atomically)."""
