"""One row per architecture (`config.json`'s model_type): what every part of edgerl needs to know about it.

The plan reads a row for the shapes it counts (`modelspec.py`), the rollout engine it can use (`engines.py`), the
LoRA targets, shared prompts and the fp16 rule (`decisions.py`, `fp16.py`); the static decoder
(`rollout/arch.py`) for the modules it reads and the layer variant it computes; `edgerl export` for the GGUF
family. Whether edgerl's static decoder runs a model is this table's `static`, read at plan time and again when
the model is loaded, so the two cannot disagree. An architecture without a row is any other dense decoder-only
model transformers loads: the plan counts it with a gated MLP and llama-named projections, and transformers'
`generate` runs its rollout.

Adding a llama-identical architecture is one row (`replace(ARCHITECTURES["llama"], ...)` with its model_type, HF
class and examples) and its test (tests/test_architecture_table_on_cpu.py adds one and sees it plan, decode
against HF and train). One whose layer differs also needs that layer in rollout/arch.py (read from the row's
fields) and a test against HF's forward (tests/test_architectures_on_cpu.py). docs/models.md's table is
`table()` (`python -m edgerl.plan.archs`; a test compares them).

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

# All attention and MLP projections, not peft's q/v default: QLoRA (Dettmers et al., 2023) found adapters
# on every linear layer of the block necessary to match full fine-tuning; at r=16 they stay ~1% of the base.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The decode backends whose kernels fuse llama's RMS norms into the layer (plan/engines.py's DECODE_BACKENDS)
FUSED_NORM_BACKENDS = ("triton-layers", "cuda-c")
GEMMA_NORMS = ("(1 + weight) RMS norms around attention and the MLP are not the llama-style norms the kernels "
               "fuse")


@dataclass(frozen=True)
class Gguf:
    """How `edgerl export --format gguf` writes the architecture (llama.cpp's names)."""
    arch: str                   # GGUF general.architecture
    permute_qk: bool = False    # llama: HF's rotate-half rows to GGML's interleaved pairs
    norm_plus_one: bool = False  # Gemma's RMS norm scales by 1 + w, GGML's by w


@dataclass(frozen=True)
class Architecture:
    model_type: str
    family: str                        # how docs and messages name it
    examples: str = ""
    hf_class: str = ""                 # the class AutoModelForCausalLM loads ("" where edgerl does not check it)
    layout: str = "llama"              # its linear layers' names (`LAYOUTS`): llama, phi3 (fused), gpt_neox
    mlp: str = "gated"                 # "gated": down(act(gate(x)) * up(x)); "plain": down(act(up(x)))
    qkv_bias: bool = False             # biases on q, k and v where config.json does not say (attention_bias)
    qk_norm: bool = False              # an RMS norm on each query and key head, before the rotary embedding
    norm: str = "rms"                  # "rms": llama's, weight * normed; "gemma": (1 + weight) in fp32, one rounding
    sandwich_norms: bool = False       # the attention and MLP outputs normed again before the residual add, the
    #                                    MLP's input by pre_feedforward_layernorm (Gemma)
    embed_scale: bool = False          # embeddings times sqrt(hidden), done by the model's own embedding module
    softcap: bool = False              # final_logit_softcapping: logits = cap * tanh(logits / cap)
    sliding_pattern: Optional[int] = None   # one full-attention layer in this many (configs before layer_types)
    rope_per_layer_type: bool = False  # a rotary table per layer type (Gemma 3's rope_local_base_freq)
    lora_targets: Optional[tuple[str, ...]] = None   # LoRA's default targets; None: lora.target_modules must name them
    packed: bool = False               # shared prompts: its HF layers hand attention keywords on (checked by a test)
    static: bool = False               # edgerl's static-cache decoder implements its forward
    static_note: str = ""              # what the static decoder does differently for it (docs/models.md)
    fused_norms: str = ""              # why FUSED_NORM_BACKENDS cannot compute its layers ("" : they can)
    fp16_overflow: Optional[str] = None   # its released weights overflow fp16: the family the plan names
    #                                       (docs/hardware.md, fp16 overflow)
    gguf: Optional[Gguf] = None        # None: edgerl export does not write it as GGUF

    def layer_modules(self) -> list[str]:
        """The module paths of a decoder layer the static decoder reads (it refuses a model that lacks one)."""
        out = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
        if self.qk_norm:
            out += ["self_attn.q_norm", "self_attn.k_norm"]
        if self.sandwich_norms:
            out += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        return out

    def fused_norms_reason(self) -> str:
        """Why the decode kernels that fuse llama's RMS norms cannot compute its layers ("" where they can)."""
        return f"{self.model_type}'s {self.fused_norms}" if self.fused_norms else ""

    def decode_backends(self, backends: tuple[str, ...]) -> dict[str, str]:
        """Of `backends` (plan/engines.py's DECODE_BACKENDS), why each cannot run this architecture ("" where it
        can): the static engine's backends all run what the static decoder runs, but those that fuse llama's
        RMS norms."""
        if not self.static:
            return {b: "edgerl's static-cache decoder does not run it" for b in backends}
        return {b: self.fused_norms_reason() if b in FUSED_NORM_BACKENDS else "" for b in backends}


def _layout_llama(h: int, i: int, q: int, kv: int, gated: bool) -> dict[str, tuple[int, int]]:
    mlp = {"gate_proj": (h, i), "up_proj": (h, i)} if gated else {"up_proj": (h, i)}
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), **mlp, "down_proj": (i, h)}


def _layout_phi3(h: int, i: int, q: int, kv: int, gated: bool) -> dict[str, tuple[int, int]]:
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def _layout_gpt_neox(h: int, i: int, q: int, kv: int, gated: bool) -> dict[str, tuple[int, int]]:
    return {"query_key_value": (h, q + 2 * kv), "dense": (q, h), "dense_h_to_4h": (h, i), "dense_4h_to_h": (i, h)}


# (in, out) of each linear layer of one decoder layer, by its HF module name, from (hidden, intermediate, q width,
# kv width, gated MLP)
LAYOUTS = {"llama": _layout_llama, "phi3": _layout_phi3, "gpt_neox": _layout_gpt_neox}

_LLAMA = Architecture("llama", "Llama", "Llama 3.x, SmolLM2", hf_class="LlamaForCausalLM",
                      lora_targets=DEFAULT_LORA_TARGETS, packed=True, static=True,
                      static_note="edgerl's static KV cache, decode step in a CUDA graph",
                      gguf=Gguf("llama", permute_qk=True))
_GEMMA3 = Architecture("gemma3_text", "Gemma 3", "Gemma 3 270M, 1B", hf_class="Gemma3ForCausalLM", qk_norm=True,
                       norm="gemma", sandwich_norms=True, embed_scale=True, softcap=True, sliding_pattern=6,
                       rope_per_layer_type=True, lora_targets=DEFAULT_LORA_TARGETS, static=True,
                       static_note="scaled embedding, (1 + weight) norms around attention and MLP, "
                                   "`query_pre_attn_scalar`, local and global rope bases, sliding-window layers, "
                                   "final logit soft-capping",
                       fused_norms=GEMMA_NORMS, fp16_overflow="Gemma 3", gguf=Gguf("gemma3", norm_plus_one=True))

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in [
    _LLAMA,
    replace(_LLAMA, model_type="qwen2", family="Qwen2", examples="Qwen2.5, DeepSeek-R1 distills of Qwen",
            hf_class="Qwen2ForCausalLM", qkv_bias=True, static_note="", gguf=Gguf("qwen2")),
    replace(_LLAMA, model_type="mistral", family="Mistral", examples="Mistral 7B (sliding window included)",
            hf_class="MistralForCausalLM", packed=False, static_note=""),
    replace(_LLAMA, model_type="qwen3", family="Qwen3", examples="Qwen3 0.6B to 32B (dense)",
            hf_class="Qwen3ForCausalLM", qk_norm=True, packed=False, static_note="q/k norms on every head",
            gguf=Gguf("qwen3")),
    _GEMMA3,
    replace(_GEMMA3, model_type="gemma3", examples="Gemma 3 4B and up (vision-language)",
            hf_class="Gemma3ForConditionalGeneration", embed_scale=False, softcap=False, sliding_pattern=None,
            rope_per_layer_type=False, static=False, static_note="", fused_norms="", gguf=None),
    Architecture("gemma2", "Gemma 2", "Gemma 2", norm="gemma", sandwich_norms=True, softcap=True, sliding_pattern=2),
    Architecture("gemma4_text", "Gemma 4", fp16_overflow="Gemma 4"),
    Architecture("gemma4", "Gemma 4", fp16_overflow="Gemma 4"),
    Architecture("phi3", "Phi-3", "Phi-3", layout="phi3",
                 lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),   # Phi-3 fuses q/k/v and gate/up
    Architecture("gpt_neox", "GPT-NeoX", "GPT-NeoX, Pythia", layout="gpt_neox", mlp="plain"),
    *[Architecture(t, t, mlp="plain") for t in ("gpt2", "gptj", "gpt_neo", "opt", "falcon", "phi", "bloom", "mpt",
                                                "gpt_bigcode", "starcoder2", "codegen")],
]}


def architecture(model_type: str) -> Architecture:
    """The row of `model_type`, or the default row of any other decoder-only model (no static decoder, a gated
    MLP with llama-named projections, no LoRA defaults)."""
    return ARCHITECTURES.get(model_type) or Architecture(model_type, model_type or "this architecture")


def static_types() -> list[str]:
    """The model types edgerl's static decoder runs, in the table's order."""
    return [a.model_type for a in ARCHITECTURES.values() if a.static]


def lora_defaults() -> list[str]:
    return [a.model_type for a in ARCHITECTURES.values() if a.lora_targets]


def table() -> str:
    """docs/models.md's table of which engine runs the rollout, by architecture."""
    rows = ["| architecture (`model_type`) | examples | rollout engine |", "|---|---|---|"]
    for a in ARCHITECTURES.values():
        if a.static:
            engine = "`static`" + (f": {a.static_note}" if a.model_type == "llama" else
                                   f" ({a.static_note})" if a.static_note else "")
            rows.append(f"| `{a.model_type}` | {a.examples} | {engine} |")
    others = ", ".join(a.examples for a in ARCHITECTURES.values() if a.examples and not a.static)
    rows.append(f"| any other causal LM | {others}, OLMo, Granite, Cohere | `hf-generate`: transformers' `generate` |")
    rows.append("| mixture of experts | Qwen3-30B-A3B, Mixtral, DeepSeek-V3 | refused when planning, with the reason |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
