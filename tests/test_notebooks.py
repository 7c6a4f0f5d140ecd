"""Every notebook runs top to bottom (nbclient); any failing cell fails the test."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    env_backup = os.environ.get("XLA_FLAGS")
    # The kernel is a fresh process: let the notebook set its own device count.
    os.environ.pop("XLA_FLAGS", None)
    try:
        NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
    finally:
        if env_backup is not None:
            os.environ["XLA_FLAGS"] = env_backup
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not any(o.get("output_type") == "error" for o in outputs)
