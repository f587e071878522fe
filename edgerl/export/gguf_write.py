"""Write one GGUF file: metadata, tokenizer, then the tensors streamed one at a time (the header, which
lists every tensor's shape and type, is written first, so no tensor waits in memory for the others)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from edgerl.export import gguf_model as gm
from edgerl.export.gguf_vocab import write_vocab
from edgerl.export.source import Source


def read_config(src: Source) -> dict[str, Any]:
    return json.loads((src.config_dir / "config.json").read_text(encoding="utf-8"))


def write_gguf(src: Source, quant: str, path: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """`src` as a GGUF file at `path` with its 2-D weights in `quant` (gguf_model.QUANTS). Returns what the
    Modelfile needs (the EOS token, the chat template)."""
    import gguf
    config = read_config(src)
    family = gm.family_of(config, str(src.config_dir / "config.json"))
    logging.getLogger("gguf").setLevel(logging.WARNING)   # the gguf package logs every key at INFO
    writer = gguf.GGUFWriter(path=None, arch=family.arch)
    info = gm.write_hparams(writer, config, family, quant, src.name)
    vocab = write_vocab(writer, src.tokenizer_dir, int(config["vocab_size"]))
    plan = gm.tensor_plan(src.weights, config, family, quant, info["extra"])
    for p in plan:
        shape, dtype = gm.byte_shape(p)
        nbytes = int(dtype.itemsize * gm_numel(shape))
        writer.add_tensor_info(p.gguf_name, shape, dtype, nbytes,
                               raw_dtype=p.qtype if dtype == "uint8" else None)
    try:
        writer.write_header_to_file(path=path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in plan:
            t = src.weights.load(p.hf_name) if p.hf_name is not None else info["extra"][p.gguf_name]
            writer.write_tensor_data(gm.converted(p, t, family, info))
    finally:
        writer.close()
    kinds = sorted({p.qtype.name for p in plan})
    log(f"wrote {path.name}: {len(plan)} tensors ({', '.join(kinds)}), {path.stat().st_size / 2**20:.1f} MiB, "
        f"{family.arch} architecture, tokenizer pre {vocab['pre']}")
    return vocab


def gm_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
