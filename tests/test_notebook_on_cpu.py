"""examples/notebooks/grpo-free-t4.ipynb runs, cell by cell in a real kernel (nbclient), on the CPU: its
parameters cell is followed by one that swaps the T4 run for a tiny random model, two steps and the GSM8K
sample in tests/data (as papermill injects parameters), so that no cell rots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import GSM8K, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebooks" / "grpo-free-t4.ipynb"


@pytest.mark.slow
def test_the_t4_notebook_runs_on_the_cpu_with_a_tiny_model(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="executing the notebook needs nbformat, nbclient and ipykernel "
                                   "(pip install -e '.[dev]')")
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[dev]' installs nbclient")
    pytest.importorskip("ipykernel", reason="pip install -e '.[dev]' installs ipykernel")
    model = make_tiny_model(tmp_path / "tiny")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    overrides = dict(MODEL=str(model), PROFILE="cpu", STEPS=2, PROMPTS_PER_STEP=2, SAMPLES=2, MAX_NEW_TOKENS=8,
                     EVAL_PROMPTS=4, EVAL_EVERY=1, GSM8K_FROM=str(GSM8K), RUN_DIR=str(tmp_path / "run"))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in overrides.items())))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()   # raises CellExecutionError, with the cell and its traceback, when a cell fails
    out = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "edgerl 0.1.0" in out and "held-out accuracy by step: [(0," in out
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert (run / "final" / "config.json").exists() and (run / "curves.png").exists()
    assert not list((run / "checkpoints").iterdir())   # run.final_only
    assert list((tmp_path / "run-gguf").glob("*.gguf")), "the export cell writes the GGUF file"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the plot cell shows the curves"
