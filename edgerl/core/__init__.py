"""Errors a user can cause, and the files edgerl writes for them (atomically)."""

VERSION = "0.1.0"   # the release: pyproject.toml reads it; edgerl.__version__, edgerl --version
