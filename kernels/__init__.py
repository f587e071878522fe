"""Fused, chunked token log-probabilities and entropy (installed as ``edgerl.kernels``)."""
