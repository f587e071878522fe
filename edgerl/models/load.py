"""Actor, critic, reference and the rollout copy, built as the plan says.

The actor and critic are wrapped by FSDP2 (`fully_shard` per decoder layer, then the whole) on
however many devices the process group has: one GPU, the CPU (gloo), or N GPUs under torchrun.
Mixed precision is FSDP2's policy (fp32 master weights, compute in the plan's dtype), and the
plan's CPU offload is FSDP2's `CPUOffloadPolicy`. The log-probs are computed inside the wrapped
module's forward, so the LM-head weight is unsharded when the chunked kernel reads it.

Under LoRA (`plan.lora`) the actor's base is frozen and stored in `plan.base_dtype`; peft's adapter
trains (edgerl/lora.py). The reference is the actor with its adapter disabled, so `build_frozen` is
not called. The critic is a separate model with its own LoRA adapter and an fp32 value head:
sharing the actor's frozen base would save one copy of the base (P x base bytes) but needs peft's
one-active-adapter switching inside one FSDP2 module tree for two optimizers, and rules out
`model.critic_path`; the plan counts the extra copy, and plan.base_dtype=fp16 halves it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from edgerl.core.errors import ModelError
from edgerl.plan.dtypes import torch_dtype, with_dtype
from edgerl.kernels import Tiles, naive_logprobs_and_entropy, token_logprobs_and_entropy
from edgerl.models import offload
from edgerl.models.attention import gather_columns, install, roll_left
from edgerl.models.backbone import (backbone, decoder_layers, drop_output_head, logit_transform,  # noqa: F401
                                    output_head, softcapped_logprobs)
from edgerl.models.packing import pack, packed_index, plan_layout
from edgerl.models.swiglu import fuse_mlps
from edgerl.plan.memory import fmt_bytes
from edgerl.plan.plan import Plan

log = logging.getLogger(__name__)


def model_source(path: str) -> str:
    """The folder transformers should load: the embedded default (converted once), a local folder, or a
    Hugging Face id's snapshot in huggingface_hub's cache (its config, weights and tokenizer, downloaded
    there first where missing; a one-line ModelError naming the id, the cache and HF_HUB_OFFLINE when
    neither works)."""
    from edgerl.core.hub import is_hub_id, snapshot
    from edgerl.models.embedded import embedded_folder, is_embedded
    if is_embedded(path):
        return str(embedded_folder(path))
    return str(snapshot(path)) if is_hub_id(path) else path


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    source = model_source(path)   # a hub id that cannot be fetched: its own one-line ModelError
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ModelError(f"cannot load the tokenizer of {path!r}: {e}. Offline, pass a local folder "
                         "(--set model.tokenizer=PATH)") from None
    except Exception as e:   # a damaged tokenizer.json: the tokenizers library raises a bare Exception
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        damaged = [f for f in ("tokenizer.json", "tokenizer_config.json") if (Path(path) / f).is_file()]
        where = f" ({' or '.join(str(Path(path) / f) for f in damaged)} may be damaged)" if damaged else ""
        raise ModelError(f"cannot load the tokenizer of {path!r}{where}: {type(e).__name__}: {first}; download "
                         "the model again, or give a working tokenizer with --set model.tokenizer=PATH") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # generation pads finished rows; the mask hides them
    return tok


def load_causal_lm(path: str, dtype: torch.dtype, attention: str, trust_remote_code: bool = False) -> nn.Module:
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    src = model_source(path)
    try:
        return with_dtype(AutoModelForCausalLM.from_pretrained, src, dtype=dtype, attn_implementation=attention,
                          trust_remote_code=trust_remote_code)
    except torch.OutOfMemoryError:
        raise
    except (OSError, RuntimeError, SafetensorError) as e:  # missing, damaged or cut-short weight files
        why = unreadable_weights(Path(src)) if Path(src).is_dir() else None
        first = (str(e).splitlines() or [""])[0][:300]
        raise ModelError(f"cannot load model {path!r}: " + (why or (
            f"{e}. Offline, pass a local HF folder" if isinstance(e, OSError) else
            f"{type(e).__name__}: {first}; download the model again, or re-save it with save_pretrained"))) from None


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in the backward (HF does it only in training mode: the trainer
    puts the models in train() for updates). Non-reentrant, so a frozen LoRA base needs no input grads."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def causal_forward(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, length: int,
                   attention_chunk: int) -> torch.Tensor:
    """The backbone's hidden states (B, length, H) at columns start .. start + length - 1 of left-padded rows
    (B, L), computed on the rows rolled to column 0 so that attention needs no mask (models/attention.py):
    no (B, 1, L, L) mask is built, and SDPA runs an O(L)-memory kernel or chunks of query rows."""
    rolled, lead = roll_left(input_ids, attention_mask)
    # rolled rows count their positions from column 0, as the left-padded rows counted from their first token
    pos = torch.arange(rolled.shape[1], device=rolled.device)[None].expand_as(rolled)
    out = backbone(lm)(input_ids=rolled, position_ids=pos, use_cache=False, edgerl_attention_chunk=attention_chunk)
    return gather_columns(out.last_hidden_state, start - lead, length)


class PolicyHead(nn.Module):
    """The actor as FSDP2's root: forward returns per-token log-probs and entropy of `targets`."""

    def __init__(self, lm: nn.Module, plan: Plan) -> None:
        super().__init__()
        self.lm = lm
        self.backend = plan.kernel_backend
        self.chunk = plan.logprob_chunk
        self.tiles = Tiles(**plan.kernel_tiles) if plan.kernel_tiles else None
        self.share_prompts = plan.share_prompts
        self.attention_chunk = getattr(plan, "attention_chunk", 0)
        install()
        output_head(lm)   # checked once: a head the log-prob kernel can compute
        self.scale, self.cap = logit_transform(lm.config)

    # looked up, not stored: a second reference would register the modules twice (state dict, FSDP2)
    @property
    def base(self) -> nn.Module:
        return backbone(self.lm)

    @property
    def head(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                start: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask: (B, L); targets (B, T) are input_ids[:, start + 1 : start + 1 + T].
        Returns log-probs and entropy (B, T) in fp32 for the positions predicting `targets`."""
        lay = plan_layout(input_ids, attention_mask, start + 1) if self.share_prompts else None
        if lay is None:
            hidden = causal_forward(self.lm, input_ids, attention_mask, start, targets.shape[1], self.attention_chunk)
        else:   # each distinct prompt once (edgerl/packing.py)
            pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding: count from the first token
            out = self.base(input_ids=pack(lay, input_ids), attention_mask=lay.sentinel,
                            position_ids=pack(lay, pos), use_cache=False, edgerl_layout=lay)
            where = packed_index(lay, input_ids.device)[:, start:start + targets.shape[1]]
            hidden = out.last_hidden_state[0][where]
        weight = self.head.weight
        if self.backend == "naive":   # the self-test's reference: every logit in fp32, no edgerl kernel
            hidden, weight = hidden.float(), weight.to(hidden.dtype).float()
            if self.cap is None:
                logp, ent = naive_logprobs_and_entropy(hidden, weight, targets, temperature / self.scale)
            else:   # the same plain torch as below, every token in one chunk
                lead = hidden.shape[:-1]
                logp, ent = softcapped_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                                1.0 / temperature, self.scale, self.cap, max(1, lead.numel()))
                logp, ent = logp.reshape(lead), ent.reshape(lead)
        elif self.cap is not None:   # soft-capped logits (Gemma): plain torch, a chunk of tokens at a time
            if torch.is_autocast_enabled(hidden.device.type) and hidden.dtype != weight.dtype:
                cast = torch.get_autocast_dtype(hidden.device.type)
                hidden, weight = hidden.to(cast), weight.to(cast)
            lead = hidden.shape[:-1]
            logp, ent = softcapped_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                            1.0 / temperature, self.scale, self.cap, self.chunk or 256)
            logp, ent = logp.reshape(lead), ent.reshape(lead)
        else:
            logp, ent = token_logprobs_and_entropy(hidden, weight, targets, temperature / self.scale,
                                                   backend=self.backend, chunk=self.chunk, tiles=self.tiles)
        return logp.clone(), ent.clone()  # FSDP2 hooks the outputs' backward; views would lose the hook


class ValueModel(nn.Module):
    """The critic: the causal LM's backbone with a scalar value head (fp32) on every position."""

    def __init__(self, lm: nn.Module, attention_chunk: int = 0) -> None:
        super().__init__()
        self.lm = lm
        drop_output_head(lm)  # the backbone is all a critic needs; frees V x h
        hidden = lm.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.value_head.bias)
        self.attention_chunk = attention_chunk
        install()

    @property
    def base(self) -> nn.Module:
        return backbone(self.lm)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, length: int) -> torch.Tensor:
        hidden = causal_forward(self.lm, input_ids, attention_mask, start, length, self.attention_chunk)
        # under FSDP2 mixed precision the head's weight arrives in the compute dtype; values are fp32
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).float()
        return values.squeeze(-1).clone()  # not a view: FSDP2 hooks the output


def init_distributed(device: torch.device) -> None:
    """A process group for FSDP2: torchrun's (env://), or a one-process group on this device.

    The one-process group uses an in-memory store: no port is opened, so runs started by this
    process (or beside it) cannot collide on MASTER_PORT. Its NCCL communicator is created lazily
    (no `device_id`, which would create it at once): FSDP2 (torch >= 2.9) skips its all-gathers and
    reduce-scatters on one process and edgerl's own collectives return early, so a single-GPU run
    never creates it and does not hold NCCL's device buffers outside torch's allocator. Loading a
    full state dict on resume scatters through the group and creates it then
    (tests/test_trainer_on_cpu.py counts the collectives of a one-process run)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and object collectives use the current device
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def shard(module: nn.Module, layers: nn.ModuleList, plan: Plan, device: torch.device) -> nn.Module:
    """fully_shard every decoder layer, then the root, with the plan's precision and offload."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict = {"mesh": mesh}
    compute = torch_dtype(plan.dtype.compute)
    ignored: set = set()
    if adapters_alone(plan):
        # FSDP2 manages what trains only: the frozen base (quantized, or stored in the compute dtype) is
        # used where it lies, never sharded, gathered or cast (edgerl/quant.py)
        ignored = {p for p in module.parameters() if not p.requires_grad}
        kwargs["ignored_params"] = ignored
    # Any weight stored in another dtype than the compute one (the master weights under mixed
    # precision, or a half-precision LoRA base under fp32 compute) is cast per layer at unshard. When
    # only the fp32 adapters are managed they compute in fp32, as peft's layers do (x is cast to the
    # adapter's dtype), so their gradients arrive in fp32: a 16-bit cast would hand FSDP2 16-bit
    # gradients for fp32 parameters, which torch 2.11 refuses (measured on an H200).
    if ignored:
        pass
    elif any(p.dtype != compute for p in module.parameters()):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    elif plan.dtype.param == "bf16" and dist.get_world_size() > 1:
        # bf16 weights without masters: gradients are still summed over ranks in fp32, then stored in bf16
        kwargs["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if plan.param_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    return module


def _lora_targets(lm: nn.Module, plan: Plan, explicit: Optional[list[str]]) -> list[str]:
    """The plan's targets for the actor's model; the architecture's own defaults for another
    backbone (model.critic_path)."""
    from edgerl.plan.decisions import lora_targets
    return list(lora_targets(getattr(lm.config, "model_type", "?"), explicit or None))


def _base_dtype(plan: Plan) -> torch.dtype:
    """The plan's master-weight dtype for full fine-tuning; its storage dtype for a frozen LoRA base."""
    return torch_dtype(plan.base_dtype if plan.lora and plan.base_dtype else plan.dtype.param)


def adapters_alone(plan: Plan) -> bool:
    """FSDP2 manages only the LoRA adapters (and a critic's head): over a quantized base, or over a
    16-bit base kept on the device. With parameter offload FSDP2 must own the base to stream it."""
    return bool(plan.lora) and (quantized_base(plan) is not None or
                                (plan.dtype.compute != "fp32" and not plan.param_offload))


def quantized_base(plan: Plan) -> Optional[str]:
    """'nf4' / 'int8' when the plan stores the frozen LoRA base quantized, else None."""
    return plan.base_dtype if plan.lora and plan.base_dtype in ("nf4", "int8") else None


def _load_base(path: str, plan: Plan, device: torch.device, trust_remote_code: bool) -> nn.Module:
    """The HF model in the plan's storage: fp32 or bf16 weights to train, a float frozen base, or a base
    quantized tensor by tensor straight onto the device (never whole in full precision)."""
    quant = quantized_base(plan)
    if quant is None:
        return load_causal_lm(path, _base_dtype(plan), plan.attention, trust_remote_code)
    from edgerl.models.quant import load_quantized_lm
    compute = torch_dtype(plan.dtype.compute)
    return load_quantized_lm(model_source(path), quant, compute, device, plan.attention, storage_dtype=compute,
                             trust_remote_code=trust_remote_code)


def build_actor(path: str, plan: Plan, device: torch.device, trust_remote_code: bool = False,
                lora_dropout: float = 0.0) -> PolicyHead:
    lm = _load_base(path, plan, device, trust_remote_code)
    peft_model = None
    if plan.lora:
        from edgerl.models.lora import apply_lora
        peft_model = apply_lora(lm, plan.lora["rank"], plan.lora["alpha"], lora_dropout, plan.lora["targets"], path)
    fuse_mlps(decoder_layers(lm))   # SiLU-and-multiply keeps its two inputs only (edgerl/swiglu.py)
    if plan.grad_checkpointing:
        enable_checkpointing(lm)
        if plan.activation_offload:
            offload.enable(decoder_layers(lm), device)
    if not plan.param_offload:
        lm.to(device)
    head = PolicyHead(lm, plan)
    if peft_model is not None:
        from edgerl.models.lora import attach
        attach(head, peft_model)
    return shard(head, decoder_layers(lm), plan, device)


def build_critic(path: str, plan: Plan, device: torch.device, trust_remote_code: bool = False,
                 lora_dropout: float = 0.0, lora_targets: Optional[list[str]] = None) -> ValueModel:
    """The critic: its own backbone; under LoRA a frozen base (quantized too, under QLoRA: a second copy)
    with its own adapter, and the value head."""
    lm = _load_base(path, plan, device, trust_remote_code)
    critic = ValueModel(lm, plan.attention_chunk)  # the value head is created in fp32 and stays trainable
    if plan.dtype.param == "bf16" and not plan.lora:  # FSDP2 wants one dtype for the weights it manages
        critic.value_head.to(torch.bfloat16)
    if plan.lora:
        from edgerl.models.lora import apply_lora
        apply_lora(lm, plan.lora["rank"], plan.lora["alpha"], lora_dropout, _lora_targets(lm, plan, lora_targets),
                   path)
    fuse_mlps(decoder_layers(lm))
    if plan.grad_checkpointing:
        enable_checkpointing(lm)
        if plan.activation_offload:
            offload.enable(decoder_layers(lm), device)
    if not plan.param_offload:
        critic.to(device)
    return shard(critic, decoder_layers(lm), plan, device)


def build_frozen(path: str, plan: Plan, device: torch.device, trust_remote_code: bool = False) -> PolicyHead:
    """The reference policy: compute dtype, no gradients, not sharded (it is only read)."""
    lm = load_causal_lm(path, torch_dtype(plan.dtype.compute), plan.attention, trust_remote_code)
    lm.requires_grad_(False).eval()
    return PolicyHead(lm, plan).to(device)


def build_inference_copy(path: str, plan: Plan, device: torch.device, trust_remote_code: bool = False) -> nn.Module:
    """The rollout engine's own weights, in the compute dtype; the trainer syncs them after each update."""
    lm = load_causal_lm(path, torch_dtype(plan.dtype.compute), plan.attention, trust_remote_code)
    lm.requires_grad_(False).eval()
    lm.to(device)
    for p in lm.parameters():  # weights read from a memory-mapped file (CPU) cannot be released
        if not p.untyped_storage().resizable():
            p.data = p.data.clone()
    return lm


def lm_weights(actor: PolicyHead) -> Iterator[tuple[str, torch.Tensor]]:
    """The actor's weights under the plain HF model's parameter names (for the rollout copy and export);
    under LoRA the merged W + scale * B @ A of each adapted layer."""
    from edgerl.models.lora import merged_weights, peft_of
    if peft_of(actor) is not None:
        yield from merged_weights(actor.lm)
        return
    names = {id(p): n for n, p in actor.lm.named_parameters()}  # tied weights appear once
    for name, p in actor.lm.named_parameters():
        if names[id(p)] != name:
            continue
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def release_weights(model: nn.Module) -> int:
    """Free the storage of `model`'s parameters (the rollout copy between rollouts); the tensors stay, so
    modules, engines and views keep pointing at them. Returns the bytes freed. `restore_weights` then
    re-allocates, and the next weight sync refills every parameter. The new memory may sit at another
    address: an engine must not keep CUDA graphs across its `release()` (the static engine drops them)."""
    freed = 0
    for p in {id(p): p for p in model.parameters()}.values():
        st = p.untyped_storage()
        if st.nbytes():
            p.__dict__["_edgerl_nbytes"] = st.nbytes()
            freed += st.nbytes()
            st.resize_(0)
    return freed


def restore_weights(model: nn.Module) -> None:
    """Re-allocate what `release_weights` freed (contents undefined until the next weight sync)."""
    for p in {id(p): p for p in model.parameters()}.values():
        n = p.__dict__.pop("_edgerl_nbytes", None)
        if n is not None:
            p.untyped_storage().resize_(n)


@contextlib.contextmanager
def on_device(module: Optional[nn.Module], device: torch.device, enabled: bool):
    """Bring a frozen model (the reference) to `device` for a phase, when `enabled`; its weights stay on
    the host, and what comes to the device is a copy that is dropped after the phase. Nothing is copied
    back: the model is frozen, so the host copy is still current. On CUDA the host copy is pinned once
    (the first time), so the copy in runs at the bus's speed with asynchronous copies; a host that
    cannot pin that much keeps pageable memory (slower copies, same result; said once in the log).

    Against `module.to(device)` and `module.to("cpu")` every step: docs/benchmarks.md, Reference swap."""
    if module is None or not enabled:
        yield module
        return
    tensors = _host_tensors(module, device)
    try:
        for owner, name, t in tensors:
            _put(owner, name, t.to(device, non_blocking=True, copy=True))
        yield module
    finally:
        for owner, name, t in tensors:
            _put(owner, name, t)
        if device.type == "cuda":
            # the copies' blocks stay in torch's cache for the next phase (the allocator hands cached
            # blocks back to the driver itself when an allocation would pass the cap); emptying the
            # cache here made the update map its memory again every step
            torch.cuda.current_stream(device).synchronize()


def _put(owner: nn.Module, name: str, t: torch.Tensor) -> None:
    """Make `t` the value of `owner`'s parameter (its .data: the Parameter object, and so weight tying,
    stays) or buffer `name`."""
    if name in owner._parameters:
        owner._parameters[name].data = t
    else:
        owner._buffers[name] = t


def _host_tensors(module: nn.Module, device: torch.device) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owning module, name, host tensor) for every parameter (tied ones once) and buffer of `module`,
    pinned on the first call when `device` is CUDA."""
    out: dict = {}
    for owner in module.modules():
        for name, t in list(owner._parameters.items()) + list(owner._buffers.items()):
            if t is None:
                continue
            key = id(t) if name in owner._parameters else (id(owner), name)
            if key in out:
                continue
            if t.device.type != "cpu":
                raise RuntimeError(f"on_device: {type(owner).__name__}.{name} is on {t.device}, expected the host "
                                   "(the model is moved in for a phase and dropped after)")
            out[key] = (owner, name, t.data if name in owner._parameters else t)
    if device.type == "cuda" and not getattr(module, "_edgerl_pinned", False):
        try:
            for key, (owner, name, t) in list(out.items()):
                pinned = t.pin_memory()
                _put(owner, name, pinned)
                out[key] = (owner, name, pinned)
        except RuntimeError as e:
            size = fmt_bytes(sum(t.numel() * t.element_size() for _, _, t in out.values()))
            log.warning("could not pin the reference model's %s of host memory (%s); its copies to the GPU "
                        "stay pageable (slower)", size, e)
        object.__setattr__(module, "_edgerl_pinned", True)
    return list(out.values())


def save_hf(lm_state: dict[str, torch.Tensor], source: str, tokenizer, out: Path,
            trust_remote_code: bool = False) -> None:
    """Write an HF folder that `from_pretrained` loads: config from `source`, weights given."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_source(source), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.load_state_dict({k: v.detach().cpu() for k, v in lm_state.items()}, strict=False, assign=True)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def unreadable_weights(folder: Path) -> Optional[str]:
    """Why the first safetensors file in the model folder `folder` cannot be opened (a download cut
    short, a copy that failed), as a line naming the file and the fix; None when all open."""
    from safetensors import SafetensorError, safe_open
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            return (f"{path} is damaged or cut short ({e}); download the model again, or re-save it with "
                    "save_pretrained")
    return None
