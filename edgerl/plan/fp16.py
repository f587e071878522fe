"""What fp16 can hold, per model: the record of a model's largest activations, its cache file, and the rule
the plan's dtype decision applies to it.

fp16's largest finite value is 65504. A matmul output or a sum past it is inf, and the next norm or
softmax turns that into NaN; bf16 and fp32 share fp32's exponent range (3.4e38), so only fp16 compute is
checked. The record comes from a calibration forward of the model's real weights in fp32 on a few training
prompts (edgerl/models/activations.py), run by `edgerl train` before the first step of a plan that would
compute in fp16, and cached per model here. `plan()` stays pure: it reads the record from its `ModelSpec`
(`activations`), and `config.target.plan_for` puts the cached one there.

Pure: no torch, no hardware.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from edgerl.core.files import cache_root
from edgerl.plan.archs import architecture

FP16_MAX = 65504.0
# A layer computes in fp16 only while its largest calibrated activation stays below fp16's maximum over
# this factor. The calibration sees a few prompts, not the responses the policy will write or the weights
# the updates will make, and fp16 arithmetic adds to the measured peak (a residual sum of two large terms,
# the down projection's sum over the intermediate width): two binary orders of magnitude of room.
MARGIN = 4.0
LIMIT = FP16_MAX / MARGIN
CALIBRATION_PROMPTS = 8         # training prompts the calibration forward runs
FORMAT_VERSION = 1              # bump when the record's fields change meaning: older cache files are ignored

WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peak:
    """One site's largest absolute activation: `where` is "layer N" (from 0), "the embeddings" or "the
    LM head's logits"; `site` inside a layer is "attention", "MLP" or "residual stream"."""
    where: str
    site: str
    value: float

    def describe(self) -> str:
        return f"{self.where}'s {self.site}" if self.site else self.where


@dataclass(frozen=True)
class ActivationRecord:
    """The largest absolute activation of each decoder layer's sites, of the embeddings and of the LM head's
    logits, over the calibration prompts' real tokens, computed in fp32."""
    layers: tuple[tuple[tuple[str, float], ...], ...]   # per decoder layer: (site, largest |value|) pairs
    embeddings: float
    logits: float
    prompts: int
    tokens: int
    date: str                                            # ISO 8601, UTC
    version: int = FORMAT_VERSION

    def peaks(self) -> list[Peak]:
        """Every site, largest first."""
        out = [Peak("the embeddings", "", self.embeddings), Peak("the LM head's logits", "", self.logits)]
        out += [Peak(f"layer {i}", site, v) for i, sites in enumerate(self.layers) for site, v in sites]
        return sorted(out, key=lambda p: -p.value)

    def worst(self) -> Peak:
        return self.peaks()[0]

    def over(self, limit: float = LIMIT) -> list[Peak]:
        """The sites past `limit` (not finite counts as past it), largest first."""
        return [p for p in self.peaks() if not p.value < limit]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ActivationRecord":
        layers = tuple(tuple((str(s), float(v)) for s, v in sites) for sites in d["layers"])
        return cls(layers=layers, embeddings=float(d["embeddings"]), logits=float(d["logits"]),
                   prompts=int(d["prompts"]), tokens=int(d["tokens"]), date=str(d["date"]),
                   version=int(d.get("version", 0)))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --- the rule ---------------------------------------------------------------------------------------------

def overflow(model_type: str, record: Optional[ActivationRecord], measured_only: bool = False) -> Optional[str]:
    """Why a model must not compute in fp16 (None: it may): its calibrated record has a site past LIMIT, or,
    without a record, its architecture is known to overflow (unless `measured_only`)."""
    if record is not None:
        over = record.over()
        if not over:
            return None
        p = over[0]
        more = f" ({len(over) - 1} more site(s) past it)" if len(over) > 1 else ""
        return (f"{p.describe()} reaches {p.value:.3g} in these weights (a calibration in fp32 on {record.prompts} "
                f"training prompts), past fp16's safe range of {LIMIT:.0f} (its maximum {FP16_MAX:.0f} / {MARGIN:g}){more}")
    # architectures whose released weights are known to overflow fp16 (plan/archs.py's fp16_overflow; docs/hardware.md,
    # fp16 overflow) compute in fp32 on fp16 GPUs until a calibration of the model's own weights shows otherwise
    family = architecture(model_type).fp16_overflow
    if family is None or measured_only:
        return None
    return f"{family}'s activations are known to exceed fp16's maximum of {FP16_MAX:.0f}"


def check(model_type: str, record: Optional[ActivationRecord], device_choice: str, compute: str
          ) -> tuple[Optional[str], str]:
    """The plan's `fp16_check` decision: what `edgerl train` does about fp16 overflow for this model, and why.
    `device_choice`: the compute dtype the GPU (or plan.dtype) asks for; `compute`: the one planned."""
    if device_choice != "fp16":
        return None, f"{compute} compute has fp32's exponent range (up to 3.4e38): nothing to check"
    safe = f"{LIMIT:.0f} ({FP16_MAX:.0f} / {MARGIN:g})"
    if record is not None:
        w = record.worst()
        said = (f"cached calibration of these weights ({record.prompts} prompts, {record.tokens} tokens, "
                f"{record.date[:10]}): the largest activation is {w.describe()}'s, {w.value:.3g}")
        if compute == "fp16":
            return "cached calibration", f"{said}, within fp16's safe range of {safe}"
        return "cached calibration", f"{said}, so fp32 compute"
    how = (f"edgerl train first runs these weights in fp32 on up to {CALIBRATION_PROMPTS} training prompts and "
           "records each layer's largest activation (cached per model, so later runs skip it); ")
    if compute == "fp16":
        return "calibrate at start", how + (f"a site past {safe} makes the run compute in fp32, or stop in one "
                                            "line naming it where fp32 does not fit or plan.dtype=fp16 is forced")
    return "calibrate at start", how + f"it computes in fp16 only if every site stays below {safe}"


# --- the cache --------------------------------------------------------------------------------------------

def weights_key(folder: Path) -> Optional[str]:
    """The identity of a model folder's weights: its config.json's bytes and each weight file's name, size and
    modification time (a file replaced or re-downloaded gets a new key). None without weight files."""
    files = sorted({f for pattern in WEIGHT_FILES for f in Path(folder).glob(pattern)})
    if not files:
        return None
    h = hashlib.sha256()
    config = Path(folder) / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in files:
        st = f.stat()   # follows the Hugging Face cache's symbolic links to the blobs
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def cache_path(key: str) -> Path:
    """$EDGERL_CACHE/activations/<key>.json (EDGERL_CACHE defaults to ~/.cache/edgerl)."""
    return cache_root() / "activations" / f"{key}.json"


def read_cached(folder: Path) -> Optional[ActivationRecord]:
    """The cached record of the weights in `folder`, or None (none cached, an unreadable file, another
    format version: each calibrates again)."""
    key = weights_key(folder)
    if key is None:
        return None
    path = cache_path(key)
    if not path.exists():
        return None
    try:
        rec = ActivationRecord.from_dict(json.loads(path.read_text())["record"])
    except (OSError, ValueError, TypeError, KeyError) as e:   # json's decode error is a ValueError
        log.warning("ignored %s: unreadable (%s); the model is calibrated again", path, str(e)[:160])
        return None
    return rec if rec.version == FORMAT_VERSION else None


def write_cached(folder: Path, record: ActivationRecord) -> Optional[Path]:
    """Cache `record` for the weights in `folder` (atomically); the file, or None where it has no weight files."""
    from edgerl.core.files import write_atomically
    key = weights_key(folder)
    if key is None:
        return None
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"model": str(folder), "record": record.to_dict()}, indent=1))
    return path
