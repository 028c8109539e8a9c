"""Tests of quantized Hugging Face releases (`model.interop.quantized`, through
`load_hf_checkpoint`): FP8 block-wise weights (float32 or e8m0 scales, `weight_scale_inv` or
DeepSeek-V4's `.scale` names) and DeepSeek-V4's MXFP4 experts, for every family.

The quantized tensors are random bit patterns written by the test; the values they stand for are
decoded here by formula (e4m3: sign, 4-bit exponent with bias 7, 3-bit mantissa, subnormals at
exponent 0; e2m1 nibbles by the table {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign bit; e8m0 scales
2^(e - 127)), never by the code under test. A quantized import must equal the import of an
unquantized checkpoint holding those values, bit for bit.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import test_hf_deepseek_v4 as v4
import test_hf_mimo_v2_flash as mimo
from hf_step3p5_checkpoint import (
    HF_CONFIG,
    VOCAB,
    assert_same_variables,
    random_tensors,
    refusal_before_reads,
    write_hf_dir,
)
from safetensors.numpy import save_file

import model.interop.hf as hf
import model.interop.quantized as quantized
from model.hf import main
from model.interop.safetensors_io import CheckpointFormatError
from model.lm import CausalLM
from model.weights import load_model

BLOCK = (16, 12)  # partial last blocks along both axes of the test's [.., 16|24|32|48|64] weights
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def e4m3_values(bits: np.ndarray) -> np.ndarray:
    sign = np.where(bits >> 7, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = 2.0 ** (exponent.astype(np.float64) - 7) * (1 + mantissa / 8)
    subnormal = 2.0 ** -6 * (mantissa / 8)
    return sign * np.where(exponent > 0, normal, subnormal)


def e2m1_values(packed: np.ndarray) -> np.ndarray:
    """Bytes of two nibbles, element 2j low, 2j + 1 high -> their values, twice as wide."""
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return np.where(nibbles & 0x8, -1.0, 1.0) * E2M1[nibbles & 0x7]


def blockwise(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """values[..., r, c] * scale[..., r // b0, c // b1], in float32 as the import computes."""
    rows, cols = values.shape[-2:]
    per_value = scale[..., np.arange(rows)[:, None] // block[0], np.arange(cols) // block[1]]
    return values.astype(np.float32) * per_value.astype(np.float32)


def fp8_bits(rng, shape) -> np.ndarray:
    """e4m3 patterns with exponents 0-9 (subnormals included, no NaN): values below 2^3."""
    exponent = rng.integers(0, 10, shape, dtype=np.uint8)
    return (rng.integers(0, 2, shape, dtype=np.uint8) << 7) | (exponent << 3) | rng.integers(
        0, 8, shape, dtype=np.uint8)


def scale_shape(shape, block) -> tuple:
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def quantize(tensors: dict, names, rng, *, scale_fmt: str, suffix: str, fp4=(),
             byte_scales=()) -> tuple[dict, dict]:
    """(quantized checkpoint tensors, the same with the values they stand for): the tensors in
    `names` become random FP8 bits (FP4 packed pairs for those in `fp4`) with random scales
    (e8m0 ones stored as U8 bytes for those in `byte_scales`, else as F8_E8M0)."""
    stored, plain = dict(tensors), dict(tensors)
    for name in names:
        shape, base = tensors[name].shape, name.removesuffix(".weight")
        if name in fp4:
            packed = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
            stored[name], values, block = packed.view(np.int8), e2m1_values(packed), (1, 32)
        else:
            bits = fp8_bits(rng, shape)
            stored[name], values = bits.view(ml_dtypes.float8_e4m3fn), e4m3_values(bits)
            block = BLOCK
        if scale_fmt == "float":
            scale = rng.uniform(0.01, 0.1, scale_shape(shape, block)).astype(np.float32)
            stored[f"{base}.{suffix}"] = scale
        else:
            exponent = rng.integers(120, 126, scale_shape(shape, block), dtype=np.uint8)
            scale = 2.0 ** (exponent.astype(np.float64) - 127)
            stored[f"{base}.{suffix}"] = (exponent if name in byte_scales
                                          else exponent.view(ml_dtypes.float8_e8m0fnu))
        plain[name] = blockwise(values, scale, block)
    return stored, plain


def fp8_config(**extra) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK), **extra}


def step3p5_case(rng):
    """Static activation scales too (`X.activation_scale`, dropped by the import)."""
    tensors = random_tensors()
    names = [n for n in tensors if n.endswith("proj.weight")]  # stacked experts [E, I, H] too
    stored, plain = quantize(tensors, names, rng, scale_fmt="float", suffix="weight_scale_inv")
    stored.update({f"{n.removesuffix('.weight')}.activation_scale": np.array(0.5, np.float32)
                   for n in names})
    return HF_CONFIG, {"quantization_config": fp8_config(activation_scheme="static")}, stored, plain


def mimo_case(rng):
    tensors = mimo.hf_tensors()
    names = [n for n in tensors if n.endswith("proj.weight") and not n.startswith("model.mtp")]
    return mimo.HF_CONFIG, {"quantization_config": fp8_config(
        modules_to_not_convert=["lm_head", "model.embed_tokens"])}, *quantize(
        tensors, names, rng, scale_fmt="float", suffix="weight_scale_inv")


def deepseek_v4_case(rng):
    """The release's layout: FP8 attention / shared experts with e8m0 scales (here as U8
    bytes), MXFP4 routed experts (F8_E8M0 scales), BF16 compressors, `.scale` names, and
    `expert_dtype` at config.json's top level."""
    tensors = v4.hf_tensors()
    experts = [n for n in tensors if ".ffn.experts." in n]
    dense = [n for n in tensors if n.endswith(("wq_a.weight", "wq_b.weight", "attn.wkv.weight",
                                               "wo_a.weight", "wo_b.weight"))
             or ".shared_experts." in n]
    return v4.HF_CONFIG, {"quantization_config": fp8_config(scale_fmt="ue8m0"),
                          "expert_dtype": "fp4"}, *quantize(
        tensors, dense + experts, rng, scale_fmt="ue8m0", suffix="scale", fp4=experts,
        byte_scales=dense)


CASES = {"step3p5": step3p5_case, "mimo_v2_flash": mimo_case, "deepseek_v4": deepseek_v4_case}


def write_scales_apart(path, tensors: dict, config: dict):
    """A checkpoint whose scales all sit in the last of three shards, after their weights'."""
    path.mkdir(parents=True)
    scales = {n for n in tensors if n.endswith(("_scale_inv", ".activation_scale"))}
    first = {n for n in set(tensors) - scales if n < "model.layers.3"}
    files = {"model-00001-of-00003.safetensors": first,
             "model-00002-of-00003.safetensors": set(tensors) - scales - first,
             "model-00003-of-00003.safetensors": scales}
    for file, names in files.items():
        save_file({n: tensors[n] for n in sorted(names)}, path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, names in files.items() for n in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def release(request, tmp_path_factory):
    """(family, quantized directory, unquantized directory of its values); the Step 3.5
    checkpoint keeps its scales in a shard of their own."""
    config, quant, stored, plain = CASES[request.param](np.random.default_rng(0))
    root = tmp_path_factory.mktemp(request.param)
    write = write_scales_apart if request.param == "step3p5" else write_hf_dir
    return (request.param, write(root / "fp8", stored, {**config, **quant}),
            write_hf_dir(root / "plain", plain, config))


@pytest.fixture(scope="module")
def imported(release):
    """(ModelConfig, variables) of the quantized directory, as `load_hf_checkpoint` gives them."""
    return hf.load_hf_checkpoint(release[1], progress=False)


@pytest.mark.slow
def test_a_quantized_release_imports_as_its_dequantized_values(release, imported):
    family, _, plain_dir = release
    config, variables = imported
    want_config, want = hf.load_hf_checkpoint(plain_dir, progress=False)
    assert config == want_config
    assert_same_variables(want, variables)
    if family == "step3p5":  # the same network: identical logits
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (1, 12)), jnp.int32)
        forward = jax.jit(lambda v: CausalLM(config).apply(v, tokens).logits)
        np.testing.assert_array_equal(forward(variables), forward(want))


@pytest.mark.slow
def test_the_cli_import_dequantizes_into_the_param_dtype(release, tmp_path):
    """`python -m model.hf import --param-dtype bfloat16`: float32 values rounded once."""
    _, quantized_dir, plain_dir = release
    assert main(["import", str(quantized_dir), "--out", str(tmp_path / "model"),
                 "--param-dtype", "bfloat16"]) == 0
    _, variables = load_model(tmp_path / "model")
    _, want = hf.load_hf_checkpoint(plain_dir, param_dtype="bfloat16", progress=False)
    assert_same_variables(want, variables)


def test_exports_of_a_quantized_import_are_unquantized(imported, tmp_path):
    config, variables = imported
    hf.save_hf_checkpoint(config, variables, tmp_path / "out", progress=False)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in written
    assert_same_variables(variables, hf.load_hf_checkpoint(tmp_path / "out", progress=False)[1])


def test_every_e4m3_pattern_and_e2m1_nibble_decodes_by_formula():
    bits = np.arange(256, dtype=np.uint8)
    bits = bits[(bits & 0x7F) != 0x7F].reshape(2, 127)  # every pattern but the two NaNs
    scale = np.array([[0.5]], np.float32)
    got = quantized.dequantize_tensor(bits.view(ml_dtypes.float8_e4m3fn), scale, (2, 127), False)
    np.testing.assert_array_equal(got, e4m3_values(bits) * 0.5)
    packed = np.arange(256, dtype=np.uint8).reshape(4, 64)  # every nibble pair
    exponents = np.array([[0], [1], [127], [200]], np.uint8).repeat(4, axis=1)
    got = quantized.dequantize_tensor(packed.view(np.int8), exponents, (1, 32), True)
    np.testing.assert_array_equal(
        got, blockwise(e2m1_values(packed), 2.0 ** (exponents.astype(np.float64) - 127), (1, 32)))


# ---- refusals: one line, named, before any tensor data is read --------------------------------

Q = "model.layers.0.self_attn.q_proj.weight"
SCALE = f"{Q}_scale_inv"
EXPERT = "model.layers.2.ffn.experts.1.w1"


@pytest.mark.parametrize("family, change, message", [
    ("step3p5", lambda t, c: t.pop(SCALE),
     f"{Q}: quantized (F8_E4M3) but its scale {Q[:-7]}.weight_scale_inv (or "
     f"{Q[:-7]}.scale) is missing"),
    ("step3p5", lambda t, c: t.update({SCALE: np.ones((2, 2), np.float32)}),
     f"{SCALE}: expected [2, 3], found [2, 2] (one scale per 16x12 block of {Q}, [32, 32] values)"),
    ("step3p5", lambda t, c: t.update({SCALE: np.ones((2, 3), np.uint8)}),
     f"{SCALE}: dtype U8, but scale_fmt 'float' stores F32"),
    ("step3p5", lambda t, c: t.update({"model.layers.0.mlp.gate_proj.weight_scale_inv":
                                       t.pop("model.layers.0.mlp.gate_proj.weight_scale_inv"),
                                       "model.layers.0.mlp.gate_proj.weight": np.zeros(
                                           (64, 32), ml_dtypes.bfloat16)}),
     "model.layers.0.mlp.gate_proj.weight_scale_inv: a scale, but "
     "model.layers.0.mlp.gate_proj.weight is not a quantized tensor (BF16)"),
    ("step3p5", lambda t, c: c["quantization_config"].pop("weight_block_size"),  # 128 x 128
     "_scale_inv: expected [1, 1], found "),  # blocks of 128 x 128 cover the whole tensor
    ("step3p5", lambda t, c: c.pop("quantization_config"),
     ".weight: dtype F8_E4M3 is not supported without a quantization_config in config.json"),
    ("deepseek_v4", lambda t, c: t.update({f"{EXPERT}.scale": np.ones((16, 2), np.uint8)}),
     f"{EXPERT}.scale: expected [16, 1], found [16, 2] (one scale per 1x32 block of "
     f"{EXPERT}.weight, [16, 32] values)"),
    ("deepseek_v4", lambda t, c: c.pop("expert_dtype"),
     ".weight: I8 with a scale (packed FP4), but config.json does not give expert_dtype 'fp4'"),
    ("deepseek_v4", lambda t, c: t.update({f"{EXPERT}.weight_scale_inv": t[f"{EXPERT}.scale"]}),
     f"{EXPERT}.weight: quantized (I8) but it has two scales, {EXPERT}.weight_scale_inv and "
     f"{EXPERT}.scale"),
])
def test_bad_quantized_tensors_are_named_before_any_data_is_read(
        family, change, message, tmp_path, monkeypatch):
    config, quant, stored, _ = CASES[family](np.random.default_rng(0))
    config = {**config, **quant}
    change(stored, config)
    path = write_hf_dir(tmp_path / "hf", stored, config)

    assert message in refusal_before_reads(path, monkeypatch, (quantized,))


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "awq"}, "quantization_config.quant_method: 'awq' is not supported"),
    ({"quant_method": "mxfp4"}, "quantization_config.quant_method: 'mxfp4' is not supported"),
    ({"fmt": "e5m2"}, "quantization_config.fmt: 'e5m2' is not supported"),
    ({"weight_block_size": None}, "quantization_config.weight_block_size: None is not supported"),
    ({"weight_block_size": [128]}, "quantization_config.weight_block_size: [128] is not"),
    ({"scale_fmt": "ue4m3"}, "quantization_config.scale_fmt: 'ue4m3' is not supported"),
    ({"expert_dtype": "int4"}, "quantization_config.expert_dtype: 'int4' is not supported"),
    ({"modules_to_convert": ["embed_tokens"]}, "quantization_config.modules_to_convert: "),
    ({"bits": 4}, "quantization_config.bits: unknown key"),
])
def test_unknown_quantization_layouts_are_refused_by_key(change, message, tmp_path, capsys):
    config = {**HF_CONFIG, "quantization_config": fp8_config(**change)}
    path = write_hf_dir(tmp_path / "hf", random_tensors(), config)
    with pytest.raises(CheckpointFormatError) as err:
        hf.load_hf_checkpoint(path, progress=False)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert main(["import", str(path), "--out", str(tmp_path / "model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("family, scale, value", [
    ("step3p5", "model.layers.1.self_attn.q_proj.weight_scale_inv", np.nan),  # float32 scales
    ("step3p5", "model.layers.1.self_attn.q_proj.weight_scale_inv", -np.inf),
    ("deepseek_v4", "model.layers.1.attn.wq_a.scale", 255),  # e8m0 byte 0xFF: NaN
])
def test_non_finite_scales_are_refused_naming_them(family, scale, value, tmp_path, capsys):
    """A NaN or infinite scale makes its whole block NaN: refused, naming the scale, with
    nothing written (an import would otherwise succeed and generate empty text)."""
    config, quant, stored, _ = CASES[family](np.random.default_rng(0))
    bad = stored[scale].copy()
    bad.reshape(-1).view(np.uint8 if bad.dtype == np.uint8 else bad.dtype)[0] = value
    stored[scale] = bad
    path = write_hf_dir(tmp_path / "hf", stored, {**config, **quant})
    assert main(["import", str(path), "--out", str(tmp_path / "model")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    weight = scale.removesuffix("_scale_inv").removesuffix(".scale") + (
        "" if scale.endswith("_scale_inv") else ".weight")
    assert error.startswith(f"error: {scale} (in model-0000") and (
        f"1 of {bad.size} scales are NaN or infinite, so {weight} would be; the checkpoint is "
        "damaged") in error, error
    assert not (tmp_path / "model").exists()
