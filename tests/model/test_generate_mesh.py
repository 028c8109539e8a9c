"""`python -m model.generate --mesh`: a model whose parameters are sharded over devices decodes
the tokens one device decodes (greedy). The source is the hand-written Step 3.5 checkpoint of
tests/hf_step3p5_checkpoint.py (5 layers, 8 routed experts, scanned layers, MTP heads),
imported as bfloat16 (`python -m model.hf import`'s default); the 8-device half runs in
tests/decode_mesh_worker.py."""

from __future__ import annotations

import pytest
from hf_step3p5_checkpoint import EXPERTS, REPO
from train_helpers import run_device_worker

from model.hf import main as hf_main

MESH = "fsdp=2,expert=2,tensor=2"  # every axis a decoding mesh may have but `data`


@pytest.mark.slow
def test_sharded_decode_equals_one_device(hf_source, tmp_path):
    assert hf_main(["import", str(hf_source[0]), "--out", str(tmp_path / "model")]) == 0
    report = run_device_worker(REPO / "tests" / "decode_mesh_worker.py", 8,
                               str(tmp_path / "model"), "arith_chars", "12+34=", MESH)
    assert report["devices"] == 8
    single, sharded = report["single"], report["meshes"][MESH]
    assert len(single["token_ids"]) == 12  # no early stop: every step is compared
    assert sharded["token_ids"] == single["token_ids"]
    assert sharded["text"] == single["text"]
    # the parameters really were spread: experts [layers, E, D, H] over `expert`, query
    # projections [layers, D, heads, head_dim] over `fsdp` (D) and `tensor` (heads)
    spread = report["placement"][MESH]
    assert spread["experts"][1] == "expert" and EXPERTS % 2 == 0
    assert spread["q_proj"][1:3] == ["fsdp", "tensor"]
