"""`python -m model.generate --mesh`: a model whose parameters are sharded over devices decodes
the tokens one device decodes (greedy). The source is the hand-written Step 3.5 checkpoint of
tests/hf_step3p5_checkpoint.py (5 layers, 8 routed experts, scanned layers, MTP heads),
imported as bfloat16 (`python -m model.hf import`'s default); the 8-device half runs in
tests/decode_mesh_worker.py."""

from __future__ import annotations

import pytest
from hf_step3p5_checkpoint import EXPERTS, REPO
from train_helpers import run_device_worker

from model.generate import main as generate_main
from model.hf import main as hf_main

MESH = "fsdp=2,expert=2,tensor=2"  # every axis a decoding mesh may have but `data`


@pytest.mark.slow
def test_sharded_decode_equals_one_device(hf_source, tmp_path):
    assert hf_main(["import", str(hf_source[0]), "--out", str(tmp_path / "model")]) == 0
    (tmp_path / "prompt.txt").write_text("12+34=")
    report = run_device_worker(REPO / "tests" / "decode_mesh_worker.py", 8,
                               str(tmp_path / "model"), "arith_chars", str(tmp_path / "prompt.txt"),
                               MESH)
    assert report["devices"] == 8
    single, sharded = report["single"], report["meshes"][MESH]
    assert single["prompt"] == sharded["prompt"] == "12+34="  # echoed, from the file or not
    assert len(single["token_ids"]) == 12  # no early stop: every step is compared
    assert sharded["token_ids"] == single["token_ids"]
    assert sharded["text"] == single["text"]
    # the parameters really were spread: experts [layers, E, D, H] over `expert`, query
    # projections [layers, D, heads, head_dim] over `fsdp` (D) and `tensor` (heads)
    spread = report["placement"][MESH]
    assert spread["experts"][1] == "expert" and EXPERTS % 2 == 0
    assert spread["q_proj"][1:3] == ["fsdp", "tensor"]


@pytest.mark.parametrize("args, problem", [
    ([], "one of --prompt or --prompt-file is required (or --chat alone"),
    (["--prompt", "1", "--prompt-file", "p.txt"], "not allowed with argument"),
    (["--prompt", "1", "--mesh", "pipeline=2"], "--mesh: decoding does not pipeline"),
    (["--prompt", "1", "--mesh", "context=2"], "--mesh: decoding keeps each sequence whole"),
    (["--prompt", "1", "--mesh", "tensor=2,expert=2"], "--mesh: tensor=2,expert=2 needs 4 "
                                                         "devices, this process has 1"),
    (["--prompt", "1", "--mesh", "tensor=two"], "--mesh: tensor='two' is not an integer"),
    (["--prompt-file", "{missing}"], "--prompt-file: cannot read"),
    (["--chat", "--max-len", "64"], "--max-len: 64 positions leave no room for a prompt beside "
                                    "--max-new-tokens 64"),
])
def test_bad_generate_arguments_are_one_line_before_loading(tmp_path, capsys, args, problem):
    """Refused before the weights are read: the model directory given does not even exist."""
    args = [a.format(missing=tmp_path / "missing.txt") for a in args]
    try:
        code = generate_main(["--workdir", str(tmp_path / "no_model"), *args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and problem in err and err.count("\n") == 1, err
