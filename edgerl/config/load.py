"""Reading a run config: a TOML file, then `--set key=value` overrides, each value checked against
its field's type and remembered with where it came from, so that an error names what the user
has to edit:

    --set train.lr=abc: expected float, got 'abc' (str)
    train.lr in run.toml: expected float, got 'abc' (str)
    train.lr must be > 0 ... (train.lr from --set train.lr=-1e-6)

The schema and its rules live in `edgerl.config.schema`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

from edgerl.config.schema import Config, toml_string
from edgerl.core.errors import ConfigError
from edgerl.core.files import regular_input

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

# one --set: "section.key=value", or (that, how the user typed it) when a CLI option stands for it
SetItem = Union[str, tuple[str, str]]


class Sources:
    """Where each config key got its value: a file, or one `--set` (or the option that stands for it).
    Keys are dotted ('train.lr'); a section's own key ('train') is recorded too."""

    def __init__(self) -> None:
        self.of: dict[str, tuple[str, str]] = {}   # key -> ("file", path) | ("set", "--set train.lr=1")

    def note(self, key: str, value: Any, kind: str, text: str) -> None:
        self.of[key] = (kind, text)
        if isinstance(value, dict):
            for k, v in value.items():
                self.note(f"{key}.{k}", v, kind, text)

    def origin(self, key: str) -> Optional[tuple[str, str]]:
        key = key.split("[", 1)[0]
        if key in self.of:
            return self.of[key]
        # a section named only through its keys (--set rolout.n_samples=4 names 'rolout')
        return next((o for k, o in self.of.items() if k.startswith(key + ".")), None)

    def name(self, key: str) -> str:
        """How an error names `key`: the --set that gave it, or the key and its file."""
        o = self.origin(key)
        if o is None:
            return key
        return o[1] if o[0] == "set" else f"{key} in {o[1]}"

    def annotate(self, message: str) -> str:
        """`message` (a rule naming dotted keys) with where each key it names got its value."""
        seen = []
        for key in re.findall(r"\b[a-z_]+\.[a-z_0-9]+\b", message):
            o = self.origin(key)
            if o is not None and key not in [k for k, _ in seen]:
                seen.append((key, o[1]))
        return message + (" (" + "; ".join(f"{k} from {src}" for k, src in seen) + ")" if seen else "")


def read_toml(path: Union[str, Path]) -> dict[str, Any]:
    """The TOML file at `path`, or a ConfigError that names the file (and the line, for bad bytes)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"config file {p} is a folder; give the .toml file (edgerl config > run.toml writes one "
                          "with every key)")
    regular_input(p, "config file")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise ConfigError(f"config file {p}, line {line}, column {column}: byte 0x{raw[e.start]:02x} is not UTF-8; "
                          "TOML files are UTF-8: save the file as UTF-8 (or remove the character)") from None
    try:
        return tomllib.loads(text.removeprefix("\ufeff"))  # some editors start UTF-8 files with a BOM
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {p} nests arrays or tables too deeply to be read; a run config has "
                          "sections of plain values") from None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, src: Sources) -> Any:
    """Check `value` against the annotation `tp`; return it (int -> float where a float is wanted)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, src)
            except ConfigError:
                pass
        raise ConfigError(f"{src.name(key)}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{src.name(key)}: {value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{src.name(key)}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [_coerce(v, inner, f"{key}[{i}]", src) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{src.name(key)}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _unknown_key(full: str, key: str, valid: list[str], prefix: str, src: Sources) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    o = src.origin(full)
    before = f"{o[1]}: " if o and o[0] == "set" else ""
    after = f" in {o[1]}" if o and o[0] == "file" else ""
    return ConfigError(f"{before}unknown config key '{full}'{after}{hint} (valid keys under "
                       f"'{prefix.rstrip('.') or 'the top level'}': {', '.join(valid)})")


def _section_error(full: str, keys: list[str], src: Sources) -> ConfigError:
    o = src.origin(full)
    if o and o[0] == "set":
        return ConfigError(f"{o[1]}: '{full}' is a section ([{full}] in a config file), not a value; set one of "
                           f"its keys with --set {full}.KEY=VALUE, KEY one of {', '.join(keys)}")
    where = f" in {o[1]}" if o else ""
    return ConfigError(f"'{full}'{where} is a section; write it as [{full}] with keys {', '.join(keys)}")


def build(cls: type, data: dict[str, Any], src: Sources, prefix: str = "") -> Any:
    """An instance of the dataclass `cls` from `data`, every value type-checked."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    retired, renamed = getattr(cls, "RETIRED", {}), getattr(cls, "RENAMED", {})
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key in retired:
            raise ConfigError(f"{src.name(full)}: {full} no longer exists; {retired[key]}")
        if key not in names:
            raise _unknown_key(full, key, names, prefix, src)
        if isinstance(value, str) and value in renamed.get(key, {}):
            raise ConfigError(f"{src.name(full)}: {value!r} {renamed[key][value]}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise _section_error(full, [f.name for f in dataclasses.fields(tp)], src)
            kwargs[key] = build(tp, value, src, f"{full}.")
        else:
            kwargs[key] = _coerce(value, tp, full, src)
    return cls(**kwargs)


def parse_set(item: str) -> tuple[list[str], Any]:
    """Parse one `--set section.key=value`; the value is read as TOML, else taken as a string."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set train.lr=1e-6")
    key, raw = item.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: the key is empty")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as grpo or a path
    except RecursionError:
        raise ConfigError(f"--set {key}=...: the value nests arrays too deeply to be read") from None
    if raw.lower() in ("none", "null"):
        value = None
    return key.split("."), value


def quoted(text: str) -> str:
    """`text` as a TOML string, for a CLI option that stands for a --set (--model PATH)."""
    return toml_string(text)


def _merge(base: dict[str, Any], path: list[str], value: Any, label: str) -> None:
    node = base
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{label}: '{part}' is a value, not a section")
    node[path[-1]] = value


def _deep_update(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: Union[str, Path, None] = None, sets: Union[list[SetItem], tuple[SetItem, ...]] = (),
                base: Optional[dict[str, Any]] = None) -> Config:
    """Read a TOML file (optional), apply `--set` overrides in order, validate. A `sets` item is
    'key=value', or ('key=value', 'how the user typed it') for a CLI option such as --steps."""
    data: dict[str, Any] = dict(base or {})
    src = Sources()
    if path is not None:
        loaded = read_toml(path)
        for k, v in loaded.items():
            src.note(k, v, "file", str(path))
        data = _deep_update(data, loaded)
    for name, tp in typing.get_type_hints(Config).items():   # `train = 3` in the file is its error, not a --set's
        if name in data and not isinstance(data[name], dict):
            raise _section_error(name, [g.name for g in dataclasses.fields(tp)], src)
    for item in sets:
        text, label = item if isinstance(item, tuple) else (item, f"--set {item}")
        keys, value = parse_set(text)
        _merge(data, keys, value, label)
        src.note(".".join(keys), value, "set", label)
    cfg = build(Config, data, src)
    try:
        return cfg.validate()
    except ConfigError as e:
        raise ConfigError(src.annotate(str(e))) from None
