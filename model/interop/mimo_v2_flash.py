"""The MiMo-V2-Flash checkpoint family (`model_type: mimo_v2_flash`): config.json <-> ModelConfig
and the tensor-name table, as transformers (>= 5.24) `MiMoV2FlashForCausalLM` writes and reads
them (the config translation: model/interop/mimo_v2_flash_config.py).

Tensor names: `save_pretrained` reverts the load-time fusions and renamings of transformers'
`conversion_mapping.py` (the qwen2_moe expert mapping plus the sink's name), so the files hold
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, the SWA layers' sink
`.self_attn.attention_sink_bias`, a dense layer's `.mlp.{gate,up,down}_proj.weight`, an MoE
layer's router `.mlp.gate.weight` [E, d] with `.mlp.gate.e_score_correction_bias` and one
`.mlp.experts.{e}.{gate,up,down}_proj.weight` per expert, beside `model.embed_tokens.weight`,
`model.norm.weight` and `lm_head.weight` (absent with tied embeddings); that is the layout read
and written here (`MiMoV2FlashForCausalLM.from_pretrained` loads it).
- torch Linear weights are [out, in]: q/k_proj [heads * head_dim, d], v_proj
  [kv_heads * v_head_dim, d], o_proj [d, heads * v_head_dim] (head-major).
- Norm weights multiply (`weight * x`): stepjax keeps them as zero-centred offsets (1 + w), so
  they convert as weight = 1 + w (`tensor_names.Offset`).
- The sink is stepjax's per-head sink logit (`self_attn/sink`); `e_score_correction_bias` the
  selection-only loss-free bias (`router_bias`, the same sign).
- The router weight and its bias are float32 whatever the checkpoint dtype (transformers'
  `_keep_in_fp32_modules_strict`); exports write them so.
transformers does not instantiate the multi-token-prediction layers: it drops `model.mtp.*`
tensors on load and writes none, so imports skip them too and stepjax's `mtp.num_heads` is 0
both ways.
"""

from __future__ import annotations

from model.config import ModelConfig
from model.interop.mimo_v2_flash_config import (
    MODEL_TYPE,
    config_from_hf,
    config_to_hf,
    uses_mimo_attention,
)
from model.interop.tensor_names import (
    LINEAR,
    OFFSET,
    SAME,
    Entry,
    Linear,
    Rule,
    check_coverage,
    entry,
    layer_entries,
)

__all__ = ["MODEL_TYPE", "IGNORED_TENSORS", "config_from_hf", "config_to_hf", "tensor_table",
           "uses_mimo_attention"]

IGNORED_TENSORS = r"^model\.mtp\."  # transformers' _keys_to_ignore_on_load_unexpected


# ---- the tensor-name table ---------------------------------------------------------------------

F32 = "float32"
TOP_RULES = (
    Rule("model.embed_tokens.weight", "embed_tokens/embedding", SAME),
    Rule("model.norm.weight", "norm/weight", OFFSET),
    Rule("lm_head.weight", "lm_head/kernel", LINEAR),
)
# One decoder layer (model/layers/block.py); rules whose variable the layer lacks drop out
# (the sink of full-attention layers, the dense FFN of MoE layers, ...).
BLOCK_RULES = (
    Rule("input_layernorm.weight", "input_layernorm/weight", OFFSET),
    Rule("self_attn.q_proj.weight", "self_attn/q_proj/kernel", LINEAR),
    Rule("self_attn.k_proj.weight", "self_attn/k_proj/kernel", LINEAR),
    Rule("self_attn.v_proj.weight", "self_attn/v_proj/kernel", LINEAR),
    Rule("self_attn.o_proj.weight", "self_attn/o_proj/kernel", Linear(inputs=2)),
    Rule("self_attn.attention_sink_bias", "self_attn/sink", SAME),
    Rule("post_attention_layernorm.weight", "post_attention_layernorm/weight", OFFSET),
    Rule("mlp.gate_proj.weight", "mlp/gate_proj/kernel", LINEAR),
    Rule("mlp.up_proj.weight", "mlp/up_proj/kernel", LINEAR),
    Rule("mlp.down_proj.weight", "mlp/down_proj/kernel", LINEAR),
    Rule("mlp.gate.weight", "moe/router", LINEAR, dtype=F32),
    Rule("mlp.gate.e_score_correction_bias", "moe/router_bias", SAME, collection="balance",
         dtype=F32),
)
# Expert e's slice [d, I] / [I, d] of the stacked expert variables.
EXPERT_RULES = (
    Rule("mlp.experts.{e}.gate_proj.weight", "moe/gate_proj", LINEAR),
    Rule("mlp.experts.{e}.up_proj.weight", "moe/up_proj", LINEAR),
    Rule("mlp.experts.{e}.down_proj.weight", "moe/down_proj", LINEAR),
)


def tensor_table(cfg: ModelConfig, abstract: dict) -> list[Entry]:
    """Every checkpoint tensor of `cfg` with its variable (slice), in checkpoint order.
    `abstract`: unboxed variables (or their ShapeDtypeStructs)."""
    embed, norm, head = (entry(rule.hf, rule, abstract) for rule in TOP_RULES)
    entries = [embed, *layer_entries(cfg, abstract, BLOCK_RULES, EXPERT_RULES), norm, head]
    entries = [e for e in entries if e is not None]
    check_coverage(abstract, entries, "MiMo-V2-Flash")
    return entries
