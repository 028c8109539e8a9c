"""The hand-written Hugging Face Step 3.5 checkpoint shared by tests/model/test_hf_*.py and
test_load_model.py: the test-size model config (`CFG`, configs/tiny.yaml with overrides) and its
config.json (`HF_CONFIG`), the table of tensor names and torch shapes, a writer of a two-shard
HF directory from it, the bit-exact comparison helpers, and `refusal_before_reads` (every HF
family's bad-checkpoint tests).

The table and config.json follow the published format (vLLM `step3p5.py` / `step3p5_mtp.py`),
never the exporter under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from model.config import load_config

REPO = Path(__file__).resolve().parents[1]

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


def refusal_before_reads(path: Path, monkeypatch, reading_modules=()) -> str:
    """The one-line error `load_hf_checkpoint(path)` refuses with while every tensor-data read
    fails the test (`read_tensors` of model.interop.hf_stream, `read_tensor` of each module in
    `reading_modules`): the checks must name the problem from the headers alone."""
    from model.interop import hf, hf_stream
    from model.interop.safetensors_io import CheckpointFormatError

    def no_reads(*args, **kwargs):
        raise AssertionError("tensor data read before the checks")

    monkeypatch.setattr(hf_stream, "read_tensors", no_reads)
    for module in reading_modules:
        monkeypatch.setattr(module, "read_tensor", no_reads)
    try:
        hf.load_hf_checkpoint(path, progress=False)
    except CheckpointFormatError as err:
        message = str(err)
    else:
        raise AssertionError(f"{path} was imported, expected a refusal")
    assert "\n" not in message, message
    return message
