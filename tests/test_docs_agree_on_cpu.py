"""Statements in the documentation that a table in the code can produce are generated from it and checked here:
what a resume may change (edgerl/train/resume.py), against README, the guide, run-folders.md and multinode.md."""

from __future__ import annotations

import re
from pathlib import Path

from edgerl.config.schema import Config, to_dict
from edgerl.train import resume

ROOT = Path(__file__).resolve().parents[1]
RESUME_DOCS = ("README.md", "docs/guide.md", "docs/run-folders.md", "docs/multinode.md")


def _block(text: str, name: str) -> str:
    block = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert block, f"the {name} block is missing"
    return block.group(1).strip()


def test_the_resume_table_is_the_codes():
    doc = (ROOT / "docs" / "run-folders.md").read_text()
    assert _block(doc, "resume") == resume.table(), \
        "docs/run-folders.md's resume table is stale: paste the output of `python -m edgerl.train.resume`"


def test_the_resume_table_names_every_key_of_the_config():
    keys = {f"{s}.{k}" for s, v in to_dict(Config()).items() if isinstance(v, dict) for k in v}
    named = set(resume.RESTORED) | set(resume.REFUSED) | set(resume.IGNORED)
    assert named <= keys, named - keys
    table = resume.table()
    for section in {k.split(".")[0] for k in keys}:
        assert f"`{section}.*`" in table, section


def _sentences(text: str) -> list[tuple[bool, str]]:
    """(under a heading about resuming, unit): a table row is one unit, a paragraph's sentences are the others
    (generated blocks and code left out)."""
    text = re.sub(r"```.*?```|<!-- resume:start -->.*?<!-- resume:end -->", "", text, flags=re.S)
    out, heading = [], ""
    for para in re.split(r"\n\s*\n", text):
        if para.lstrip().startswith("#"):
            heading = para.strip().splitlines()[0]
        about = bool(re.search(r"resum", heading, re.I))
        rows = [line for line in para.splitlines() if line.startswith("|")]
        prose = " ".join(line for line in para.splitlines() if not line.startswith(("|", "#")))
        out += [(about, u) for u in rows + [s for s in re.split(r"(?<=[.!?])\s+", " ".join(prose.split())) if s]]
    return out


def contradictions(text: str) -> list[str]:
    """Sentences about a resume that say otherwise than resume.py: another number of processes refused, a key
    of REFUSED said to take effect, or a key that takes effect said to be refused."""
    out = []
    for about, s in _sentences(text):
        if not (about or re.search(r"resum", s, re.I)):
            continue
        if re.search(r"number of (?:processes|GPUs)|nproc_per_node", s) and \
                re.search(r"refus|only with|cannot|must (?:be|match)|not allowed", s, re.I):
            out.append(f"another number of processes re-shards ({resume.RESHARDED[1][:40]}...): {s}")
        keys = re.findall(r"`([a-z_]+\.[a-z_]+)[`=]", s)
        says_refused = re.search(r"\brefus", s, re.I)
        says_applied = re.search(r"\b(?:applied|takes? effect|may change|can change)\b", s, re.I)
        for k in keys:
            if says_refused and not says_applied and (k in resume.RESTORED or k in resume.SCHEDULE):
                out.append(f"{k} is restored, then set, not refused: {s}")
            if says_applied and not says_refused and k in resume.REFUSED:
                out.append(f"{k} is refused: {s}")
    return out


def test_no_doc_contradicts_the_resume_table():
    bad = [f"{doc}: {c}" for doc in RESUME_DOCS for c in contradictions((ROOT / doc).read_text())]
    assert not bad, "\n".join(bad)


def test_the_contradiction_check_finds_them():
    assert contradictions("A run resumes only with the number of processes it was written by.")
    assert contradictions("A resume with another number of GPUs is refused.")
    assert contradictions("On a resume `train.lr` is refused.")
    assert contradictions("On a resume a new `train.seed` takes effect from the next step.")
    assert not contradictions("`--resume RUN` under another `--nproc_per_node` re-shards the weights.")
    assert not contradictions("A resume that changes `train.seed` is refused.")


def _error_column(section: str) -> list[float]:
    """Every figure of the "error" columns of benchmarks.md's section (its own tables, not its subsections')."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    body = re.split(r"\n## |\n### ", text.split(f"\n## {section}\n", 1)[1])[0]
    out, col = [], None
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            col = None
        elif col is None:
            col = cells.index("error") if "error" in cells else -1
        elif col >= 0 and not set(cells[0]) <= set("-") and re.match(r"[+-]\d", cells[col]):
            out.append(float(re.match(r"[+-]\d+(?:\.\d+)?", cells[col]).group()))
    return out


def test_the_docs_state_the_memory_errors_the_tables_show():
    """README and the guide give the range of the estimate's error over the recipes and the long-response rows,
    as the tables in docs/benchmarks.md hold it, and call it above the peak only while no error is negative."""
    errors = _error_column("Recipes") + _error_column("Long responses")
    assert len(errors) >= 20
    assert min(errors) > 0, "an estimate below its measured peak: README and the guide say otherwise"
    span = f"+{min(errors):.1f}% to +{max(errors):.1f}%"
    for doc in ("README.md", "docs/guide.md"):
        flat = " ".join((ROOT / doc).read_text().split())
        assert span in flat, f"{doc}: the memory estimates' errors in docs/benchmarks.md are {span}"
        assert not re.search(r"can be \d+-\d+% low", flat), f"{doc}: the tables show no estimate below its peak"


def _layers_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("import_layers", ROOT / "scripts" / "import_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_design_states_the_import_layers():
    """docs/design.md's layer line is the import graph's: every part one layer above the highest it imports, so no
    import runs back up a layer; and no import circle between files, nor between parts."""
    lay = _layers_module()
    doc = (ROOT / "docs" / "design.md").read_text()
    assert _block(doc, "layers") == lay.layer_line(), \
        "docs/design.md's layers are stale: paste the output of `python scripts/import_layers.py`"
    assert lay.circles(lay.file_graph()) == [] and lay.circles(lay.part_graph()) == []
    order = {p: i for i, layer in enumerate(lay.layers(lay.part_graph())) for p in layer}
    up = [(a, b) for a, bs in lay.part_graph().items() for b in bs if order[b] >= order[a]]
    assert up == [], f"imports that run back up (or across) a layer: {up}"


def test_the_import_check_sees_circles_and_layers():
    lay = _layers_module()
    assert lay.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert lay.layers({"a": set(), "b": {"a"}, "c": {"a", "b"}, "d": {"a"}}) == [["a"], ["b", "d"], ["c"]]
    graph = lay.file_graph()
    assert "edgerl.plan.plan" in graph["edgerl.train.session"]     # an import at the top of a file
    assert "edgerl.train.sft" in graph["edgerl.train.api"]         # and one inside a function
