"""Quantized Hugging Face releases, dequantized on import: the layouts transformers (>= 5.24)
reads with its fine-grained FP8 quantizer (`quantization_config.quant_method: fp8`).

- FP8 block-wise (DeepSeek-V3 style; the Step 3.5 Flash and MiMo-V2-Flash FP8 releases, the
  DeepSeek-V4 releases' non-expert weights): `X.weight` is float8_e4m3fn [..., out, in] and its
  scale `X.weight_scale_inv` (DeepSeek-V4's release names it `X.scale`, which transformers
  renames) holds one multiplier per block of `weight_block_size` [b0, b1]:
  [..., ceil(out / b0), ceil(in / b1)]; the last blocks of a row or column may be partial.
  Despite the name, weight = fp8 value * scale (transformers multiplies too).
- MXFP4 experts (DeepSeek-V4, `expert_dtype: fp4`, in quantization_config or, as V4 ships it,
  at config.json's top level): `X.weight` is int8 [..., out, in / 2], two float4_e2m1fn values
  per byte, element 2j in the low nibble and 2j + 1 in the high one; its scale has one
  multiplier per 32 values of a row: [..., out, ceil(in / 32)].
- Scales are float32 (`scale_fmt: float`, the default) or power-of-two float8_e8m0fnu, stored as
  F8_E8M0 or as raw U8 exponent bytes (`scale_fmt: ue8m0`, value 2^(byte - 127)).
Exports can write the routed experts in the MXFP4 layout (`mxfp4_pack`, the other weights
unquantized). Which tensors are quantized is read from their dtype in the shard headers;
unquantized ones (norms, embeddings, routers, modules_to_not_convert) pass through. Static
activation scales (`X.activation_scale`) are dropped: the dequantized model computes in full
precision, as transformers' `dequantize=True` does. Every check reads headers only; then each
weight is dequantized to float32 as it streams by, its scale read from its own bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

import jax
import ml_dtypes
import numpy as np

from model.interop.safetensors_io import CheckpointFormatError, TensorInfo, read_tensor
from model.ops.mx_quant import mxfp4_quantize

FP8, FP4 = "F8_E4M3", ("I8",)  # U8 is an e8m0 scale's storage, never a weight's
FP4_BLOCK = (1, 32)  # MX: one scale per 32 consecutive values of a row
SCALE_NAMES = ("weight_scale_inv", "scale")  # of X.weight: X.weight_scale_inv or X.scale
SCALE_DTYPES = {"float": ("F32",), "ue8m0": ("F8_E8M0", "U8")}
# quantization_config keys and the values stepjax reads (first: the default when absent).
_VALUES = {"quant_method": ("fp8",), "fmt": ("e4m3",),
           "activation_scheme": ("dynamic", "static"), "scale_fmt": tuple(SCALE_DTYPES),
           "expert_dtype": ("fp8", "fp4"), "dequantize": (False, True),
           "modules_to_convert": (None, [])}  # non-empty: quantized embeddings, not read
_FREE_KEYS = {"weight_block_size", "modules_to_not_convert", "ignored_layers"}


class Scheme(NamedTuple):
    """A release's quantization layout, from config.json."""

    block: tuple[int, int]  # weight_block_size of the FP8 tensors
    scale_fmt: str
    fp4_experts: bool


class Quantized(NamedTuple):
    """One quantized weight: its scale tensor and how its values are stored."""

    scale: str
    block: tuple[int, int]
    fp4: bool


def scheme_of(hf: Mapping[str, Any]) -> Scheme | None:
    """The layout of config.json `hf` (None: not quantized); a key or value outside the layouts
    above is refused by name."""
    config = hf.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise CheckpointFormatError(f"quantization_config: expected an object, got {config!r}")
    config = {"expert_dtype": hf.get("expert_dtype", "fp8"), **config}
    for key, value in config.items():
        if key in _VALUES and value not in _VALUES[key]:
            raise CheckpointFormatError(f"quantization_config.{key}: {value!r} is not supported "
                                        f"(stepjax reads {list(_VALUES[key])})")
        if key not in _VALUES and key not in _FREE_KEYS:
            raise CheckpointFormatError(f"quantization_config.{key}: unknown key (stepjax reads "
                                        f"{sorted({*_VALUES, *_FREE_KEYS})})")
    if "quant_method" not in config:
        raise CheckpointFormatError("quantization_config.quant_method: missing")
    block = config.get("weight_block_size", [128, 128])  # transformers' default
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointFormatError(f"quantization_config.weight_block_size: {block!r} is not "
                                    "supported (stepjax reads two positive block sizes)")
    return Scheme(tuple(block), config.get("scale_fmt", "float"),
                  config["expert_dtype"] == "fp4")


def plan(scheme: Scheme | None, headers: Mapping[str, TensorInfo]
         ) -> tuple[dict[str, TensorInfo], dict[str, Quantized]]:
    """(the headers as the dequantized tensors will be: float32 at their full shape, without
    the scales; {weight: Quantized}). Every quantized tensor must have its scale, of the right
    shape and dtype, and every `.weight_scale_inv` its quantized weight (errors name them)."""
    _refuse_unannounced(scheme, headers)
    if scheme is None:
        return dict(headers), {}
    table, quantized = dict(headers), {}
    # Sorted: the same bad tensor is named first whatever order the index lists them in.
    for name, tensor in sorted(headers.items()):
        if tensor.dtype == FP8 or (tensor.dtype in FP4 and scheme.fp4_experts):
            quantized[name], shape = _quantized(scheme, name, headers)
            table[name] = tensor._replace(dtype="F32", shape=shape)
            table.pop(quantized[name].scale)
            table.pop(f"{name.removesuffix('.weight')}.activation_scale", None)
    used = {q.scale for q in quantized.values()}
    for name in sorted(headers):
        if name.endswith(".weight_scale_inv") and name not in used:
            weight = name.removesuffix("_scale_inv")
            found = headers[weight].dtype if weight in headers else "absent"
            raise CheckpointFormatError(f"{name}: a scale, but {weight} is not a quantized "
                                        f"tensor ({found})")
    return table, quantized


def _refuse_unannounced(scheme: Scheme | None, headers: Mapping[str, TensorInfo]) -> None:
    """Quantized tensors the config does not announce: FP8 without quantization_config, packed
    FP4 (int8 with a scale) without expert_dtype fp4."""
    for name, tensor in sorted(headers.items()):
        base = name.removesuffix(".weight")
        if tensor.dtype == FP8 and scheme is None:
            raise CheckpointFormatError(f"{name}: dtype {FP8} is not supported without a "
                                        "quantization_config in config.json")
        if (tensor.dtype in FP4 and not (scheme and scheme.fp4_experts)
                and any(f"{base}.{s}" in headers for s in SCALE_NAMES)):
            raise CheckpointFormatError(f"{name}: {tensor.dtype} with a scale (packed FP4), but "
                                        "config.json does not give expert_dtype 'fp4'")


def _quantized(scheme: Scheme, name: str, headers: Mapping[str, TensorInfo]
               ) -> tuple[Quantized, tuple[int, ...]]:
    """(quantized weight `name`, the shape of its values), once its one scale has the shape
    and dtype its layout needs."""
    tensor, base = headers[name], name.removesuffix(".weight")
    if base == name or len(tensor.shape) < 2:
        raise CheckpointFormatError(f"{name}: {tensor.dtype} {list(tensor.shape)}, but only "
                                    "matrices named .weight are read quantized")
    scales = [f"{base}.{s}" for s in SCALE_NAMES if f"{base}.{s}" in headers]
    if len(scales) != 1:
        raise CheckpointFormatError(
            f"{name}: quantized ({tensor.dtype}) but " + (
                f"its scale {base}.{SCALE_NAMES[0]} (or {base}.{SCALE_NAMES[1]}) is missing"
                if not scales else f"it has two scales, {' and '.join(scales)}"))
    fp4 = tensor.dtype in FP4
    shape = (*tensor.shape[:-1], 2 * tensor.shape[-1]) if fp4 else tensor.shape
    block = FP4_BLOCK if fp4 else scheme.block
    want = [*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])]
    scale = headers[scales[0]]
    if list(scale.shape) != want:
        raise CheckpointFormatError(
            f"{scales[0]}: expected {want}, found {list(scale.shape)} (one scale per "
            f"{block[0]}x{block[1]} block of {name}, {list(shape)} values)")
    if scale.dtype not in SCALE_DTYPES[scheme.scale_fmt]:
        raise CheckpointFormatError(
            f"{scales[0]}: dtype {scale.dtype}, but scale_fmt {scheme.scale_fmt!r} stores "
            f"{'/'.join(SCALE_DTYPES[scheme.scale_fmt])}")
    return Quantized(scales[0], block, fp4), shape


def dequantize(stream: Iterator[tuple[str, np.ndarray]], path: Path,
               headers: Mapping[str, TensorInfo], quantized: Mapping[str, Quantized]
               ) -> Iterator[tuple[str, np.ndarray]]:
    """`stream` (name, array) with every quantized weight replaced by its float32 values."""
    for name, array in stream:
        if name in quantized:
            q = quantized[name]
            scale = read_tensor(path, headers[q.scale])
            bad = ~np.isfinite(scale.view(ml_dtypes.float8_e8m0fnu) if scale.dtype == np.uint8
                               else scale)
            if bad.any():  # every value of its blocks would be NaN
                raise CheckpointFormatError(
                    f"{q.scale} (in {headers[q.scale].file}): {int(bad.sum())} of {bad.size} "
                    f"scales are NaN or infinite, so {name} would be; the checkpoint is "
                    "damaged, download it again")
            array = dequantize_tensor(array, scale, q.block, q.fp4)
        yield name, array


def dequantize_tensor(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int],
                      fp4: bool) -> np.ndarray:
    """float32 values of `weight` (float8_e4m3fn, or int8 packed e2m1 pairs when
    `fp4`) times their block's `scale` (float32, float8_e8m0fnu or uint8 e8m0 exponents)."""
    if fp4:
        packed = weight.view(np.uint8)
        nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1)
        values = nibbles.reshape(*packed.shape[:-1], -1).view(ml_dtypes.float4_e2m1fn)
    else:
        values = weight
    values = values.astype(np.float32)
    if scale.dtype == np.uint8:
        scale = scale.view(ml_dtypes.float8_e8m0fnu)
    scale = scale.astype(np.float32)
    rows, cols = values.shape[-2:]
    # Expand the scales over rows only, and multiply whole column blocks through a view, so no
    # second weight-sized array is built (the last column block may be partial).
    scale = np.repeat(scale, block[0], axis=-2)[..., :rows, :]
    full = cols // block[1]
    head = values[..., :full * block[1]]
    head.shape = (*values.shape[:-1], full, block[1])  # a view (raises rather than copy)
    head *= scale[..., :full, None]
    if full * block[1] < cols:
        values[..., full * block[1]:] *= scale[..., full:]
    return values


# ---- export --------------------------------------------------------------------------------------

# config.json keys of an export whose routed experts are MXFP4 (the rest unquantized), as the
# DeepSeek-V4 release announces its experts: `expert_dtype` at the top level.
MXFP4_EXPORT_KEYS = {"expert_dtype": "fp4", "quantization_config": {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128]}}


_mxfp4_quantize = jax.jit(mxfp4_quantize)


def mxfp4_pack(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weight [..., out, in] (in even) -> (int8 [..., out, in / 2]: E2M1 pairs, element 2j in
    the low nibble; float8_e8m0fnu [..., out, ceil(in / 32)]): the release's MXFP4 layout, by
    the quantizer QAT trains with (model/ops/mx_quant.py), so `dequantize_tensor` gives back
    the values QAT computed with."""
    if weight.shape[-1] % 2:
        raise ValueError(f"MXFP4 packs pairs of values: a weight's input dimension must be even, "
                         f"got {weight.shape}")
    values, exponent = (np.asarray(a) for a in _mxfp4_quantize(weight))
    codes = values.view(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = (exponent + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return packed.view(np.int8), scale
