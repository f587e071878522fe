"""The ``edgerl`` command line (installed as ``edgerl.cli``)."""
