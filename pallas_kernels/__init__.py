"""Pallas kernels behind `attention_impl=pallas` and `moe_impl=pallas`.

Importing this package registers them with `model.attention_ops` / `model.moe_dispatch` (the
model imports it on first use of either switch). On CPU they run in interpret mode (slow, for
validation); see each module's docstring for the backends they lower to.
"""

from model.attention_ops import register_attention_impl
from model.moe_dispatch import register_moe_impl
from pallas_kernels.flash_attention import flash_attention_core
from pallas_kernels.moe import pallas_moe_ffn

register_attention_impl("pallas", flash_attention_core)
register_moe_impl("pallas", pallas_moe_ffn)
