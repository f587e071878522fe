"""`edgerl data`: check training data before a run, and prepare GSM8K in verl's format.

Exit status, as for `edgerl train`: 0 when the command did its work, 2 for bad input (a file that
cannot be read, a bad row, a bad setting or path). `data check` exits 2 exactly when `edgerl
train` would stop on the same data and settings before its first step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from edgerl.config.load import load_config
from edgerl.data.prompts import check_data, prepare_gsm8k
from edgerl.core.errors import USER_ERRORS, DataError
from edgerl.rewards.rules import KNOWN_SOURCES
from edgerl.core.files import check_path

from .app import friendly

app = typer.Typer(help="Check training data and prepare datasets (verl-compatible parquet).",
                  no_args_is_help=True, add_completion=False)
prepare_app = typer.Typer(help="Write a dataset as verl-format parquet.", no_args_is_help=True)
app.add_typer(prepare_app, name="prepare")

console = Console()
err_console = Console(stderr=True)


BAD_INPUT = 2  # the exit status of every edgerl command for input the user can fix


def _fail(msg: str) -> None:
    err_console.print(f"[red]error:[/red] {msg}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(BAD_INPUT)


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """A tokenizer from a local folder (or the local HF cache); never downloads. The embedded
    default model is converted from its GGUF file on first use."""
    from transformers import AutoTokenizer

    from edgerl.models.embedded import EmbeddedModelError, embedded_folder, is_embedded
    if is_embedded(name):
        try:
            name = str(embedded_folder(name))
        except EmbeddedModelError as e:
            raise DataError(f"{e}; or pass --tokenizer PATH") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        where = "folder" if Path(name).is_dir() else "name"
        raise DataError(f"cannot load the tokenizer {name!r} ({where}) without a download "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "pass --tokenizer PATH to a local tokenizer folder") from None


@app.command()
@friendly
def check(
    file: str = typer.Argument(..., help="a .parquet/.jsonl/.json/.csv file, an HF dataset name, "
                               "or builtin:arithmetic"),
    prompt_key: Optional[str] = typer.Option(None, help="column holding the prompt (data.prompt_key)"),
    answer_key: Optional[str] = typer.Option(None, help="column holding the answer; dots reach into "
                                             "nested columns (data.answer_key)"),
    tokenizer: Optional[str] = typer.Option(None, help="tokenizer folder; default: the config's model"),
    max_prompt_len: Optional[int] = typer.Option(None, help="prompt length limit in tokens"),
    config: Optional[Path] = typer.Option(None, help="run config TOML to read data settings from"),
    set_: List[str] = typer.Option([], "--set", help="override a config key, e.g. --set data.split=test"),
) -> None:
    """Validate FILE as training data and summarise it (rows, sources, prompt lengths in tokens).

    Exit status: 0 when `edgerl train` would accept the data with these settings (notes may
    follow the table); 2 when it would stop before its first step: the file cannot be read, a row
    is bad, a setting or the tokenizer is wrong, or prompts exceed data.max_prompt_len while
    data.on_too_long=error (the same status `edgerl train` exits with). A data_source without a
    built-in reward is a note, not an error: `edgerl train --reward path/to/file.py:fn` scores it.
    """
    try:
        cfg = load_config(config, set_)
        changes: dict[str, Any] = {"path": file}
        if prompt_key is not None:
            changes["prompt_key"] = prompt_key
        if answer_key is not None:
            changes["answer_key"] = answer_key
        if max_prompt_len is not None:
            changes["max_prompt_len"] = max_prompt_len
        cfg.data = dataclasses.replace(cfg.data, **changes)
        cfg.validate()
        if tokenizer is not None:
            check_path(tokenizer, "--tokenizer")
        tok = load_tokenizer(tokenizer or cfg.model.tokenizer or cfg.model.path, cfg.model.trust_remote_code)
        summary = check_data(cfg.data, tok, seed=0)
    except USER_ERRORS as e:
        _fail(str(e))
        return

    table = Table(title=f"edgerl data check: {summary.source}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("rows", str(summary.rows))
    table.add_row("columns", ", ".join(summary.columns))
    table.add_row("prompt key", summary.prompt_key)
    table.add_row("answer key", summary.answer_key)
    table.add_row("data source key", summary.data_source_key)
    table.add_row("prompt format", summary.prompt_format)
    table.add_row("data sources", ", ".join(f"{k}: {v}" for k, v in summary.sources.items()))
    pct = summary.length_percentiles
    table.add_row("prompt tokens", f"p50 {pct['p50']}, p90 {pct['p90']}, p99 {pct['p99']}, max {pct['max']}")
    over = summary.rows_over_limit
    rows_s = f" (rows {', '.join(map(str, summary.first_rows_over_limit))}{', ...' if over > 5 else ''}, 0-based)"
    table.add_row(f"over {summary.max_prompt_len} tokens", f"{over}{rows_s if over else ''}")
    console.print(table)

    unknown = sorted(s for s in summary.sources if s not in KNOWN_SOURCES)
    if unknown and "answer" in cfg.reward.functions:   # the 'answer' reward needs a rule for every data_source
        console.print(f"[yellow]note:[/yellow] no built-in reward for data source(s) {', '.join(unknown)}; "
                      "train with --reward path/to/file.py:fn", highlight=False)
    if over and (summary.on_too_long == "error" or over == summary.rows):
        why = ("edgerl train stops on them" if summary.on_too_long == "error"
               else "data.on_too_long=filter would leave nothing to train on")
        _fail(f"{over} of {summary.rows} prompt(s) exceed data.max_prompt_len={summary.max_prompt_len} tokens "
              f"{rows_s.strip()}: {why}; raise data.max_prompt_len"
              + (", or set data.on_too_long=filter to drop them" if summary.on_too_long == "error" else ""))
    if over:
        console.print(f"[yellow]note:[/yellow] {over} prompt(s) exceed data.max_prompt_len="
                      f"{summary.max_prompt_len}: training drops these {over} rows (data.on_too_long=filter)",
                      highlight=False)
    else:
        console.print("[green]ok[/green]: every row is valid and fits data.max_prompt_len", highlight=False)


@prepare_app.command("gsm8k")
@friendly
def prepare_gsm8k_cmd(
    out: Path = typer.Option(..., "--out", help="parquet file to write, e.g. data/gsm8k/train.parquet (its "
                             "folder must exist; '.parquet' is added to a name without a suffix)"),
    from_: Optional[Path] = typer.Option(None, "--from", help="local GSM8K JSONL ({question, answer} "
                                         "lines); default: download openai/gsm8k from the HF hub"),
    split: str = typer.Option("train", help="split name (hub split, and extra_info.split)"),
    force: bool = typer.Option(False, "--force", help="replace --out if it exists"),
) -> None:
    """Write GSM8K as verl's examples/data_preprocess/gsm8k.py does. The file appears whole or not
    at all; an existing one is kept unless --force. Exit status 2 for bad input."""
    try:
        path, n = prepare_gsm8k(out, source=from_, split=split, overwrite=force)
    except USER_ERRORS as e:
        _fail(str(e))
        return
    console.print(f"wrote {n} rows to {path} (verl format: data_source openai/gsm8k)", highlight=False,
                  soft_wrap=True)
