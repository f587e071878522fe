"""`python -m edgerl.cli` runs the `edgerl` command."""

from .main import main

main()
