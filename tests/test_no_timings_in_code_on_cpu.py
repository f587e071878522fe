"""Measured times live in docs/benchmarks.md with their command, machine, date and commit; the code's docstrings
and comments name the benchmark section instead ("docs/benchmarks.md, <heading>"), so a figure is never left
stale in a comment when the benchmark runs again."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edgerl",)
_NUM = r"\d+(?:\.\d+)?(?:\s*(?:-|to)\s*\d+(?:\.\d+)?)?"
# A time (12.9 ms, 4.8 us, 0.95 s, 2.1 seconds; not a setting: "every 0.5 s", "a 30 s timeout"), a measured
# speed-up (1.35x, 1.4-3.2x, 72x faster), a share of a measured step (13% of a decode step) or a figure said to
# be measured on a named machine.
MEASURED = re.compile(
    rf"(?<!every )(?<![\d.])\b{_NUM}(?: ?(?:ms|us|µs|ns)| (?:s|secs?|seconds?|minutes?|min))\b(?! (?:timeout|limit))"
    rf"|\b\d+\.\d+x\b|\b{_NUM}x,? (?:faster|slower|speed-?up|as fast)"
    r"|\b\d+(?:\.\d+)?% of (?:a|the|its) [\w.\- ]{0,30}\bstep"
    r"|\b(?:on|in) (?:an?|the) (?:H100|H200|A100|P40|T4|V100|RTX 4090)\b[^.]{0,80}\b\d+(?:\.\d+)?(?:%|x\b)", re.I)


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    src = path.read_text()
    out: list[tuple[int, str]] = []
    last = -2
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            if tok.start[0] == last + 1 and out:   # a comment block reads as one text (a figure may wrap)
                out[-1] = (out[-1][0], out[-1][1] + " " + tok.string.lstrip("# "))
            else:
                out.append((tok.start[0], tok.string))
            last = tok.start[0]
        elif tok.type == tokenize.STRING:
            # a kernel's C source held in a string: its // and /* */ comments are comments too
            for m in re.finditer(r"//[^\n]*|/\*.*?\*/", tok.string, re.S):
                out.append((tok.start[0] + tok.string[:m.start()].count("\n"), m.group()))
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body and isinstance(node.body[0], ast.Expr):
                first = node.body[0].lineno
                out.append((first, doc))
    return out


def measured_figures() -> list[str]:
    hits = []
    for top in PACKAGES:
        for f in sorted((ROOT / top).rglob("*.py")):
            for line_no, text in _comments_and_docstrings(f):
                for m in MEASURED.finditer(" ".join(text.split())):
                    hits.append(f"{f.relative_to(ROOT)}:{line_no}: ...{m.string[max(0, m.start() - 60):m.end() + 20]}...")
    return hits


def test_no_measured_time_in_a_docstring_or_comment():
    hits = measured_figures()
    assert not hits, ("a measured figure in the code goes stale: put it in docs/benchmarks.md (with its command, "
                      "machine, date and commit) and cite the section, \"docs/benchmarks.md, <heading>\":\n"
                      + "\n".join(hits))


def test_the_check_finds_what_it_should():
    for text in ("# took 12.9 ms against 13.88", "# 4.8 us at width 4096", "# 1.35x at N = 3584",
                 "# 0.95 s packed against 0.75 s", "# 1.4-3.2x at 32 rows", "# on an H200 it reached 46% of the rate",
                 "# 13% of a 7B decode step", "# (on an H200, 72x\n# faster than the host)"):
        assert MEASURED.search(text), text
    for text in ("# 16 rows of 64 columns", "# a 2-byte element", "# sm_61 has no fp16 arithmetic",
                 "# the reward worker's 30 s timeout", "# 8x the work", "# H100, H200 (Hopper)", "# again every 0.5 s",
                 "# eight 0.7s", "# on an H200 a 3584 x 3584 weight"):
        assert not MEASURED.search(text), text


def _headings(doc: str) -> list[str]:
    return [h.strip() for h in re.findall(r"^#{2,4} (.+)$", (ROOT / "docs" / doc).read_text(), re.M)]


def test_every_cited_section_exists():
    """"docs/benchmarks.md, <heading>" and "docs/lab-log.md, <heading>" in a docstring or comment name a heading
    that is there (a heading renamed or moved breaks the citation)."""
    heads = {doc: _headings(doc) for doc in ("benchmarks.md", "lab-log.md")}
    bad = []
    for top in PACKAGES:
        for f in sorted((ROOT / top).rglob("*.py")):
            for line_no, text in _comments_and_docstrings(f):
                flat = " ".join(text.replace("#", " ").replace("//", " ").split())
                for doc, cited in re.findall(r"docs/(benchmarks\.md|lab-log\.md), ([^;)]+)", flat):
                    if not any(cited.startswith(h) for h in heads[doc]):
                        bad.append(f"{f.relative_to(ROOT)}:{line_no}: docs/{doc}, {cited[:60]}")
    assert not bad, "no such heading:\n" + "\n".join(bad)
