"""The documentation states what the code does: its tables are plan()'s, CI runs README's commands, its
links resolve, and the code cites only what the repository holds."""

import re
from pathlib import Path

from edgerl.plan.explain import REFERENCE_TORCH, decision_table, fits_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# What a clone of the repository cannot follow: files outside it, a reference document's section numbers
# (renumbered as it grows). Cite docs/hardware.md or docs/benchmarks.md by heading instead.
OUTSIDE = re.compile(r"shared/|hardware\.md §|§[0-9]|[Ss]ections? [0-9]+")
CITING = ("edgerl", "bench")


def _block(text: str, name: str) -> str:
    block = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert block, f"the {name} block is missing"
    return block.group(1).strip()


def test_fits_table_is_generated_by_plan():
    readme = (ROOT / "README.md").read_text()
    assert _block(readme, "fits") == fits_table().strip(), \
        "README's fits table is stale: paste the output of `python -m edgerl.plan.explain fits`"


def test_decisions_table_is_generated_by_plan():
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert _block(guide, "decisions") == decision_table().strip(), \
        "docs/guide.md's decisions table is stale: paste the output of `python -m edgerl.plan.explain decisions`"


def test_the_tables_assume_the_torch_that_setup_installs():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"torch=={REFERENCE_TORCH}" in setup


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup, tests = "bash scripts/setup.sh", ".venv/bin/python -m pytest -q"
    assert f"{setup} && {tests}" in readme and f"{setup} && .venv/bin/edgerl train --config examples/demo-cpu.toml" in readme
    assert setup in ci and tests in ci
    assert (ROOT / "examples" / "demo-cpu.toml").exists()


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; at most 250 (move detail to docs/)"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_slug_is_githubs():
    assert _slug("Against TRL: 362M and 1.7B") == "against-trl-362m-and-17b"
    assert _slug("Triton and torch.compile") == "triton-and-torchcompile"


def test_relative_links_resolve():
    bad = []
    for doc in DOCS:
        assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_code_cites_only_the_repository():
    hits = []
    for top in CITING:
        for f in sorted((ROOT / top).rglob("*")):
            if f.is_file() and f.suffix in (".py", ".toml", ".sh", ".cu", ".md"):
                for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if OUTSIDE.search(line):
                        hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, ("cite docs/hardware.md or docs/benchmarks.md by heading, not files outside the repository "
                      "or section numbers:\n" + "\n".join(hits))


def test_the_readmes_recommend_sample_is_what_the_command_prints():
    """Each line of README's `edgerl recommend` sample (but the "[...]" elisions) comes out of the command
    today, in that order, at the sample's width of 100 columns."""
    import os
    import subprocess
    import sys
    readme = (ROOT / "README.md").read_text()
    cmd = "$ edgerl recommend --gpu p40 --model qwen2.5-0.5b"
    block = readme[readme.index(cmd) + len(cmd):].split("```", 1)[0]
    want = [line for line in block.strip("\n").splitlines() if not line.startswith("[...")]
    out = subprocess.run([sys.executable, "-m", "edgerl.cli", *cmd.split()[2:]], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "100"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = [line.rstrip() for line in out.stdout.splitlines()]
    at = 0
    for line in want:
        assert line in got[at:], f"README's recommend sample: {line!r} is no longer printed (after line {at}); " \
                                 "paste the command's output at COLUMNS=100"
        at = got.index(line, at) + 1
    # and the elisions count the decisions left out: the two shown and the ones "[... N ...]" names
    shown = sum(int(n) for n in re.findall(r"^\[\.\.\. (\d+) (?:more )?decisions", block, re.M))
    end = next(i for i, line in enumerate(got) if "component" in line)
    rows = [line for line in got[:end] if line.startswith("│ ") and line[2] != " "]
    assert len(rows) == shown + 2, f"the recommend sample says {shown + 2} decisions; the command prints {len(rows)}"
