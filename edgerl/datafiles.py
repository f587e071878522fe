"""Reading raw rows: parquet, JSONL / JSON arrays, CSV, HF datasets, the built-in task.

Everything becomes a `RawTable`: plain Python rows (dicts; nested parquet structs become dicts,
list columns become lists) plus the column names and, for JSONL, each row's line number, so the
validation in `edgerl.data` can name the file, the row, the line and the field.
"""

from __future__ import annotations

import csv
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from .errors import DataError




@dataclass
class RawTable:
    source: str                      # e.g. "data/train.parquet (parquet)"
    columns: list[str]               # top-level column names
    rows: list[dict[str, Any]]
    lines: Optional[list[int]] = None  # 1-based line of each row (JSONL), for messages
    name: str = ""                   # the file or dataset name, for messages
    kind: str = "file"               # file | hf | builtin

    def where(self, row: int) -> str:
        """'row 3 (0-based)' plus the line for JSONL files."""
        if self.lines is not None:
            return f"row {row} (0-based; line {self.lines[row]})"
        return f"row {row} (0-based)"


FILE_TYPES = (".parquet", ".jsonl", ".json", ".csv")
BUILTIN_PREFIX = "builtin:"


def read_table(path: str, split: str = "train", *, difficulty: int = 1, num_examples: int = 4096,
               seed: int = 0) -> RawTable:
    """Rows of `path`: a local file, a local dataset folder or HF dataset name, or 'builtin:NAME'."""
    if path.startswith(BUILTIN_PREFIX):
        return _read_builtin(path, difficulty, num_examples, seed)
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_hf(str(p), split)
    if p.exists():
        return _read_file(p)
    if p.suffix.lower() in FILE_TYPES:
        raise DataError(f"data file {path} does not exist (looked for {p.resolve()}); check the path "
                        "(data.path), or give an HF dataset name without a file extension")
    return _read_hf(path, split)


def _read_builtin(path: str, difficulty: int, num_examples: int, seed: int) -> RawTable:
    from .tasks import generate_arithmetic

    name = path[len(BUILTIN_PREFIX):]
    if name != "arithmetic":
        raise DataError(f"unknown built-in task {path!r}; the built-in task is 'builtin:arithmetic'")
    try:
        rows = generate_arithmetic(num_examples, difficulty, seed)
    except ValueError as e:
        raise DataError(f"{path}: {e} (data.difficulty / data.num_examples)") from None
    return RawTable(source=f"{path} (difficulty {difficulty}, {num_examples} problems, seed {seed})",
                    columns=list(rows[0]), rows=rows, name=path, kind="builtin")


def _unreadable(p: Path, e: BaseException) -> DataError:
    if isinstance(e, PermissionError):
        return DataError(f"cannot read {p}: permission denied; check the file's permissions")
    if isinstance(e, IsADirectoryError):
        return DataError(f"cannot read {p}: it is a folder")
    if isinstance(e, UnicodeDecodeError):
        return DataError(f"cannot read {p}: not UTF-8 text ({e.reason} at byte {e.start}); "
                         "is it really a text file?")
    msg = getattr(e, "strerror", None) or str(e)
    return DataError(f"cannot read {p}: {msg}")


def _read_file(p: Path) -> RawTable:
    suffix = p.suffix.lower()
    if suffix not in FILE_TYPES:
        raise DataError(f"{p}: unsupported file type '{p.suffix or '(none)'}'; use one of "
                        f"{', '.join(FILE_TYPES)}, or an HF dataset name")
    if p.stat().st_size == 0:
        raise DataError(f"{p} is empty (0 bytes)")
    reader = {".parquet": _read_parquet, ".jsonl": _read_json, ".json": _read_json, ".csv": _read_csv}
    table = reader[suffix](p)
    if not table.rows:
        raise DataError(f"{p} has no rows")
    return table


def _read_parquet(p: Path) -> RawTable:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except OSError as e:
        raise _unreadable(p, e) from None
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise DataError(f"cannot read {p} as parquet: {e}") from None
    return RawTable(source=f"{p} (parquet)", columns=list(table.column_names),
                    rows=table.to_pylist(), name=str(p))


def _read_json(p: Path) -> RawTable:
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(p, e) from None
    if p.suffix.lower() == ".json" and text.lstrip().startswith("{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # several objects: JSON lines in a .json file, read below
        if isinstance(whole, dict) and len([ln for ln in text.splitlines() if ln.strip()]) > 1:
            raise DataError(f"{p} holds one JSON object ({', '.join(map(str, list(whole)[:5]))}), not "
                            "rows; write an array [{\"prompt\": ...}, ...] or one object per line (JSONL)")
    if p.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(f"{p}: row {i} (0-based) of the array is a {type(row).__name__}, not an "
                                "object; expected [{\"prompt\": ..., ...}, ...]")
        return RawTable(source=f"{p} (JSON array)", columns=_union_keys(rows), rows=rows, name=str(p))
    rows, lines = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, a gap) are not rows
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: line {lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                            "each line of a JSONL file must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DataError(f"{p}: line {lineno} is a JSON {type(obj).__name__}, not an object; "
                            "each line must look like {\"prompt\": ..., ...}")
        rows.append(obj)
        lines.append(lineno)
    return RawTable(source=f"{p} (JSON lines)", columns=_union_keys(rows), rows=rows, lines=lines,
                    name=str(p))


def _read_csv(p: Path) -> RawTable:
    try:
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = [dict(r) for r in reader]
            columns = list(reader.fieldnames or [])
    except (OSError, UnicodeDecodeError) as e:
        raise _unreadable(p, e) from None
    except csv.Error as e:
        raise DataError(f"cannot read {p} as CSV: {e}") from None
    for i, row in enumerate(rows):
        if None in row:  # csv puts surplus cells under the key None
            raise DataError(f"{p}: row {i} (0-based; the header is not counted) has more cells than "
                            f"the {len(columns)} columns of the header")
    return RawTable(source=f"{p} (CSV)", columns=columns, rows=rows, name=str(p))


def _offline() -> bool:
    flags = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").lower() in ("1", "true", "yes", "on") for f in flags)


def _read_hf(name: str, split: str) -> RawTable:
    try:
        import datasets
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        if Path(name).is_dir():
            raise DataError(f"cannot load the dataset folder {name} (split '{split}') with "
                            f"datasets.load_dataset: {type(e).__name__}: {e}") from None
        hint = ("; HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set, so nothing is downloaded: use a local "
                "file, or unset it" if _offline() else
                "; if there is no network, download the data elsewhere and pass the file")
        raise DataError(f"data.path {name!r} is neither an existing file (looked for {Path(name).resolve()}) "
                        f"nor a dataset that datasets.load_dataset({name!r}, split={split!r}) could load "
                        f"({type(e).__name__}: {_first_line(e)}){hint}") from None
    rows = ds.to_list()
    if not rows:
        raise DataError(f"HF dataset {name!r} split {split!r} has no rows")
    return RawTable(source=f"HF dataset {name} (split {split})", columns=list(ds.column_names),
                    rows=rows, name=name, kind="hf")


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _union_keys(rows: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


# --- columns ------------------------------------------------------------------------------------

_MISSING = object()

# names people give the answer column, offered when the configured one is absent
ANSWER_NAMES = ("answer", "ground_truth", "solution", "label", "target", "final_answer")


def suggest(key: str, available: list[str], extra: tuple[str, ...] = ()) -> Optional[str]:
    """Closest available name: a case-insensitive match first, then a close spelling, then a
    common name for the same thing from `extra`."""
    for name in available:
        if name.lower() == key.lower():
            return name
    close = difflib.get_close_matches(key, available, n=1, cutoff=0.6)
    if close:
        return close[0]
    for name in extra:
        for col in available:
            if col.lower() == name:
                return col
    return None


def check_column(table: RawTable, key: str, setting: str, extra: tuple[str, ...] = ()) -> None:
    """Raise DataError if `key`'s top-level column (the part before the first dot) is missing."""
    top = key if key in table.columns else key.split(".")[0]
    if top in table.columns:
        return
    guess = suggest(top, table.columns, extra)
    hint = f"; did you mean '{guess}'? (set {setting}={guess})" if guess else f"; set {setting} to one of them"
    if setting == "data.answer_key":
        hint += f", or {setting}='' if the data has no reference answers (reward model or own --reward)"
    raise DataError(f"{table.name}: no column '{top}' (from {setting}={key!r}); available columns: "
                    f"{', '.join(table.columns) or '(none)'}{hint}")


def get_field(row: dict[str, Any], key: str) -> Any:
    """row[key], where dots reach into nested dicts ('reward_model.ground_truth'); a flat column
    whose name contains the dots wins. Returns _MISSING when a level is absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def is_missing(value: Any) -> bool:
    return value is _MISSING
