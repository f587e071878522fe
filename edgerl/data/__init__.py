"""Training prompts: files, HF datasets, the built-in task and GSM8K, the sampler."""
