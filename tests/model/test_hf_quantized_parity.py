"""External cross-check of the dequantization (`model.interop.quantized`) against transformers'
own: its fine-grained FP8 loader's `Fp8Dequantize` (the op `from_pretrained(...,
quantization_config=FineGrainedFP8Config(dequantize=True))` runs on every quantized weight), on
FP8 block-wise weights with float32 or e8m0 scales and on packed MXFP4 expert weights. That op
takes the block size from the scale grid, so the shapes here are whole blocks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from model.interop.quantized import dequantize_tensor

pytestmark = pytest.mark.parity


def transformers_dequantize(weight, scale) -> np.ndarray:
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensor = torch.from_numpy(weight.view(np.uint8).copy())
    tensor = tensor.view(torch.int8) if weight.dtype == np.int8 else tensor.view(
        torch.float8_e4m3fn)
    scales = torch.from_numpy(scale.view(np.uint8).copy() if scale.dtype != np.float32
                              else scale.copy())
    if scale.dtype == ml_dtypes.float8_e8m0fnu:
        scales = scales.view(torch.float8_e8m0fnu)
    return Fp8Dequantize(None)._dequantize_one(tensor, scales, torch.float32).numpy()


@pytest.mark.parametrize("scale_kind", ["float32", "e8m0", "e8m0 bytes"])
def test_fp8_blockwise_matches_transformers(scale_kind):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (3, 32, 48), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # no NaN patterns
    exponents = rng.integers(110, 135, (3, 2, 4), dtype=np.uint8)
    scale = {"float32": rng.uniform(0.01, 2, (3, 2, 4)).astype(np.float32),
             "e8m0": exponents.view(ml_dtypes.float8_e8m0fnu), "e8m0 bytes": exponents}[scale_kind]
    weight = bits.view(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(dequantize_tensor(weight, scale, (16, 12), False),
                                  transformers_dequantize(weight, scale))


def test_mxfp4_experts_match_transformers():
    rng = np.random.default_rng(1)
    packed = rng.integers(-128, 128, (2, 16, 32), dtype=np.int8)  # [E, out, in / 2]
    scale = rng.integers(118, 130, (2, 16, 2), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(dequantize_tensor(packed, scale, (1, 32), True),
                                  transformers_dequantize(packed, scale))
