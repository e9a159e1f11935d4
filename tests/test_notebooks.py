"""The Colab notebooks run top to bottom in a fresh kernel, so they never rot."""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".ipynb"))


def test_the_notebooks_are_there():
    assert {"quickstart.ipynb", "custom_agent.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
@pytest.mark.timeout(600)
def test_notebook_runs(name, monkeypatch):
    # The kernel inherits this process's environment; a backend set by another library
    # (envpool sets MPLBACKEND=Agg when imported) would hide the plots.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    notebook = nbformat.read(os.path.join(ROOT, "examples", name), as_version=4)
    # Run where Jupyter runs it: in the notebook's folder, the checkout's examples/.
    client = NotebookClient(notebook, timeout=500, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(ROOT, "examples")}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    outputs = [o for cell in notebook.cells if cell.cell_type == "code"
               for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "display_data" for o in outputs)  # the plot
