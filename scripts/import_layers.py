"""The package's import graph, read from the source (every import, a function's own included), as docs/design.md
states it: which part imports which, the layers that follow (a part sits one layer above the highest part it
imports), and any import circle between files.

    python scripts/import_layers.py          # the layer line of docs/design.md, then any circle

A part is one subpackage of edgerl (`edgerl/plan/`, `edgerl/kernels/` as `kernels`) or one of its top-level
modules (`edgerl/algos.py`). tests/test_docs_agree_on_cpu.py checks design.md's line
against it and that there are no circles.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the module name it is installed as
INSTALLED = {"edgerl": "edgerl"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in INSTALLED.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([name, *rel])] = f
    return out


def file_graph() -> dict[str, set[str]]:
    """module -> the modules of the package it imports (`from pkg import mod` counts as mod, not pkg)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1]) if node.level else ""
                mod = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def part(module: str) -> str:
    """edgerl.plan.memory -> plan; edgerl.algos -> algos; edgerl.kernels.nf4 -> kernels; edgerl -> edgerl."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def part_graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for name in _modules():
        out[part(name)]
    for a, bs in file_graph().items():
        out[part(a)] |= {part(b) for b in bs if part(b) != part(a)}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Parts by layer, lowest first: a part's layer is one above the highest layer it imports from."""
    level: dict[str, int] = {}

    def of(p: str, seen: tuple[str, ...] = ()) -> int:
        if p in seen:
            raise ValueError(f"import circle: {' -> '.join(seen + (p,))}")
        if p not in level:
            level[p] = 1 + max((of(q, seen + (p,)) for q in graph.get(p, ())), default=-1)
        return level[p]

    for p in graph:
        of(p)
    out: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for p, n in level.items():
        out[n].append(p)
    return [sorted(layer) for layer in out]


def layer_line() -> str:
    """docs/design.md's sentence: each layer's parts, lowest first."""
    return " < ".join(", ".join(f"`{p}`" for p in layer) for layer in layers(part_graph()))


if __name__ == "__main__":
    print(layer_line())
    for c in circles(file_graph()):
        print("circle:", " -> ".join(c), file=sys.stderr)
