"""Actor, critic and reference: loading, LoRA, quantized bases, FSDP2, the embedded model."""
