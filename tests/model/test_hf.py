"""Tests of the Hugging Face Step 3.5 checkpoint import/export (`model.interop.hf`) and the one model
loader (`model.weights`).

The Hugging Face directory used here is written by the test itself from a hand-written table of
tensor names and torch shapes and a hand-written config.json (DESIGN.md §3, vLLM
`step3p5.py` / `step3p5_mtp.py`), never by the exporter under test; the expected stepjax tree is
likewise placed by explicit per-name assignment below.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from model.config import MTPConfig, config_to_dict, load_config
from model.interop.hf import (
    CheckpointFormatError, config_from_hf, config_to_hf, load_hf_checkpoint, main,
    save_hf_checkpoint,
)
from model.lm import CausalLM
from model.layers.params import convert_layer_layout
from model.weights import abstract_variables, load_model, save_model_dir

REPO = Path(__file__).resolve().parents[2]

# configs/tiny.yaml at test sizes: F/S layout with 4 full / 6 SWA query heads, one dense layer
# then MoE (8 experts, top 2, shared expert), clamps on the last layer, head-wise gate, QK norm,
# distinct RoPE per type with llama3 scaling on full layers, 3 MTP heads, scanned layers.
OVERRIDES = [
    "vocab_size=64", "d_model=32", "num_layers=5", "layout=F+SSSF", "window=8", "head_dim=8",
    "dense_hidden=64", "moe.num_experts=8", "moe.top_k=2", "moe.expert_hidden=16",
    "moe.shared_hidden=16", "swiglu_limits=[0, 0, 0, 0, 7.0]",
    "swiglu_limits_shared=[0, 0, 0, 0, 16.0]", "full_attention.rope_theta=500000.0",
    "full_attention.rope_scaling={type: llama3, factor: 2.0, original_max_len: 64, "
    "low_freq_factor: 1.0, high_freq_factor: 4.0}",
]
CFG = load_config(REPO / "configs" / "tiny.yaml", OVERRIDES)
D, VOCAB, KV, HEAD_DIM = 32, 64, 2, 8
EXPERTS, EXPERT_HIDDEN, SHARED_HIDDEN, DENSE_HIDDEN = 8, 16, 16, 64
LAYERS, MTP_HEADS, MOE_LAYERS = 5, 3, (1, 2, 3, 4)
FULL = (0, 4)  # full-attention layers; the rest and the MTP blocks are SWA

HF_CONFIG = {
    "model_type": "step3p5", "architectures": ["Step3p5ForCausalLM"],
    "vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_attention_groups": KV, "head_dim": HEAD_DIM,
    "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 6,
                                "num_attention_groups": KV, "head_dim": HEAD_DIM},
    "att_impl_type": "GQA", "sliding_window": 8,
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                    "sliding_attention", "full_attention"] + ["sliding_attention"] * 3,
    "rope_theta": [500000.0, 10000.0, 10000.0, 10000.0, 500000.0, 10000.0, 10000.0, 10000.0],
    "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0],
    "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 64,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "yarn_only_types": ["full_attention"],
    "use_head_wise_attn_gate": True, "use_qk_norm": True, "intermediate_size": DENSE_HIDDEN,
    "moe_layers_enum": "1,2,3,4", "moe_num_experts": EXPERTS, "moe_top_k": 2,
    "moe_intermediate_size": EXPERT_HIDDEN, "share_expert_dim": SHARED_HIDDEN,
    "moe_router_activation": "sigmoid", "moe_router_scaling_factor": 3.0,
    "use_moe_router_bias": True, "norm_expert_weight": True, "need_fp32_gate": True,
    "swiglu_limits": [0, 0, 0, 0, 7.0, 0, 0, 0],
    "swiglu_limits_shared": [0, 0, 0, 0, 16.0, 0, 0, 0],
    "num_nextn_predict_layers": MTP_HEADS, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "max_position_embeddings": 128, "torch_dtype": "bfloat16", "bos_token_id": 0,
}
# ModelConfig fields a config.json does not carry (run-time choices).
RUNTIME_FIELDS = ("param_dtype", "compute_dtype", "attention_impl", "moe_impl", "remat_policy",
                  "scan_layers", "init_std", "ep_collective", "pipeline_microbatches")


def heads(layer: int) -> int:
    return 4 if layer in FULL else 6


def hf_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its torch shape (Linear weights are [out, in])."""
    shapes = {"model.embed_tokens.weight": (VOCAB, D)}

    def block(i: int, moe: bool) -> None:
        p, h = f"model.layers.{i}.", heads(i)
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (h * HEAD_DIM, D),
            p + "self_attn.k_proj.weight": (KV * HEAD_DIM, D),
            p + "self_attn.v_proj.weight": (KV * HEAD_DIM, D),
            p + "self_attn.o_proj.weight": (D, h * HEAD_DIM),
            p + "self_attn.g_proj.weight": (h, D),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
        })
        if moe:
            shapes.update({
                p + "moe.gate.weight": (EXPERTS, D), p + "moe.router_bias": (EXPERTS,),
                p + "moe.gate_proj.weight": (EXPERTS, EXPERT_HIDDEN, D),
                p + "moe.up_proj.weight": (EXPERTS, EXPERT_HIDDEN, D),
                p + "moe.down_proj.weight": (EXPERTS, D, EXPERT_HIDDEN),
                p + "share_expert.gate_proj.weight": (SHARED_HIDDEN, D),
                p + "share_expert.up_proj.weight": (SHARED_HIDDEN, D),
                p + "share_expert.down_proj.weight": (D, SHARED_HIDDEN),
            })
        else:
            shapes.update({p + "mlp.gate_proj.weight": (DENSE_HIDDEN, D),
                           p + "mlp.up_proj.weight": (DENSE_HIDDEN, D),
                           p + "mlp.down_proj.weight": (D, DENSE_HIDDEN)})

    for i in range(LAYERS):
        block(i, i in MOE_LAYERS)
    for i in range(LAYERS, LAYERS + MTP_HEADS):
        block(i, False)
        p = f"model.layers.{i}."
        shapes.update({p + "enorm.weight": (D,), p + "hnorm.weight": (D,),
                       p + "eh_proj.weight": (D, 2 * D),
                       p + "transformer.shared_head.norm.weight": (D,),
                       p + "transformer.shared_head.output.weight": (VOCAB, D)})
    shapes.update({"model.norm.weight": (D,), "lm_head.weight": (VOCAB, D)})
    return shapes


def random_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """bfloat16 weights (norm offsets small), float32 router biases, as released."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes().items():
        scale = 0.1 if "norm" in name else 0.3
        value = rng.standard_normal(shape) * scale
        tensors[name] = (value.astype(np.float32) if name.endswith("router_bias")
                         else value.astype(ml_dtypes.bfloat16))
    return tensors


def write_hf_dir(path: Path, tensors: dict[str, np.ndarray], config: dict = HF_CONFIG) -> Path:
    """Two shards + index; the scanned layers 1-3 straddle them (layer 3 in the second)."""
    path.mkdir(parents=True, exist_ok=True)
    first = {n for n in tensors if n.startswith(("model.embed", "model.layers.0.",
                                                 "model.layers.1.", "model.layers.2."))}
    files = {"model-00001-of-00002.safetensors": first,
             "model-00002-of-00002.safetensors": set(tensors) - first}
    for file, names in files.items():
        save_file({n: tensors[n] for n in sorted(names)}, path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, names in files.items() for n in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def read_dir(path: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def assert_same_tensors(expected: dict, got: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert (got[name].dtype, got[name].shape) == (want.dtype, want.shape), name
        assert got[name].tobytes() == want.tobytes(), name  # bit-exact, bfloat16 included


def assert_same_variables(expected: dict, got: dict) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                            jax.tree.leaves(got)):
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def reference_variables(t: dict[str, np.ndarray]) -> dict:
    """Our variables placed by hand from the HF tensors, in the per-layer layout
    (scan_layers=False): kernels are [in, out], attention heads are head-major blocks of
    HEAD_DIM rows of q/k/v_proj, experts [E, out, in] -> [E, in, out]."""

    def w(name):
        return np.asarray(t[name], np.float32)

    def norm(name):
        return {"weight": w(name)}

    def dense(name):
        return {"kernel": w(name).T}

    def block(i):
        p, h = f"model.layers.{i}.", heads(i)
        layer = {
            "input_layernorm": norm(p + "input_layernorm.weight"),
            "post_attention_layernorm": norm(p + "post_attention_layernorm.weight"),
            "self_attn": {
                "q_proj": {"kernel": w(p + "self_attn.q_proj.weight").T.reshape(D, h, HEAD_DIM)},
                "k_proj": {"kernel": w(p + "self_attn.k_proj.weight").T.reshape(D, KV, HEAD_DIM)},
                "v_proj": {"kernel": w(p + "self_attn.v_proj.weight").T.reshape(D, KV, HEAD_DIM)},
                "o_proj": {"kernel": w(p + "self_attn.o_proj.weight").T.reshape(h, HEAD_DIM, D)},
                "g_proj": dense(p + "self_attn.g_proj.weight"),
                "q_norm": norm(p + "self_attn.q_norm.weight"),
                "k_norm": norm(p + "self_attn.k_norm.weight"),
            },
        }
        if i in MOE_LAYERS:
            layer["moe"] = {
                "router": w(p + "moe.gate.weight").T,
                "gate_proj": w(p + "moe.gate_proj.weight").transpose(0, 2, 1),
                "up_proj": w(p + "moe.up_proj.weight").transpose(0, 2, 1),
                "down_proj": w(p + "moe.down_proj.weight").transpose(0, 2, 1),
                "shared_expert": {k: dense(f"{p}share_expert.{k}.weight")
                                  for k in ("gate_proj", "up_proj", "down_proj")},
            }
        else:
            layer["mlp"] = {k: dense(f"{p}mlp.{k}.weight")
                            for k in ("gate_proj", "up_proj", "down_proj")}
        return layer

    params = {
        "embed_tokens": {"embedding": w("model.embed_tokens.weight")},
        "layers": {f"layer_{i}": block(i) for i in range(LAYERS)},
        "norm": norm("model.norm.weight"),
        "lm_head": dense("lm_head.weight"),
    }
    for h in range(MTP_HEADS):
        p = f"model.layers.{LAYERS + h}."
        params[f"mtp_{h}"] = {
            "enorm": norm(p + "enorm.weight"), "hnorm": norm(p + "hnorm.weight"),
            "eh_proj": dense(p + "eh_proj.weight"), "block": block(LAYERS + h),
            "norm": norm(p + "transformer.shared_head.norm.weight"),
            "output_head": dense(p + "transformer.shared_head.output.weight"),
        }
    balance = {"layers": {
        f"layer_{i}": {"moe": {"router_bias": w(f"model.layers.{i}.moe.router_bias")}}
        for i in MOE_LAYERS}}
    return {"params": params, "balance": balance}


def architecture(cfg) -> dict:
    values = config_to_dict(cfg)
    for name in RUNTIME_FIELDS:
        values.pop(name)
    for name in ("num_ep_groups", "block_size"):
        values["moe"].pop(name)
    values["mtp"].pop("share_output_head")
    return values


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> tuple[Path, dict]:
    tensors = random_tensors()
    return write_hf_dir(tmp_path_factory.mktemp("hf"), tensors), tensors


@pytest.fixture(scope="module")
def imported(hf_source):
    return load_hf_checkpoint(hf_source[0], progress=False)


# ---- config.json ---------------------------------------------------------------------------------


def test_config_json_maps_to_the_model_config_and_back():
    assert architecture(config_from_hf(HF_CONFIG)) == architecture(CFG)
    assert architecture(config_from_hf(config_to_hf(CFG))) == architecture(CFG)
    exported = config_to_hf(CFG)
    for key in set(HF_CONFIG) - {"max_position_embeddings", "torch_dtype", "bos_token_id"}:
        assert exported[key] == HF_CONFIG[key], key


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"rope_theta": [5e5, 1e4, 2e4, 1e4, 5e5, 1e4, 1e4, 1e4]}, "rope_theta"),
    ({"partial_rotary_factors": [0.5, 1.0, 1.0]}, "partial_rotary_factors"),
    ({"layer_types": HF_CONFIG["layer_types"][:5] + ["full_attention"] * 3}, "layer_types"),
    ({"swiglu_limits_shared": [0, 0, 0, 0, 16.0, 7.0, 0, 0]}, "swiglu_limits_shared"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"yarn_only_types": None}, "yarn_only_types"),
    ({"sink": True}, "sink"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"moe_layers_enum": "1,2,9"}, "moe_layers_enum"),
    ({"attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 4}},
     "attention_other_setting.num_attention_groups"),
])
def test_unsupported_config_values_are_named(change, field):
    with pytest.raises(CheckpointFormatError) as err:
        config_from_hf({**HF_CONFIG, **change})
    message = str(err.value)
    assert message.startswith(f"{field}:") and "\n" not in message


# ---- tensors -------------------------------------------------------------------------------------


def test_import_then_export_is_tensor_exact(hf_source, imported, tmp_path):
    hf_dir, _ = hf_source
    config, variables = imported
    save_hf_checkpoint(config, variables, tmp_path / "out", dtype="bfloat16",
                       max_shard_bytes=40_000, progress=False)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert_same_tensors(read_dir(hf_dir), read_dir(tmp_path / "out"))


def test_single_file_export_reimports_identically(imported, tmp_path):
    config, variables = imported
    save_hf_checkpoint(config, variables, tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json",
                                                                   "model.safetensors"]
    again, reread = load_hf_checkpoint(tmp_path / "out", progress=False)
    assert again == config
    assert_same_variables(variables, reread)


def test_imported_weights_give_the_hand_placed_model(hf_source, imported):
    _, tensors = hf_source
    config, variables = imported
    reference = reference_variables(tensors)
    assert_same_variables(convert_layer_layout(reference, config, to_scan=True), variables)

    forward = jax.jit(lambda v, x: (lambda out: (out.logits, out.mtp_logits))(
        CausalLM(config).apply(v, x)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 16)), jnp.int32)
    logits, mtp_logits = forward(variables, tokens)
    want_logits, want_mtp = forward(convert_layer_layout(reference, config, to_scan=True), tokens)
    np.testing.assert_array_equal(logits, want_logits)
    for got, want in zip(mtp_logits, want_mtp, strict=True):
        np.testing.assert_array_equal(got, want)
    # The comparison is sensitive to the layout: q_proj of layer 1 read without the transpose
    # (a plain reshape of [H*D, d]) changes the logits.
    wrong = reference_variables(tensors)
    q = tensors["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    wrong["params"]["layers"]["layer_1"]["self_attn"]["q_proj"]["kernel"] = q.reshape(
        D, 6, HEAD_DIM)
    wrong_logits, _ = forward(convert_layer_layout(wrong, config, to_scan=True), tokens)
    assert np.max(np.abs(np.asarray(wrong_logits) - np.asarray(logits))) > 1e-3


def test_model_variants_export_the_same_network(tmp_path):
    """Tied embeddings, MTP heads sharing the output head, no attention gate, no router bias,
    two shared experts and per-layer (unscanned) params: the re-import has the same weights,
    with the shared output head written out per MTP layer."""
    config = CFG.replace(tie_embeddings=True, gate="none", scan_layers=False,
                         mtp=MTPConfig(num_heads=2, share_output_head=True),
                         moe=dataclasses.replace(CFG.moe, router_bias=False, num_shared_experts=2))
    rng = np.random.default_rng(2)
    variables = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32),
                             nn.meta.unbox(abstract_variables(config)))
    save_hf_checkpoint(config, variables, tmp_path / "hf", progress=False)
    again, reread = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert (again.moe.num_shared_experts, again.moe.shared_hidden) == (1, 2 * SHARED_HIDDEN)
    assert (again.tie_embeddings, again.gate, again.mtp.share_output_head) == (True, "none", False)
    expected = convert_layer_layout(variables, again, to_scan=True)
    for h in range(2):
        expected["params"][f"mtp_{h}"]["output_head"] = {
            "kernel": variables["params"]["embed_tokens"]["embedding"].T}
    assert_same_variables(expected, reread)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({"model.layers.3.moe.gate.weight": np.zeros((8, 16), np.float32)}),
     "model.layers.3.moe.gate.weight: expected [8, 32], found [8, 16]"),
    (lambda t: t.pop("model.layers.2.self_attn.g_proj.weight"),
     "missing tensor: model.layers.2.self_attn.g_proj.weight"),
    (lambda t: t.update({"model.layers.2.self_attn.extra.weight": np.zeros((2,), np.float32)}),
     "unknown tensor (no stepjax variable): model.layers.2.self_attn.extra.weight"),
    (lambda t: t.update({"model.norm.weight": np.zeros((D,), np.int32)}),
     "model.norm.weight: dtype I32 is not supported"),
])
def test_bad_tensors_are_named(hf_source, tmp_path, change, message):
    tensors = dict(hf_source[1])
    change(tensors)
    with pytest.raises(CheckpointFormatError) as err:
        load_hf_checkpoint(write_hf_dir(tmp_path / "hf", tensors), progress=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_export_never_writes_into_a_non_empty_directory(imported, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="not empty"):
        save_hf_checkpoint(*imported, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left behind


# ---- command line -------------------------------------------------------------------------------


def test_cli_help():
    result = subprocess.run([sys.executable, "-m", "model.hf", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "import" in result.stdout and "export" in result.stdout


def test_cli_import_then_export_round_trips(hf_source, tmp_path):
    hf_dir, _ = hf_source
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "model")]) == 0
    assert main(["export", str(tmp_path / "model"), "--out", str(tmp_path / "hf"),
                 "--dtype", "bfloat16"]) == 0
    assert_same_tensors(read_dir(hf_dir), read_dir(tmp_path / "hf"))


def test_cli_bad_input_is_one_line_and_writes_nothing(hf_source, tmp_path, capsys):
    assert main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nowhere" in err and err.count("\n") == 1
    assert not (tmp_path / "model").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("keep")
    assert main(["import", str(hf_source[0]), "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "not empty" in err and err.count("\n") == 1
    assert [p.name for p in taken.iterdir()] == ["x"]


# ---- model.weights.load_model --------------------------------------------------------------------


def make_workdir(path: Path, config, variables) -> Path:
    """A `python -m train` workdir with one checkpoint whose state holds `variables` (built with
    the trainer's Checkpointer and TrainState; no training step is needed)."""
    from model.interop.workdir import Checkpointer
    from train.config import run_config_from_dict
    from train.state import TrainState, build_training

    run = run_config_from_dict({"model": config_to_dict(config)})
    params = variables["params"]
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(step=jnp.int32(3), params=params, balance=variables["balance"],
                       opt_state=build_training(run).optimizer.init(params),
                       rng=jax.random.key_data(jax.random.key(0)), skipped=zero,
                       consecutive_skips=zero)
    checkpoints = Checkpointer(path / "checkpoints", keep=2)
    checkpoints.save(3, state, {}, run.to_dict())
    checkpoints.close()
    return path


def test_load_model_reads_every_kind_of_directory(hf_source, imported, tmp_path):
    config, variables = imported
    save_model_dir(config, variables, tmp_path / "model")
    workdir = make_workdir(tmp_path / "run", config, variables)
    for source in (hf_source[0], tmp_path / "model", workdir):
        got_config, got = load_model(source)
        assert got_config == config, source
        assert_same_variables(variables, got)


def test_load_model_with_a_mesh_places_the_training_shardings(tmp_path, imported):
    from train.config import MeshConfig
    from train.parallel.sharding import make_mesh

    config, variables = imported
    save_model_dir(config, variables, tmp_path / "model")
    mesh = make_mesh(MeshConfig())
    _, got = load_model(tmp_path / "model", mesh)
    assert_same_variables(variables, got)
    assert all(isinstance(a.sharding, jax.sharding.NamedSharding) for a in jax.tree.leaves(got))


@pytest.mark.parametrize("make, problem", [
    (lambda p: p / "absent", "does not exist"),
    (lambda p: p, "is not a model directory"),
])
def test_load_model_rejects_other_paths(tmp_path, make, problem):
    with pytest.raises(ValueError) as err:
        load_model(make(tmp_path))
    assert problem in str(err.value) and "\n" not in str(err.value)


SHARDED_WORKER = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
import jax
from test_hf import assert_same_variables
from model.interop.hf import load_hf_checkpoint
from model.weights import load_model, save_model_dir
from train.config import MeshConfig
from train.parallel.sharding import make_mesh

reference = load_hf_checkpoint({hf!r}, progress=False)[1]
mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
config, variables = load_hf_checkpoint({hf!r}, mesh, progress=False)
assert_same_variables(reference, variables)
experts = variables["params"]["layers"]["segment_1"]["block_0"]["moe"]["gate_proj"]
assert experts.sharding.spec[1] == "expert" and experts.addressable_shards[0].data.shape[1] == 4
save_model_dir(config, variables, Path({out!r}))
assert_same_variables(reference, load_model({out!r}, mesh)[1])
print("sharded ok")
"""


@pytest.mark.slow
def test_sharded_import_on_eight_devices(hf_source, tmp_path):
    """With a mesh, every variable is placed in its training sharding (experts split over the
    `expert` axis) and holds the same values; the model directory restores into it too."""
    script = SHARDED_WORKER.format(repo=str(REPO), tests=str(REPO / "tests"),
                                   hf=str(hf_source[0]), out=str(tmp_path / "model"))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0 and "sharded ok" in result.stdout, result.stderr[-3000:]
