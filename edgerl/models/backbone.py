"""Any HF causal LM as the trainer sees it: a backbone that maps token ids to the last hidden states, its
decoder layers (what FSDP2 wraps one by one), and an output head whose logits the log-prob kernel
computes from those hidden states without materialising them.

Architectures name these differently (`model.layers` for llama/qwen/gemma, `gpt_neox.layers` and
`embed_out` for GPT-NeoX, `transformer.h` for GPT-2) and some transform the head's logits before the
softmax: Gemma's soft-capping, `cap * tanh(logits / cap)` (`final_logit_softcapping`), Cohere's
`logits * logit_scale`, Granite's `logits / logits_scaling`. The trainer's log-probs must be the
model's own (the rollout samples from them), so each transform is applied here;
tests/test_architectures_on_cpu.py checks `head_logits` against the model's forward for every
architecture it names.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from edgerl.core.errors import ModelError


def backbone(lm: nn.Module) -> nn.Module:
    """The module that returns `last_hidden_state` (`LlamaModel`, `GPTNeoXModel`, ...)."""
    base = getattr(lm, "base_model", None)   # PreTrainedModel: the attribute named by base_model_prefix
    if base is None or base is lm:
        raise ModelError(f"{type(lm).__name__} has no base model (transformers' base_model_prefix); edgerl trains "
                         "causal LMs that transformers loads with AutoModelForCausalLM")
    return base


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers: the backbone's one ModuleList of blocks (`layers`, `h`, `blocks`), or its
    language model's (a vision-language model such as Gemma 3 4B)."""
    base = backbone(lm)
    base = getattr(base, "language_model", base)
    for name in ("layers", "h", "blocks", "block"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    raise ModelError(f"{type(lm).__name__}: no decoder layers found ({type(base).__name__} has no 'layers' or 'h' "
                     "ModuleList); edgerl wraps decoder-only models layer by layer")


def output_head(lm: nn.Module) -> nn.Module:
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ModelError(f"{type(lm).__name__}'s output layer is {type(head).__name__}"
                         f"{' with a bias' if isinstance(head, nn.Linear) else ''}; edgerl's log-prob kernel "
                         "computes logits as hidden @ weight.T (no bias)")
    return head


def drop_output_head(lm: nn.Module) -> None:
    """Replace the output layer with an identity (a critic reads the backbone alone; frees V x h)."""
    head = lm.get_output_embeddings()
    for name, child in lm.named_children():
        if child is head:
            setattr(lm, name, nn.Identity())
            return


def logit_transform(config) -> tuple[float, Optional[float]]:
    """(scale, cap): the model's logits are `cap * tanh(scale * z / cap)` of the head's z = h @ W.T (no cap:
    `scale * z`). Gemma's final_logit_softcapping, Cohere's logit_scale, Granite's 1 / logits_scaling: read
    from the model's own config, not a text_config inside it, as the causal-LM classes read them
    (Gemma3ForConditionalGeneration does not cap, whatever its text_config says)."""
    cfg = config
    scale = 1.0
    if getattr(cfg, "logit_scale", None):
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return scale, (float(cap) if cap else None)


def softcapped_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: float,
                        scale: float, cap: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probs and entropy (N,) fp32 of softmax(cap * tanh(scale * h @ W.T / cap) * inv_temp), in plain
    torch, `chunk` tokens at a time, each chunk recomputed in the backward (activation checkpointing), so
    that only chunk x V logits live at once. hidden (N, H), weight (V, H), targets (N,). Models with soft
    capping take this path instead of the fused log-prob kernels, which do not cap."""
    from torch.utils.checkpoint import checkpoint

    def part(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
        z = (h @ w.t()).float() * scale
        z = torch.tanh(z / cap) * cap * inv_temp
        logp = torch.log_softmax(z, -1)
        return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    outs = [checkpoint(part, hidden[i:i + chunk], weight, targets[i:i + chunk], use_reentrant=False)
            for i in range(0, hidden.shape[0], chunk)]
    if not outs:
        zero = (hidden.sum() + weight.sum()).float() * 0
        return hidden.new_zeros(0, dtype=torch.float32) + zero, hidden.new_zeros(0, dtype=torch.float32) + zero
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
