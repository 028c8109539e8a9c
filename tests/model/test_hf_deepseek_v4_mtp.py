"""DeepSeek-V4's MTP layers in checkpoints (`mtp.{h}.*`, model/interop/deepseek_v4.py): imported
when the files hold them (the release), absent from what transformers' save_pretrained writes,
and models with other MTP heads exported only without them (`--drop-mtp`). Their placement and
tensor-exact round trip are in test_hf_deepseek_v4.py, beside the other layers'."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
from hf_step3p5_checkpoint import assert_same_tensors, read_dir, write_hf_dir
from test_hf_deepseek_v4 import CFG, HF_CONFIG, architecture, hf_tensors

import model.interop.hf as hf
from model.hf import main as hf_main
from model.interop.model_dir import save_model_dir
from model.lm import abstract_variables


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tensors = hf_tensors()
    return write_hf_dir(tmp_path_factory.mktemp("v4") / "hf", tensors, HF_CONFIG), tensors


def test_checkpoints_without_mtp_tensors_import_without_mtp_heads(tmp_path):
    """What transformers' save_pretrained writes: num_nextn_predict_layers 1, no mtp.* tensors."""
    path = write_hf_dir(tmp_path / "hf", hf_tensors(mtp=False), HF_CONFIG)
    config, variables = hf.load_hf_checkpoint(path, progress=False)
    assert architecture(config) == architecture(CFG) and "mtp_0" not in variables["params"]


def test_a_model_with_other_mtp_heads_exports_with_drop_mtp(source, tmp_path, capsys):
    """DeepSeek-V4's MTP layers are `layer` blocks: a model with a dense MTP head (Step 3.5's)
    is refused, naming --drop-mtp, which leaves the heads out and writes the checkpoint the
    model came from less its MTP layer."""
    config, variables = hf.load_hf_checkpoint(source[0], progress=False)
    dense = config.replace(mtp=dataclasses.replace(config.mtp, block="dense",
                                                   share_output_head=False))
    rng = np.random.default_rng(0)
    mtp = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype),
                       nn.meta.unbox(abstract_variables(dense))["params"]["mtp_0"])
    balance = {k: v for k, v in variables["balance"].items() if k != "mtp_0"}
    save_model_dir(dense, {"params": {**variables["params"], "mtp_0": mtp}, "balance": balance},
                   tmp_path / "model")
    assert hf_main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: mtp.block: DeepSeek-V4's MTP layers are full decoder layers")
    assert error.endswith("export without them with --drop-mtp\n") and error.count("\n") == 1
    assert not (tmp_path / "hf").exists()
    assert hf_main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "hf"),
                    "--drop-mtp", "--dtype", "bfloat16"]) == 0
    expected = {name: a for name, a in source[1].items() if not name.startswith("mtp.")}
    assert_same_tensors(expected, read_dir(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [  # no tokenizer, no .lock
        "config.json", "model.safetensors"]
