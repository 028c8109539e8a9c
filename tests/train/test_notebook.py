"""The quickstart notebook runs top to bottom in a fresh kernel (nbclient) and does what it
promises: 30 training steps whose loss falls, the expert-health and attention-gate figures drawn
from sane values, and a greedy generation of the requested 32 tokens after the prompt. After the
notebook's own cells, one extra cell (not part of the notebook) prints the notebook's variables
as JSON; the test checks them and that the notebook's printed outputs agree with them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"
STEPS, LOG_EVERY, NEW_TOKENS = 30, 3, 32  # the notebook's overrides and generation length

# Runs in the notebook's kernel after its cells: what they computed, as JSON.
PROBE = """
import json as _json, math as _math
print("PROBE " + _json.dumps({
    "losses": summary.losses, "last_step": summary.last_step,
    "records": [{k: v for k, v in r.items() if isinstance(v, (int, float)) or v is None}
                for r in records],
    "panels": [name for _, names in panels for name in names],
    "layout": config.layout, "full_heads": config.full_attention.num_heads,
    "swa_heads": config.swa_attention.num_heads,
    "experts": config.moe.num_experts, "top_k": config.moe.top_k,
    "gates": [[None if _math.isnan(v) else v for v in row] for row in matrix.tolist()],
    "prompt": prompt, "generated": generation.tokens[0],
    "text": tokenizer.decode(prompt + generation.tokens[0]),
}))
"""


def finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


@pytest.mark.slow
def test_quickstart_notebook_trains_plots_and_generates(monkeypatch):
    # The kernel inherits the environment: the suite's compilation cache, but XLA's default
    # optimisation level, as a user gets it (the suite's level 0 compiles faster but runs the
    # notebook's 30 training steps ~5x slower).
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    cells = len(notebook.cells)
    notebook.cells.append(nbformat.v4.new_code_cell(PROBE))
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for cell in notebook.cells[:cells] if cell.cell_type == "code"
               for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    probe = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
    got = json.loads(probe[probe.index("PROBE ") + len("PROBE "):])

    # Training: every step ran, the printed summary is the run's, and the loss fell.
    losses = got["losses"]
    assert got["last_step"] == STEPS and len(losses) == STEPS and len(finite(losses)) == STEPS
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) over 30 steps", text).groups())
    assert (first, last) == (round(losses[0], 3), round(losses[-1], 3))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses

    # The metrics the expert-health figure plots: logged every 3 steps, each with values, in range.
    records = got["records"]
    assert [r["step"] for r in records] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    for name in got["panels"]:
        assert finite(r.get(name) for r in records), f"{name}: nothing to plot"
    ceiling = got["experts"] / got["top_k"]  # every token of a layer on one expert
    for r in records:
        assert 1.0 - 1e-6 <= r["moe/load_max_over_mean"] <= ceiling + 1e-6, r
        assert 0.0 <= r["moe/load_min_over_mean"] <= 1.0 + 1e-6, r
        assert 0.0 < r["moe/routing_confidence"] <= 1.0 + 1e-6, r
        for stat in ("act_rms", "out_norm"):  # per expert, relative to the median expert
            assert r[f"moe/{stat}_min_over_median"] <= 1.0 + 1e-6, r
            assert r[f"moe/{stat}_max_over_median"] >= 1.0 - 1e-6, r
        assert r["grad_norm"] > 0 and math.isfinite(r["loss/lm"] + r["loss/mtp"]), r
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2, "expert-health and attention-gate figures"

    # Attention-gate figure: one row per layer, one sigmoid gate in (0, 1) per query head of the
    # layer's type (full layers have fewer heads; the rest of their row is empty).
    assert len(got["gates"]) == len(got["layout"])
    for kind, row in zip(got["layout"], got["gates"]):
        heads = got["full_heads"] if kind == "F" else got["swa_heads"]
        assert len(finite(row)) == heads and all(v is None for v in row[heads:]), (kind, row)
        assert all(0.0 < v < 1.0 for v in row[:heads]), (kind, row)

    # Generation: exactly the requested tokens (no stop ids), printed after the prompt.
    assert len(got["generated"]) == NEW_TOKENS
    assert got["text"].startswith("def main(")
    printed = notebook.cells[cells - 1].outputs[-1]["text"]
    assert printed.strip() == repr(got["text"])
