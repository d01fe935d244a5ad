"""Every notebook runs top to bottom at small sizes (HF_PAGED_CACHE_NOTEBOOK_SMALL=1: a tiny random model),
so a change to the public API that breaks one fails here. The committed copies hold the full runs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_found():
    expected = {"01_quickstart", "02_quantization", "03_eviction", "04_memory", "05_serving"}
    assert expected <= {path.stem for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_small(path: Path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CACHE_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})  # fmt: skip
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("image/png" in output.get("data", {}) for output in outputs), "no plot was drawn"
    assert "small sizes" in "".join(output.get("text", "") for output in outputs)
