"""edgerl: hardware-adaptive RL fine-tuning of LLMs on the GPUs people actually have."""

__version__ = "0.1.0"
