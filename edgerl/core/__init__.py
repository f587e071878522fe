"""Errors a user can cause, and the files edgerl writes for them (atomically)."""

VERSION = "0.1.0"   # pyproject.toml's version; edgerl.__version__
