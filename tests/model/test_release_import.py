"""`python -m model.hf import` of a release: bfloat16 by default (float32 on request) recorded in
the model directory and cast as every loader asks, one summary line, memory that does not grow
with the model (tensor by tensor into the model directory's files), the Hub download (its
`snapshot_download` faked: everything up to the call runs offline), the previous (orbax) model
directory format still read, and variables not written whole refused. The source is the
hand-written checkpoint of tests/hf_step3p5_checkpoint.py; the tokenizer copy is tested with the
chat in tests/model/test_chat.py."""

from __future__ import annotations

import json
import sys
import tracemalloc

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hf_step3p5_checkpoint import CFG, EXPERTS, assert_same_variables
from train_helpers import TINY

from model.config import config_to_dict, load_config
from model.hf import main
from model.interop.hf import save_hf_checkpoint
from model.interop.hf_import import import_release
from model.interop.hf_stream import open_hf_checkpoint
from model.interop.model_dir import writing_model_dir
from model.lm import abstract_variables
from model.weights import load_model


def files_size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_import_writes_bfloat16_by_default_and_loaders_cast_on_request(hf_source, imported,
                                                                      tmp_path, capsys):
    hf_dir, tensors = hf_source
    config, reference = imported  # float32, as load_hf_checkpoint reads by default
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "bf16")]) == 0
    line = capsys.readouterr().out
    parameters = sum(t.size for n, t in tensors.items() if not n.endswith("router_bias"))
    routed = sum(t.size for n, t in tensors.items()
                 if n.endswith(("moe.gate_proj.weight", "moe.up_proj.weight",
                                "moe.down_proj.weight")))
    active = parameters - routed + routed * 2 // EXPERTS  # top 2 of the 8 routed experts
    assert line == (f"imported step3p5: {parameters / 1e3:.2f} K parameters "
                    f"({active / 1e3:.2f} K active), bfloat16, "
                    f"{files_size(tmp_path / 'bf16') / 1e3:.2f} KB written to {tmp_path / 'bf16'}; "
                    "no tokenizer in the release\n")
    saved = json.loads((tmp_path / "bf16" / "model_config.json").read_text())
    assert saved["model"]["param_dtype"] == "bfloat16"

    got_config, got = load_model(tmp_path / "bf16")
    assert got_config == config.replace(param_dtype="bfloat16")
    assert {a.dtype for a in jax.tree.leaves(got["params"])} == {np.dtype(ml_dtypes.bfloat16)}
    assert {a.dtype for a in jax.tree.leaves(got["balance"])} == {np.dtype(np.float32)}
    # the release is bfloat16 (router biases float32): nothing was rounded
    assert_same_variables(jax.tree.map(lambda a, b: np.asarray(a).astype(b.dtype), reference,
                                       got), got)
    # training from it: float32 masters, the config saying so
    upcast_config, upcast = load_model(tmp_path / "bf16", param_dtype="float32")
    assert upcast_config == config
    assert_same_variables(reference, upcast)

    assert main(["import", str(hf_dir), "--out", str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    assert "float32" in capsys.readouterr().out
    assert load_model(tmp_path / "f32")[0] == config
    assert_same_variables(reference, load_model(tmp_path / "f32")[1])
    assert files_size(tmp_path / "f32") > 1.9 * files_size(tmp_path / "bf16")


def float32_release(path, layers: int):
    """A float32 Step 3.5 release of `layers` layers (one dense, then MoE with 8 experts of
    [256, 128], 1 MiB per layer's stacked expert tensor), written in 2 MiB shards by the
    exporter."""
    zeros = ", ".join(["0"] * layers)
    cfg = load_config(TINY, [
        "vocab_size=256", "d_model=128", f"num_layers={layers}", "layout=F" + "S" * (layers - 1),
        "window=8", "head_dim=32", "num_dense_layers=1", "dense_hidden=256", "moe.num_experts=8",
        "moe.top_k=2", "moe.expert_hidden=256", "moe.shared_hidden=128", f"swiglu_limits=[{zeros}]",
        f"swiglu_limits_shared=[{zeros}]", "mtp.num_heads=0"])
    rng = np.random.default_rng(layers)
    shapes = nn.meta.unbox(abstract_variables(cfg))
    variables = jax.tree.map(lambda a: (rng.standard_normal(a.shape) * 0.02).astype(a.dtype),
                             shapes)
    save_hf_checkpoint(cfg, variables, path, dtype="float32", max_shard_bytes=2 * 2**20,
                       progress=False)
    return path


def test_import_memory_does_not_grow_with_the_model(tmp_path):
    """Python-allocated memory (numpy arrays included) at its peak during an import: the same
    for a release of 2 and of 8 layers, and a fraction of the larger. (The model's shapes are
    traced before, to keep the tracing out of the time: tracemalloc slows it several-fold.)"""
    peaks, sizes = [], []
    for layers in (2, 8):
        release = float32_release(tmp_path / f"release{layers}", layers)
        sizes.append(files_size(release))
        open_hf_checkpoint(release, param_dtype="bfloat16")  # the model's shapes, traced once
        tracemalloc.start()
        try:
            import_release(release, tmp_path / f"model{layers}", progress=False)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert sizes[1] > 2 * sizes[0]
    assert peaks[1] < 1.1 * peaks[0] + 2**20, (peaks, sizes)
    assert peaks[1] < sizes[1] / 4, (peaks, sizes)


def test_hf_download_fetches_only_what_the_import_reads(hf_source, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(hf_source[0])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert main(["import", "--hf", "stepfun-ai/Step-3.5-Flash", "--revision", "v1",
                 "--out", str(tmp_path / "model")]) == 0
    assert "imported step3p5" in capsys.readouterr().out
    [(repo, kwargs)] = calls
    assert repo == "stepfun-ai/Step-3.5-Flash" and kwargs["revision"] == "v1"
    assert sorted(kwargs["allow_patterns"]) == sorted([
        "config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
        "generation_config.json"])
    assert load_model(tmp_path / "model")[0].param_dtype == "bfloat16"


@pytest.mark.parametrize("argv, problem", [
    (["--hf", "not a model id"], "--hf: 'not a model id' is not a Hugging Face model id"),
    (["--hf", "org/../x"], "is not a Hugging Face model id"),
    (["{src}", "--revision", "v1"], "--revision: only with --hf"),
    (["{src}", "--hf", "a/b"], "not allowed with argument"),
    (["{src}", "--dtype", "int8"], "--dtype"),
])
def test_bad_import_arguments_are_one_line(hf_source, tmp_path, capsys, argv, problem):
    argv = [a.format(src=hf_source[0]) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(["import", *argv, "--out", str(tmp_path / "model")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and problem in err and err.count("\n") == 1
    assert not (tmp_path / "model").exists()


def test_download_failures_are_one_line(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach\nthe Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert main(["import", "--hf", "org/name", "--out", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --hf org/name: download failed (LocalEntryNotFoundError: "
                          "cannot reach the Hub)") and err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    assert main(["import", "--hf", "org/name", "--out", str(tmp_path / "model")]) == 2
    assert "pip install 'stepjax[hub]'" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def test_model_directories_of_the_orbax_format_still_load(imported, tmp_path):
    config, variables = imported
    old = tmp_path / "old"
    old.mkdir()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((old / "variables").absolute(), variables)
    (old / "model_config.json").write_text(json.dumps(
        {"format": "stepjax-model-v1", "model": config_to_dict(config)}))
    got_config, got = load_model(old)
    assert got_config == config
    assert_same_variables(variables, got)
    bf16_config, bf16 = load_model(old, param_dtype="bfloat16")
    assert bf16_config.param_dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(bf16["params"])} == {np.dtype(ml_dtypes.bfloat16)}


def test_a_variable_not_written_whole_is_refused_and_nothing_is_left(tmp_path):
    with pytest.raises(ValueError, match=r"moe/gate_proj: 1 of \d+ parts were written"):
        with writing_model_dir(CFG, tmp_path / "model") as (writer, _):
            for v in writer.layout:  # every variable whole, but one expert of gate_proj
                if v.name.endswith("moe/gate_proj"):
                    writer.write(v.name, (0, 0), np.zeros(v.shape[2:], np.float32))
                else:
                    writer.write(v.name, (), np.zeros(v.shape, np.float32))
    assert [p.name for p in tmp_path.iterdir()] == []
