"""Model shapes for planning: from an HF config (a local folder, a config.json, or a Hugging Face id), or
a built-in catalogue usable offline.

The planner needs sizes, not weights: parameter counts per component, KV-cache bytes per token (per
layer, where some attend through a sliding window), and the LoRA parameter count for a set of target
modules. Any dense decoder-only model transformers loads as a causal LM is described from its config's
fields; mixture-of-experts models are refused with the reason.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional
from edgerl.core.errors import ModelSpecError
from edgerl.core.hub import config_file, is_hub_id
from edgerl.plan.archs import LAYOUTS, architecture
from edgerl.plan.fp16 import ActivationRecord




@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool
    head_dim: int = 0               # 0: hidden_size // num_heads
    qkv_bias: bool = False          # qwen2 has biases on q, k and v
    max_position: int = 4096
    source: str = "catalogue"
    rope_type: str = "default"      # the static rollout engine implements default, linear, llama3 and yarn
    sliding_window: Optional[int] = None   # set only where the model really uses windowed attention
    hidden_act: str = "silu"        # the MLP's activation (config.json's hidden_act)
    sliding_layers: int = 0         # layers that attend through the window (the others attend to every token)
    # the architecture's (plan/archs.py) where None: q/k norms; Gemma's norms also after attention and the MLP;
    # "gated": down(act(gate(x)) * up(x)), "plain": down(act(up(x))) (GPT-NeoX)
    qk_norm: Optional[bool] = None
    sandwich_norms: Optional[bool] = None
    mlp: Optional[str] = None
    final_softcap: Optional[float] = None   # logits = cap * tanh(logits / cap) (Gemma's final_logit_softcapping)
    activations: Optional[ActivationRecord] = None   # the weights' calibrated largest activations (plan/fp16.py)

    def __post_init__(self) -> None:
        arch = architecture(self.model_type)
        for name, value in (("qk_norm", arch.qk_norm), ("sandwich_norms", arch.sandwich_norms), ("mlp", arch.mlp)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.sliding_window is not None and not self.sliding_layers:
            object.__setattr__(self, "sliding_layers", self.num_layers)   # a window on every layer (Mistral)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.hd

    @property
    def fast_engine(self) -> bool:
        """Whether edgerl's static-cache decoder implements this architecture (plan/archs.py's `static`)."""
        return architecture(self.model_type).static

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by its HF module name."""
        layout = LAYOUTS[architecture(self.model_type).layout]
        return layout(self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.mlp == "gated")

    def layer_params(self) -> int:
        linear = sum(a * b for a, b in self.module_shapes().values())
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        norms = (4 if self.sandwich_norms else 2) * self.hidden_size + (2 * self.hd if self.qk_norm else 0)
        return linear + bias + norms

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def n_params(self) -> int:
        """All parameters, counting a tied embedding once."""
        head = 0 if self.tie_embeddings else self.embedding_params()
        return self.embedding_params() + head + self.num_layers * self.layer_params() + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer, one token."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def kv_bytes(self, seq_len: int, dtype_bytes: int, windowed: bool) -> int:
        """K and V of one sequence of `seq_len` tokens. windowed: a cache that keeps only the last
        `sliding_window` tokens of the layers that attend through the window (HF's DynamicCache does;
        edgerl's static cache keeps every token of every layer)."""
        if not windowed or self.sliding_window is None:
            return seq_len * self.kv_bytes_per_token(dtype_bytes)
        full = self.num_layers - self.sliding_layers
        tokens = full * seq_len + self.sliding_layers * min(seq_len, self.sliding_window)
        return 2 * tokens * self.kv_dim * dtype_bytes

    def lora_params(self, rank: int, targets: tuple[str, ...] | list[str]) -> int:
        """Adapter parameters: r x (in + out) per targeted linear layer, over all layers."""
        shapes = self.module_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ModelSpecError(f"LoRA target modules {unknown} are not linear layers of {self.model_type}; "
                                 f"choose from {', '.join(shapes)}")
        return self.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)

    def llama_config_fields(self) -> dict[str, int]:
        """The width fields of an HF LlamaConfig with this shape (for random-weight benchmark models)."""
        return dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    intermediate_size=self.intermediate_size)

    def describe(self) -> str:
        window = (f", {self.sliding_layers} of {self.num_layers} layers attend through a {self.sliding_window}-token "
                  f"window" if self.sliding_window else "")
        return (f"{self.name}: {self.n_params() / 1e6:.0f}M parameters, {self.num_layers} layers, hidden "
                f"{self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV heads, vocabulary "
                f"{self.vocab_size}{', tied embeddings' if self.tie_embeddings else ''}{window}")


# Shapes from each model's config.json on the Hugging Face Hub (huggingface.co/<id>/blob/main/config.json;
# for Gemma 3 4B, a vision-language model, its text_config: the language model; the vision tower, about 0.4B
# parameters, is not counted).
CATALOGUE: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("qwen2.5-0.5b", "qwen2", 151936, 896, 24, 14, 2, 4864, True, qkv_bias=True, max_position=32768),
    ModelSpec("qwen2.5-1.5b", "qwen2", 151936, 1536, 28, 12, 2, 8960, True, qkv_bias=True, max_position=32768),
    ModelSpec("qwen2.5-3b", "qwen2", 151936, 2048, 36, 16, 2, 11008, True, qkv_bias=True, max_position=32768),
    ModelSpec("qwen2.5-7b", "qwen2", 152064, 3584, 28, 28, 4, 18944, False, qkv_bias=True, max_position=32768),
    ModelSpec("qwen3-0.6b", "qwen3", 151936, 1024, 28, 16, 8, 3072, True, head_dim=128, max_position=40960),
    ModelSpec("qwen3-1.7b", "qwen3", 151936, 2048, 28, 16, 8, 6144, True, head_dim=128, max_position=40960),
    ModelSpec("qwen3-4b", "qwen3", 151936, 2560, 36, 32, 8, 9728, True, head_dim=128, max_position=40960),
    ModelSpec("qwen3-8b", "qwen3", 151936, 4096, 36, 32, 8, 12288, False, head_dim=128, max_position=40960),
    # every 6th layer attends to all tokens, the others through the window (sliding_window_pattern 6)
    ModelSpec("gemma-3-1b", "gemma3_text", 262144, 1152, 26, 4, 1, 6912, True, head_dim=256, max_position=32768,
              sliding_window=512, sliding_layers=22, hidden_act="gelu_pytorch_tanh"),
    ModelSpec("gemma-3-4b", "gemma3", 262208, 2560, 34, 8, 4, 10240, True, head_dim=256, max_position=131072,
              rope_type="linear", sliding_window=1024, sliding_layers=29, hidden_act="gelu_pytorch_tanh"),
    ModelSpec("llama-3.2-1b", "llama", 128256, 2048, 16, 32, 8, 8192, True, head_dim=64, max_position=131072, rope_type="llama3"),
    ModelSpec("llama-3.2-3b", "llama", 128256, 3072, 28, 24, 8, 8192, True, head_dim=128, max_position=131072, rope_type="llama3"),
    ModelSpec("llama-3.1-8b", "llama", 128256, 4096, 32, 32, 8, 14336, False, head_dim=128, max_position=131072, rope_type="llama3"),
    ModelSpec("smollm2-135m", "llama", 49152, 576, 30, 9, 3, 1536, True, max_position=8192),
    ModelSpec("smollm2-360m", "llama", 49152, 960, 32, 15, 5, 2560, True, max_position=8192),
    ModelSpec("smollm2-1.7b", "llama", 49152, 2048, 24, 32, 32, 8192, True, max_position=8192),
]}
# HF ids and the embedded default map onto catalogue shapes (an -Instruct model has its base's shape).
ALIASES = {
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b", "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "qwen/qwen2.5-1.5b": "qwen2.5-1.5b", "qwen/qwen2.5-1.5b-instruct": "qwen2.5-1.5b",
    "qwen/qwen2.5-3b": "qwen2.5-3b", "qwen/qwen2.5-3b-instruct": "qwen2.5-3b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen3-0.6b": "qwen3-0.6b", "qwen/qwen3-0.6b-base": "qwen3-0.6b",
    "qwen/qwen3-1.7b": "qwen3-1.7b", "qwen/qwen3-1.7b-base": "qwen3-1.7b",
    "qwen/qwen3-4b": "qwen3-4b", "qwen/qwen3-4b-base": "qwen3-4b",
    "qwen/qwen3-8b": "qwen3-8b", "qwen/qwen3-8b-base": "qwen3-8b",
    "google/gemma-3-1b-it": "gemma-3-1b", "google/gemma-3-1b-pt": "gemma-3-1b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b", "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b", "meta-llama/llama-3.2-3b-instruct": "llama-3.2-3b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "huggingfacetb/smollm2-135m": "smollm2-135m", "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m", "huggingfacetb/smollm2-360m-instruct": "smollm2-360m",
    "smollm2-360m-instruct": "smollm2-360m", "huggingfacetb/smollm2-1.7b-instruct": "smollm2-1.7b",
    "smollm2-1.7b-instruct": "smollm2-1.7b", "huggingfacetb/smollm2-360m": "smollm2-360m",
    "huggingfacetb/smollm2-1.7b": "smollm2-1.7b",
}


# Catalogue names -> the Hugging Face ids they describe (base models; -Instruct variants share the shape).
HF_IDS = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B", "qwen2.5-3b": "Qwen/Qwen2.5-3B",
          "qwen2.5-7b": "Qwen/Qwen2.5-7B", "qwen3-0.6b": "Qwen/Qwen3-0.6B-Base", "qwen3-1.7b": "Qwen/Qwen3-1.7B-Base",
          "qwen3-4b": "Qwen/Qwen3-4B-Base", "qwen3-8b": "Qwen/Qwen3-8B-Base", "gemma-3-1b": "google/gemma-3-1b-pt",
          "gemma-3-4b": "google/gemma-3-4b-pt", "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
          "llama-3.2-3b": "meta-llama/Llama-3.2-3B", "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
          "smollm2-135m": "HuggingFaceTB/SmolLM2-135M", "smollm2-360m": "HuggingFaceTB/SmolLM2-360M",
          "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B", "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


# Config keys of the same quantity across architectures (GPT-2 and GPT-NeoX name them their own way)
_KEYS = {"hidden": ("hidden_size", "n_embd", "d_model"), "layers": ("num_hidden_layers", "n_layer", "num_layers"),
         "heads": ("num_attention_heads", "n_head", "num_heads"),
         "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv"),
         "inter": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
         "act": ("hidden_act", "hidden_activation", "activation_function"),
         "positions": ("max_position_embeddings", "n_positions", "max_seq_len")}
# Keys whose value counts the experts of a mixture-of-experts layer
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _get(cfg: dict[str, Any], what: str, default: Any = None) -> Any:
    for key in _KEYS[what]:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _rope(text_cfg: dict[str, Any]) -> str:
    rp = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        return "default"
    if rp and all(isinstance(v, dict) for v in rp.values()):   # one set per layer type (Gemma 3)
        kinds = [str(v.get("rope_type", v.get("type", "default"))) for v in rp.values()]
        return next((k for k in kinds if k not in STATIC_ROPE), next((k for k in kinds if k != "default"), "default"))
    return str(rp.get("rope_type", rp.get("type", "default")))


STATIC_ROPE = ("default", "linear", "llama3", "yarn")   # inverse frequencies fixed at init


def _window(text_cfg: dict[str, Any], layers: int) -> tuple[Optional[int], int]:
    """(window, layers attending through it), or (None, 0) where no layer does."""
    window = text_cfg.get("sliding_window")
    if not window:
        return None, 0
    types = text_cfg.get("layer_types") or []
    if types:
        n = sum(t == "sliding_attention" for t in types)
    elif (pattern := text_cfg.get("sliding_window_pattern")
                     or architecture(str(text_cfg.get("model_type", ""))).sliding_pattern):
        n = sum(1 for i in range(layers) if (i + 1) % int(pattern))
    else:
        n = layers if text_cfg.get("use_sliding_window", True) else 0
    return (int(window), n) if n else (None, 0)


def moe_reason(cfg: dict[str, Any]) -> Optional[str]:
    """Why a config describes a mixture-of-experts model, or None."""
    text_cfg = cfg.get("text_config", cfg)
    model_type = str(text_cfg.get("model_type", ""))
    for key in _MOE_KEYS:
        n = text_cfg.get(key)
        if isinstance(n, int) and n > 1:
            return f"{key}={n}"
    return f"model_type {model_type!r}" if "moe" in model_type else None


def _normalized(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers reads it, where transformers knows its model_type: the fields a config.json
    leaves at their defaults filled in (Gemma 3 4B's text_config names only five), older names turned into
    newer ones (Gemma 3's sliding_window_pattern into layer_types, rope_theta and rope_local_base_freq into
    rope_parameters). Anything transformers cannot read is planned from the file as it is."""
    try:
        from transformers import AutoConfig
        obj = AutoConfig.for_model(str(cfg.get("model_type", "")), **{k: v for k, v in cfg.items() if k != "model_type"})
        text = obj.get_text_config()
        out = dict(text.to_dict())
        if text is not obj:
            out["tie_word_embeddings"] = getattr(obj, "tie_word_embeddings", out.get("tie_word_embeddings"))
        return out
    except Exception:   # an unknown model_type (remote code), a config transformers refuses, no transformers
        return dict(cfg.get("text_config", cfg), tie_word_embeddings=cfg.get(
            "tie_word_embeddings", cfg.get("text_config", cfg).get("tie_word_embeddings", False)))


def from_hf_config(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    """A spec from the fields of an HF config.json, any decoder-only architecture (its text_config for a
    vision-language model). Mixture-of-experts models are refused: each token runs a few of many expert
    MLPs, which neither the memory model nor the rollout engines count or implement."""
    model_type = str(cfg.get("text_config", cfg).get("model_type", ""))
    if cfg.get("is_encoder_decoder") or cfg.get("text_config", cfg).get("is_encoder_decoder"):
        raise ModelSpecError(f"{source}: model_type {model_type!r} is an encoder-decoder model; edgerl trains "
                             "decoder-only causal language models")
    text_cfg = None
    for c in (cfg, None):
        if c is None:
            text_cfg = _normalized(cfg)
            c = text_cfg
        if (moe := moe_reason(c)) is not None:
            raise ModelSpecError(f"{source}: a mixture-of-experts model ({moe}); edgerl trains dense decoder-only "
                                 "models (its memory model and rollout engines count and run one MLP per layer), "
                                 "e.g. Qwen3 (qwen3-8b) instead of Qwen3-30B-A3B")
    # a vision-language model keeps its own type (gemma3, not its text model's gemma3_text): what loads is the
    # whole model, which edgerl's static decoder does not implement
    model_type = str(cfg.get("model_type") or text_cfg.get("model_type") or model_type)
    try:
        hidden, layers, heads = int(_get(text_cfg, "hidden")), int(_get(text_cfg, "layers")), int(_get(text_cfg, "heads"))
        window, sliding = _window(text_cfg, layers)
        kv = _get(text_cfg, "kv_heads") or (1 if text_cfg.get("multi_query") else heads)
        arch = architecture(model_type)
        return ModelSpec(
            name=name, model_type=model_type, rope_type=_rope(text_cfg), sliding_window=window, sliding_layers=sliding,
            vocab_size=int(text_cfg["vocab_size"]), hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(kv), intermediate_size=int(_get(text_cfg, "inter") or 4 * hidden),
            tie_embeddings=bool(text_cfg.get("tie_word_embeddings", False)),
            head_dim=int(text_cfg.get("head_dim") or 0),
            qkv_bias=bool(text_cfg.get("attention_bias", arch.qkv_bias)),
            max_position=int(_get(text_cfg, "positions", 4096)),
            hidden_act=str(_get(text_cfg, "act", "silu")), source=source,
            final_softcap=text_cfg.get("final_logit_softcapping"))
    except KeyError as e:
        raise ModelSpecError(f"{source}: config.json lacks {e.args[0]!r}; edgerl plans for decoder-only "
                             "causal language models") from None
    except (TypeError, ValueError):
        keys = ", ".join(k[0] for k in (_KEYS["hidden"], _KEYS["layers"], _KEYS["heads"]))
        raise ModelSpecError(f"{source}: config.json has no usable {keys} (or their GPT-2 names); edgerl plans for "
                             "decoder-only causal language models") from None


def resolve(name_or_path: str) -> ModelSpec:
    """A catalogue name or alias, a local HF folder (its config.json), a config.json file, or a Hugging Face
    id (its config.json alone, from huggingface_hub's cache or downloaded into it)."""
    key = name_or_path.strip().lower()
    if key in CATALOGUE:
        return CATALOGUE[key]
    if key in ALIASES:
        return replace(CATALOGUE[ALIASES[key]], name=name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ModelSpecError(f"model folder {path} has no config.json; point --model at an HF model "
                                 "folder (the one holding config.json and the weights)")
        return from_hf_config(_read_json(cfg_file), path.name, str(cfg_file))
    if path.is_file() and path.suffix == ".json":
        return from_hf_config(_read_json(path), path.stem, str(path))
    if is_hub_id(name_or_path):   # its config.json from the HF cache, downloaded there first if missing
        found = config_file(name_or_path)
        return from_hf_config(_read_json(found), name_or_path, f"{name_or_path} ({found})")
    if name_or_path.startswith((".", "/", "~")):
        raise ModelSpecError(f"model folder {name_or_path} does not exist")
    close = difflib.get_close_matches(key, list(CATALOGUE) + list(ALIASES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ModelSpecError(f"unknown model {name_or_path!r}.{hint} Built-in shapes: {', '.join(CATALOGUE)}; "
                         "or pass a local HF folder or a Hugging Face id (owner/name)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"{path} is not valid JSON: {e}") from None


def classifier_params(name_or_path: str) -> int:
    """Parameters of a sequence-classification reward model from its local config: exact for the
    architectures edgerl trains, else embeddings + layers x (4 h^2 attention + 2 h x intermediate MLP).
    The plan needs its bytes, not its exact shape. Raises ModelSpecError when no config is found."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        cfg_file = path / "config.json"
    elif is_hub_id(name_or_path):
        try:
            cfg_file = config_file(name_or_path)
        except ModelSpecError as e:
            raise ModelSpecError(f"reward.model: {e}") from None
    else:
        raise ModelSpecError(f"reward.model={name_or_path!r}: no config.json there; point reward.model at a local HF "
                             "folder or a Hugging Face id (owner/name)")
    full = _read_json(cfg_file)
    cfg = full.get("text_config", full)
    try:   # exact for a decoder (its LM head is a 1-row score head)
        spec = from_hf_config(full, cfg_file.parent.name, str(cfg_file))
        return spec.n_params() - (0 if spec.tie_embeddings else spec.embedding_params())
    except ModelSpecError:
        pass
    h = _get(cfg, "hidden")
    layers = _get(cfg, "layers")
    if not h or not layers:
        raise ModelSpecError(f"{cfg_file}: no hidden size or layer count (hidden_size, num_hidden_layers) to size "
                             "the reward model")
    inter = _get(cfg, "inter") or 4 * h
    return int(cfg.get("vocab_size", 0) * h + layers * (4 * h * h + 2 * h * inter))
