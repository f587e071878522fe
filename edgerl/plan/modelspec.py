"""Model shapes for planning: from a local HF config or folder, or a built-in catalogue usable offline.

The planner needs sizes, not weights: parameter counts per component, KV-cache bytes per token,
and the LoRA parameter count for a set of target modules. Decoder-only llama-style models
(llama, qwen2, mistral, smollm) are what edgerl plans for.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional
from edgerl.core.errors import ModelSpecError




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

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.hd

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by its HF module name."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        linear = sum(a * b for a, b in self.module_shapes().values())
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return linear + bias + 2 * self.hidden_size  # two RMSNorm weights

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def n_params(self) -> int:
        """All parameters, counting a tied embedding once."""
        head = 0 if self.tie_embeddings else self.embedding_params()
        return self.embedding_params() + head + self.num_layers * self.layer_params() + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every layer, one token."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

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
        return (f"{self.name}: {self.n_params() / 1e6:.0f}M parameters, {self.num_layers} layers, hidden "
                f"{self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV heads, vocabulary "
                f"{self.vocab_size}{', tied embeddings' if self.tie_embeddings else ''}")


# Shapes from each model's config.json on the Hugging Face Hub.
CATALOGUE: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("qwen2.5-0.5b", "qwen2", 151936, 896, 24, 14, 2, 4864, True, qkv_bias=True, max_position=32768),
    ModelSpec("qwen2.5-1.5b", "qwen2", 151936, 1536, 28, 12, 2, 8960, True, qkv_bias=True, max_position=32768),
    ModelSpec("qwen2.5-3b", "qwen2", 151936, 2048, 36, 16, 2, 11008, True, qkv_bias=True, max_position=32768),
    ModelSpec("qwen2.5-7b", "qwen2", 152064, 3584, 28, 28, 4, 18944, False, qkv_bias=True, max_position=32768),
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
          "qwen2.5-7b": "Qwen/Qwen2.5-7B", "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
          "llama-3.2-3b": "meta-llama/Llama-3.2-3B", "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
          "smollm2-135m": "HuggingFaceTB/SmolLM2-135M", "smollm2-360m": "HuggingFaceTB/SmolLM2-360M",
          "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B", "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


# Decoder-only architectures edgerl trains: FSDP2 wraps their `model.layers`, LoRA has default targets
# for them, and the static-cache rollout engine implements their forward (edgerl/rollout/decoder.py).
SUPPORTED_TYPES = ("llama", "qwen2", "mistral")


def _rope(text_cfg: dict[str, Any]) -> str:
    rp = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    return str(rp.get("rope_type", rp.get("type", "default"))) if isinstance(rp, dict) else "default"


def _window(text_cfg: dict[str, Any]) -> Optional[int]:
    window = text_cfg.get("sliding_window")
    types = text_cfg.get("layer_types") or []
    used = ("sliding_attention" in types) if types else bool(text_cfg.get("use_sliding_window", True))
    return int(window) if window and used else None


def from_hf_config(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    """A spec from the fields of an HF config.json (llama/qwen2/mistral naming)."""
    text_cfg = cfg.get("text_config", cfg)
    model_type = str(text_cfg.get("model_type", ""))
    if model_type not in SUPPORTED_TYPES:
        raise ModelSpecError(f"{source}: model_type {model_type or '(none)'!r} is not one edgerl trains; it trains "
                             f"decoder-only {', '.join(SUPPORTED_TYPES)} models and their fine-tunes (SmolLM2, "
                             "Qwen2.5, Llama 3, Mistral); GPT-2, GPT-NeoX and other architectures are not supported")
    try:
        heads = int(text_cfg["num_attention_heads"])
        return ModelSpec(
            name=name, model_type=model_type, rope_type=_rope(text_cfg), sliding_window=_window(text_cfg),
            vocab_size=int(text_cfg["vocab_size"]), hidden_size=int(text_cfg["hidden_size"]),
            num_layers=int(text_cfg["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(text_cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(text_cfg["intermediate_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))),
            head_dim=int(text_cfg.get("head_dim") or 0),
            qkv_bias=bool(text_cfg.get("attention_bias", text_cfg.get("model_type") == "qwen2")),
            max_position=int(text_cfg.get("max_position_embeddings", 4096)),
            hidden_act=str(text_cfg.get("hidden_act", "silu")), source=source)
    except KeyError as e:
        raise ModelSpecError(f"{source}: config.json lacks {e.args[0]!r}; edgerl plans for decoder-only "
                             "llama/qwen2-style models") from None


def resolve(name_or_path: str) -> ModelSpec:
    """A catalogue name or alias, a local HF folder (its config.json), or a config.json file."""
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
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        spec = _from_hf_cache(name_or_path)
        if spec is not None:
            return spec
        raise ModelSpecError(f"model {name_or_path!r} is not in edgerl's catalogue and its config is not in "
                             f"the local HF cache; download it first (huggingface-cli download "
                             f"{name_or_path} config.json) or pass a local folder. Catalogue: "
                             f"{', '.join(CATALOGUE)}")
    if name_or_path.startswith((".", "/", "~")):
        raise ModelSpecError(f"model folder {name_or_path} does not exist")
    close = difflib.get_close_matches(key, list(CATALOGUE) + list(ALIASES), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ModelSpecError(f"unknown model {name_or_path!r}.{hint} Built-in shapes: {', '.join(CATALOGUE)}; "
                         "or pass a local HF folder or an HF id whose config is cached")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"{path} is not valid JSON: {e}") from None


def _from_hf_cache(repo_id: str) -> Optional[ModelSpec]:
    """The config of an HF id from the local cache only (planning never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(found, str):
        return from_hf_config(_read_json(Path(found)), repo_id, found)
    return None


def classifier_params(name_or_path: str) -> int:
    """Parameters of a sequence-classification reward model from its local config: exact for the
    architectures edgerl trains, else embeddings + layers x (4 h^2 attention + 2 h x intermediate MLP).
    The plan needs its bytes, not its exact shape. Raises ModelSpecError when no config is found."""
    path = Path(name_or_path).expanduser()
    cfg_file = path / "config.json" if path.is_dir() else None
    if cfg_file is None or not cfg_file.exists():
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(name_or_path, "config.json") if "/" in name_or_path else None
        if not isinstance(found, str):
            raise ModelSpecError(f"reward.model={name_or_path!r}: no config.json there or in the local HF cache; "
                                 "point reward.model at a local HF folder")
        cfg_file = Path(found)
    full = _read_json(cfg_file)
    cfg = full.get("text_config", full)
    if cfg.get("model_type") in SUPPORTED_TYPES:  # exact count (its LM head is a 1-row score head)
        spec = from_hf_config(full, cfg_file.parent.name, str(cfg_file))
        return spec.n_params() - (0 if spec.tie_embeddings else spec.embedding_params())
    h = cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("n_embd")
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers")
    if not h or not layers:
        raise ModelSpecError(f"{cfg_file}: no hidden size or layer count (hidden_size, num_hidden_layers) to size "
                             "the reward model")
    inter = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * h
    return int(cfg.get("vocab_size", 0) * h + layers * (4 * h * h + 2 * h * inter))
