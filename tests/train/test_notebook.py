"""The quickstart notebook runs top to bottom in a fresh kernel (nbclient) and shows what it
promises: a falling loss, the expert-health and attention-gate figures, generated text."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch):
    # The kernel inherits the environment: the suite's compilation cache, but XLA's default
    # optimisation level, as a user gets it (the suite's level 0 compiles faster but runs the
    # notebook's 30 training steps ~5x slower).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2, "expert-health and attention-gate figures"
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 30 steps", text).groups())
    assert last < first
    generated = notebook.cells[-1].outputs[-1]["text"]
    assert generated.startswith("'def main(") and len(generated) > len("'def main('") + 10
