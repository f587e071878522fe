"""Tiny random llama-family models and slow reference computations for the rollout engine tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

# Prompts of different lengths (left padding inside one batch), token ids below every tiny vocab.
PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 99], [3], [250, 251, 252, 253, 254, 255, 256]]


def _shake(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """HF init leaves norm weights at 1 and biases at 0; move them so a wrong use of either shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_llama(seed: int = 0, *, tied: bool = True, dtype=torch.float32, device="cpu", **extra) -> LlamaForCausalLM:
    """3 layers, 4 query heads over 2 KV heads (GQA) unless `extra` says otherwise."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = LlamaConfig(**{**fields, **extra})
    return _shake(LlamaForCausalLM(cfg), seed).to(device=device, dtype=dtype)


def with_lora(model, seed: int = 0, dropout: float = 0.0):
    """A peft LoRA wrapper on every projection of `model`, with nonzero B (peft starts B at 0, which
    would hide a path that skips the adapter)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg).eval()


def perturbed(model_fn, scale: float = 0.05, seed: int = 9):
    """A fresh model from `model_fn` with every weight moved a little: what a training update sends."""
    model = model_fn()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    return model


def tiny_qwen2(seed: int = 1, *, tied: bool = False, dtype=torch.float32, device="cpu") -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=600, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, rope_theta=10000.0)
    model = _shake(Qwen2ForCausalLM(cfg), seed).to(device=device, dtype=dtype)
    assert model.model.layers[0].self_attn.q_proj.bias is not None   # the qkv biases are exercised
    return model


@torch.no_grad()
def recompute_logprobs(model, prompts, responses, temperature: float) -> list[list[float]]:
    """log_softmax(logits / T) at each response token from one full forward over left-padded
    prompt + response (right-padded), with HF's left-padding position ids."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    total = width + max(len(r) for r in responses)
    ids = torch.zeros((len(prompts), total), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, width - len(p):width + len(r)] = torch.tensor(p + r)
        mask[i, width - len(p):width + len(r)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device)).logits
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = []
    for i, r in enumerate(responses):
        at = torch.arange(width - 1, width - 1 + len(r), device=device)
        out.append(logp[i, at, torch.tensor(r, device=device)].tolist())
    return out


def logprob_gap(model, out, temperature: float) -> torch.Tensor:
    """|a generate call's sampled log-probs - recompute_logprobs'|, one value per response token (out: what the
    engine's generate returned)."""
    ref = recompute_logprobs(model, out.prompt_ids, out.response_ids, temperature)
    got = torch.tensor([x for row in out.logprobs for x in row])
    want = torch.tensor([x for row in ref for x in row])
    assert got.shape == want.shape and torch.isfinite(got).all(), (got.shape, want.shape)
    return (got - want).abs()


@torch.no_grad()
def next_token_logits(model, prompts, responses) -> list[torch.Tensor]:
    """For each row, the fp32 logits (len(response), V) that predicted each response token."""
    device = next(model.parameters()).device
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([p + r], device=device)
        logits = model(input_ids=ids).logits[0].float()
        out.append(logits[len(p) - 1:len(p) - 1 + len(r)])
    return out


def decode_attention_reference(q, k, v, start, col, scale: float) -> torch.Tensor:
    """The decode step's attention in float64, row by row and head by head: query head g of KV head h
    attends to columns start[b]..col of that KV head. q (B, KVH, G, D); k, v (B, KVH, S, D)."""
    B, KVH, G, D = q.shape
    out = torch.zeros((B, KVH, G, D), dtype=torch.float64)
    last = int(col[0])
    for b in range(B):
        first = int(start[b])
        for h in range(KVH):
            keys = k[b, h, first:last + 1].double().cpu()
            values = v[b, h, first:last + 1].double().cpu()
            for g in range(G):
                scores = keys @ q[b, h, g].double().cpu() * scale
                out[b, h, g] = torch.softmax(scores, 0) @ values
    return out


def decode_attention_cases(device) -> list[tuple]:
    """(name, q, k, v, start, col, tolerance) cases for the decode-attention kernel: grouped heads (G 1, 3,
    4, 20: padded to 16 and to 32), head sizes 16 to 128, caches not a whole number of blocks, windows of
    one column, whole blocks and block edges, every dtype. The tolerance is absolute, over outputs bounded
    by the values' largest magnitude (about 4): tight in fp32, a few 16-bit steps otherwise, where one
    column too many or too few moves a one-to-five-column window by about 0.1 or more."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 2, 3, 64, 80), (2, 4, 1, 32, 144), (2, 1, 20, 16, 64), (4, 2, 4, 128, 128)]
    cases = []
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        for B, KVH, G, D, S in shapes:
            q, k, v = (torch.randn(shape, generator=g).to(device=device, dtype=dtype)
                       for shape in ((B, KVH, G, D), (B, KVH, S, D), (B, KVH, S, D)))
            for last, starts in ((S - 1, [0, 5, 63, S - 1]), (63, [63, 62, 60, 59]), (64, [64, 0, 30, 61])):
                if last >= S:
                    continue
                start = torch.tensor(starts[:B], dtype=torch.long, device=device)
                col = torch.tensor([last], dtype=torch.long, device=device)
                cases.append((f"{str(dtype)[6:]}-B{B}-KVH{KVH}-G{G}-D{D}-S{S}-col{last}", q, k, v, start, col, tol))
    return cases


def rotate_reference(x, cos, sin):
    """The engine's rotary embedding (`StaticDecoder.rotate`) in the tensors' dtype, op by op: x (..., D),
    cos and sin broadcast to it, sin with rotate_half's sign folded in."""
    half = x.shape[-1] // 2
    r = torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
    return x * cos + r


def check_decode_attention_rope(case, bf16_exact: bool) -> None:
    """The fused rotary/cache-write/attention kernel on one of `decode_attention_cases`: its cache column
    equals the engine's rotation and write (bit for bit: the same rounding op by op; within the three
    roundings' steps in bf16 where `bf16_exact` is False), the other columns are untouched, and its output
    is the float64 attention over the window."""
    from edgerl.kernels.decode_attention import decode_attention_rope
    _, q, k, v, start, col, tol = case
    B, KVH, G, D = q.shape
    g = torch.Generator().manual_seed(B * D)
    new_k, new_v = (torch.randn((B, KVH, D), generator=g).to(device=q.device, dtype=q.dtype) for _ in range(2))
    qkv = torch.cat((q.reshape(B, -1), new_k.reshape(B, -1), new_v.reshape(B, -1)), dim=1)
    angle = torch.rand((B, D // 2), generator=g, dtype=torch.float64) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(device=q.device, dtype=q.dtype)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(device=q.device, dtype=q.dtype)
    kc, vc = k.clone(), v.clone()
    scale = D ** -0.5
    got = decode_attention_rope(qkv, cos, sin, kc, vc, start, col, scale, G)
    c = int(col[0])
    want_k = rotate_reference(new_k, cos[:, None], sin[:, None])
    if q.dtype == torch.bfloat16 and not bf16_exact:   # each of three roundings may be a step off: 2^-8 of the operands
        size = new_k.float().abs() + torch.cat((new_k[..., D // 2:], new_k[..., :D // 2]), -1).float().abs()
        assert ((kc[:, :, c].float() - want_k.float()).abs() <= 2 ** -6 * size).all()
    else:
        assert torch.equal(kc[:, :, c], want_k)
    assert torch.equal(vc[:, :, c], new_v)
    others = [i for i in range(k.shape[2]) if i != c]
    assert torch.equal(kc[:, :, others], k[:, :, others]) and torch.equal(vc[:, :, others], v[:, :, others])
    want = decode_attention_reference(rotate_reference(q, cos[:, None, None], sin[:, None, None]), kc, vc, start,
                                      col, scale)
    assert got.shape == q.shape and (got.double().cpu() - want).abs().max() <= tol


def tiny_qwen3(seed: int = 2, *, tied: bool = True, dtype=torch.float32, device="cpu", **extra):
    """Qwen3-1.7B's shape at tiny widths: tied embeddings, GQA, an explicit head_dim (32, not hidden / heads),
    q/k norms on every head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=tied,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return _shake(Qwen3ForCausalLM(Qwen3Config(**{**fields, **extra})), seed).to(device=device, dtype=dtype)


def tiny_gemma3(seed: int = 3, *, window: int = 6, dtype=torch.float32, device="cpu", **extra):
    """Gemma-3-1B's shape at tiny widths: one KV head, head_dim 16 != hidden / heads, sliding-window layers
    (window 6, shorter than the prompts) around a full-attention one with their own rope base, and the
    settings Gemma 3 leaves at their defaults moved: query_pre_attn_scalar (20, not head_dim), final logit
    soft-capping at 3 (random logits reach it) and attention soft-capping at 2 (which Gemma3Attention does
    not apply)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    fields = dict(vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
                  sliding_window=window, query_pre_attn_scalar=20, final_logit_softcapping=3.0,
                  attn_logit_softcapping=2.0, bos_token_id=2, eos_token_id=511, pad_token_id=0,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**fields, **extra}))
    return _shake(model, seed).to(device=device, dtype=dtype)
