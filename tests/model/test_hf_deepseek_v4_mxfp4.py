"""FP4 quantization-aware training and DeepSeek-V4's MXFP4 release layout together
(`qat.expert_weights: mxfp4`, `save_hf_checkpoint(..., expert_dtype="fp4", names="release")`):
the exported routed experts, decoded here from their bytes by formula (E2M1 nibbles, element 2j
low; E8M0 exponent bytes), are the float64 reference's MXFP4 of the master weights; the export
imports back to exactly those values; and the model computing with QAT on its float32 masters
gives the logits (MTP head included) of the imported, unquantized model.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_hf_deepseek_v4 as v4
from test_hf_quantized import blockwise, e2m1_values
from test_mx_quant import mxfp4_reference, mxfp4_values

import model.interop.hf as hf
from model.interop import deepseek_v4
from model.config import QATConfig
from model.lm import CausalLM


def raw_tensors(path) -> dict[str, tuple[str, list, np.ndarray]]:
    """{name: (safetensors dtype, shape, bytes: [shape] for 1-byte dtypes, else flat)} of every
    shard, parsed by hand."""
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        data = file.read_bytes()
        size = int.from_bytes(data[:8], "little")
        for name, info in json.loads(data[8:8 + size]).items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                raw = np.frombuffer(data[8 + size + begin:8 + size + end], np.uint8)
                one_byte = raw.size == np.prod(info["shape"], dtype=int)
                found[name] = (info["dtype"], info["shape"],
                               raw.reshape(info["shape"]) if one_byte else raw)
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(config, variables, the tensors imported, the export's directory): the hand-written
    checkpoint of test_hf_deepseek_v4 (MTP layer included), exported in the release layout."""
    root = tmp_path_factory.mktemp("mxfp4")
    tensors = v4.hf_tensors()
    config, variables = hf.load_hf_checkpoint(v4.write_hf_dir(root / "hf", tensors,
                                                              v4.HF_CONFIG), progress=False)
    hf.save_hf_checkpoint(config, variables, root / "out", dtype="bfloat16", names="release",
                          expert_dtype="fp4", progress=False)
    return config, variables, tensors, root / "out"


def test_the_experts_are_written_as_the_mxfp4_of_their_masters(exported):
    _, _, tensors, out = exported
    written = json.loads((out / "config.json").read_text())
    assert written["expert_dtype"] == "fp4"
    assert written["quantization_config"]["scale_fmt"] == "ue8m0"
    stored = raw_tensors(out)
    experts = [n for n in tensors if ".ffn.experts." in n]
    assert any(n.startswith("mtp.0.") for n in experts)
    for name in experts:
        release = deepseek_v4.release_name(name)
        (dtype, shape, packed), (scale_dtype, _, exponent) = (
            stored[release], stored[release.removesuffix("weight") + "scale"])
        master = np.asarray(tensors[name], np.float32)  # [out, in]
        assert (dtype, shape, scale_dtype) == ("I8", [master.shape[0], master.shape[1] // 2],
                                               "F8_E8M0")
        decoded = blockwise(e2m1_values(packed), 2.0 ** (exponent.astype(np.float64) - 127),
                            (1, 32))
        np.testing.assert_array_equal(exponent.astype(np.int32) - 127, mxfp4_reference(master)[1])
        np.testing.assert_array_equal(decoded, mxfp4_values(master), name)
    # the other tensors: bfloat16 under the release's names, as without expert_dtype
    dtype, _, raw = stored["layers.1.attn.wq_a.weight"]
    assert dtype == "BF16" and raw.tobytes() == tensors["model.layers.1.attn.wq_a.weight"].tobytes()


def test_qat_computes_what_the_imported_mxfp4_export_computes(exported):
    """The import dequantizes the experts (model/interop/quantized.py); the other weights are
    bfloat16 in both. QAT's FP8 tiles are exact for these weights (one scale of magnitude)."""
    config, variables, _, out = exported
    imported_config, imported = hf.load_hf_checkpoint(out, progress=False)
    assert imported_config == config
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, v4.VOCAB, (2, 16)), jnp.int32)

    def forward(cfg, v):
        result = CausalLM(cfg).apply(v, tokens)
        return result.logits, result.mtp_logits

    qat = config.replace(qat=QATConfig(expert_weights="mxfp4"))
    plain = jax.jit(lambda v: forward(config, v))
    want, want_mtp = jax.jit(lambda v: forward(qat, v))(variables)
    got, got_mtp = plain(imported)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_mtp[0], want_mtp[0], rtol=1e-6, atol=1e-6)
    # and QAT does change the network: its logits are not the float masters'
    assert np.max(np.abs(np.asarray(plain(variables)[0]) - np.asarray(want))) > 1e-3


@pytest.mark.parametrize("options, message", [
    (dict(names="release", model_type="step3p5"), "names: 'release' is DeepSeek-V4's"),
    (dict(expert_dtype="fp4", model_type="mimo_v2_flash"), "expert_dtype: 'fp4' (MXFP4 experts)"),
    (dict(expert_dtype="int4"), "expert_dtype: got 'int4'"),
])
def test_release_only_export_options_are_refused_for_other_families(options, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf.save_hf_checkpoint(v4.CFG, {}, tmp_path / "out", progress=False, **options)
    assert not (tmp_path / "out").exists()
