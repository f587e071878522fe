"""Rollout engines behind one interface: ``hf`` (static KV cache + CUDA graphs on GPU) and ``vllm``."""
