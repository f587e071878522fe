"""`edgerl export`: parse, call the library (edgerl.export), render."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from .app import console, friendly


@friendly
def export(source: str = typer.Argument(..., help="a run folder (its final/ model), one of its checkpoints, or an "
                                        "HF model folder or hub id"),
           fmt: str = typer.Option("gguf", "--format", "-f", help="gguf (llama.cpp, Ollama, LM Studio) or hf "
                                   "(safetensors for transformers, vLLM)"),
           quant: Optional[List[str]] = typer.Option(None, "--quant", "-q", help="gguf: f16, q8_0 (default), bf16 or "
                                                     "f32, repeatable (one file each); hf: f32, bf16 or f16 (default: "
                                                     "as stored)"),
           out: Path = typer.Option(..., "--out", "-o", help="a new folder for the export"),
           step: Optional[int] = typer.Option(None, "--step", min=0, help="export the run's checkpoint of this step "
                                              "instead of its final model"),
           force: bool = typer.Option(False, "--force", help="replace --out if it exists (only once the new export "
                                      "is complete)"),
           push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="also upload the folder to this Hub "
                                                     "repository (OWNER/NAME; private when created)")) -> None:
    """Export a trained model: merged safetensors (hf) or GGUF with an Ollama Modelfile (gguf)."""
    from edgerl.export import export as run_export

    def log(s: str) -> None:
        console.print(f"[dim]{escape(s)}[/]", highlight=False, soft_wrap=True)
    folder = run_export(source, fmt, list(quant or []), out, force=force, step=step, push_to=push_to_hub, log=log)
    shown = escape(str(folder))
    if fmt == "gguf":
        first = sorted(folder.glob("*.gguf"))[0].name
        console.print(f"[bold green]done[/]: {shown}\n  Ollama:    cd {shown} && ollama create NAME -f Modelfile && "
                      f"ollama run NAME\n  llama.cpp: llama-server -m {shown}/{escape(first)} -ngl 99 --jinja\n"
                      f"  LM Studio: lms import {shown}/{escape(first)}", soft_wrap=True, highlight=False)
    else:
        console.print(f"[bold green]done[/]: {shown} (AutoModelForCausalLM.from_pretrained({shown!r}))",
                      soft_wrap=True, highlight=False)
