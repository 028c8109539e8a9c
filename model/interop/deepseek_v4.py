"""The DeepSeek-V4 checkpoint family (`model_type: deepseek_v4`): config.json <-> ModelConfig and
the tensor-name table, as transformers (>= 5.24) `DeepseekV4ForCausalLM` writes and reads them
(the config translation: model/interop/deepseek_v4_config.py).

Tensor names: `save_pretrained` writes the module tree's state dict under the reference
implementation's leaf names (its default `save_original_format=True` reverts the load-time
renaming of transformers' `conversion_mapping.py`), so a decoder layer is
`model.layers.{i}.attn.wq_a.weight`, `.attn.compressor.wkv.weight`, `.ffn.experts.{e}.w1.weight`,
`.hc_attn_fn`, ..., beside `model.embed_tokens.weight`, `model.hc_head.hc_fn`,
`model.norm.weight` and `head.weight` (absent with tied embeddings); that is the layout read and
written here (`DeepseekV4ForCausalLM.from_pretrained` loads it).
- torch Linear weights are [out, in]; every routed expert is its own w1 (gate) / w3 (up)
  [I, d] and w2 (down) [d, I]; the grouped output projection `wo_a` is [g * r, (H/g) * c],
  group g's [r, (H/g) * c] block in turn (`tensor_names.GroupedLinear`); `wo_b` [d, g * r].
- mHC: `hc_{attn,ffn}_fn` [(2+n)n, n*d] with biases `_base` and gates `_scale`; `hc_head`'s
  `hc_fn` [n, n*d] (model/layers/hyper_connections.py).
- The compressors' `wkv` / `wgate` are [out, d] (out = 2c for CSA's overlapped pair), `ape` the
  slot bias [rate, out]; the indexer's `wq_b` [H^I * c^I, q_lora_rank] and `weights_proj`
  [H^I, d]. Its compressor sits under `attn.indexer.compressor`.
- Norm weights multiply (`weight * x`): stepjax keeps them as zero-centred offsets (1 + w), so
  they convert as weight = 1 + w (`tensor_names.Offset`). The query's per-head norm has none.
- `ffn.gate.bias` is the selection-only bias of the learned routers (stepjax's `router_bias`,
  the same sign); the hash-routed layers have `ffn.gate.tid2eid` [vocab, k] (int64) instead.
- Norms, mHC parameters, sinks, slot biases and router biases are float32 whatever the
  checkpoint dtype (transformers' `_keep_in_fp32_modules_strict`); exports write them so.
- The release's multi-token-prediction layers are `mtp.{h}.*` (the same name in both layouts):
  a decoder layer's tensors under that prefix, plus `e_proj` / `h_proj` [d, d], `enorm`,
  `hnorm`, `norm` and the head's own `hc_head_fn` / `_base` / `_scale` (stepjax's `layer` MTP
  block, model/layers/mtp.py). transformers builds no MTP layers, drops these tensors on load
  and writes none: an import builds the MTP heads the files hold (none from save_pretrained),
  an export writes stepjax's.

DeepSeek-V4's own release names the same tensors without transformers' `model.` prefix
(`release_name`): `embed.weight`, `layers.{i}.attn.wq_a.weight`, ..., `norm.weight`,
`hc_head_fn` / `_base` / `_scale`, `head.weight`; transformers' conversion table renames them
on load, and everything below the prefix is already the reference's naming, as above. Imports
read either layout (`hf.load_hf_checkpoint` picks the one the files use); exports write
transformers' (what `save_pretrained` writes).
"""

from __future__ import annotations

import re

from model.config import ModelConfig
from model.interop.deepseek_v4_config import (
    MODEL_TYPE,
    config_from_hf,
    config_to_hf,
    with_stored_mtp,
)
from model.interop.tensor_names import (
    LINEAR,
    OFFSET,
    SAME,
    Entry,
    GroupedLinear,
    Linear,
    Rule,
    check_coverage,
    entry,
    layer_entries,
)

__all__ = ["MODEL_TYPE", "EXPERT_TENSORS", "config_from_hf", "config_to_hf", "release_name",
           "tensor_table", "with_stored_mtp"]

EXPERT_TENSORS = r"\.ffn\.experts\.\d+\.w[123]\.weight$"  # the release's MXFP4 tensors


# ---- the tensor-name table ---------------------------------------------------------------------

# The release's name of a table name (the first pattern that matches): its top-level tensors
# are the reference's module attributes `embed`, `hc_head_fn`, ..., its layers `layers.{i}`.
RELEASE_NAMES = ((r"^model\.embed_tokens\.", "embed."), (r"^model\.hc_head\.hc_", "hc_head_"),
                 (r"^model\.", ""))


def release_name(name: str) -> str:
    """The name DeepSeek-V4's release gives tensor `name` of the table."""
    for pattern, replacement in RELEASE_NAMES:
        renamed, found = re.subn(pattern, replacement, name)
        if found:
            return renamed
    return name


F32 = "float32"
TOP_RULES = (
    Rule("model.embed_tokens.weight", "embed_tokens/embedding", SAME),
    Rule("model.hc_head.hc_fn", "hc_head/hc_fn", Linear(inputs=2), dtype=F32),
    Rule("model.hc_head.hc_base", "hc_head/hc_base", SAME, dtype=F32),
    Rule("model.hc_head.hc_scale", "hc_head/hc_scale", SAME, dtype=F32),
    Rule("model.norm.weight", "norm/weight", OFFSET, dtype=F32),
    Rule("head.weight", "lm_head/kernel", LINEAR),
)


def _compressor_rules(hf: str, ours: str) -> tuple[Rule, ...]:
    return (Rule(f"{hf}.wkv.weight", f"{ours}/kv_proj", LINEAR),
            Rule(f"{hf}.wgate.weight", f"{ours}/gate_proj", LINEAR),
            Rule(f"{hf}.ape", f"{ours}/position_bias", SAME, dtype=F32),
            Rule(f"{hf}.norm.weight", f"{ours}/kv_norm", OFFSET, dtype=F32))


def _hc_rules(hf: str, ours: str) -> tuple[Rule, ...]:
    return (Rule(f"hc_{hf}_fn", f"{ours}/fn", Linear(inputs=2), dtype=F32),
            Rule(f"hc_{hf}_base", f"{ours}/base", SAME, dtype=F32),
            Rule(f"hc_{hf}_scale", f"{ours}/scale", SAME, dtype=F32))


# One decoder layer (model/layers/block.py); rules whose variable the layer lacks drop out.
BLOCK_RULES = (
    Rule("attn_norm.weight", "input_layernorm/weight", OFFSET, dtype=F32),
    Rule("attn.wq_a.weight", "self_attn/q_a_proj/kernel", LINEAR),
    Rule("attn.q_norm.weight", "self_attn/q_a_norm/weight", OFFSET, dtype=F32),
    Rule("attn.wq_b.weight", "self_attn/q_b_proj/kernel", LINEAR),
    Rule("attn.wkv.weight", "self_attn/kv_proj/kernel", LINEAR),
    Rule("attn.norm.weight", "self_attn/kv_norm/weight", OFFSET, dtype=F32),
    Rule("attn.wo_a.weight", "self_attn/o_a_proj", GroupedLinear()),
    Rule("attn.wo_b.weight", "self_attn/o_b_proj/kernel", Linear(inputs=2)),
    Rule("attn.attn_sink", "self_attn/sinks", SAME, dtype=F32),
    *_compressor_rules("attn.compressor", "self_attn/compressor"),
    *_compressor_rules("attn.indexer.compressor", "self_attn/indexer/compressor"),
    Rule("attn.indexer.wq_b.weight", "self_attn/indexer/q_b_proj", LINEAR),
    Rule("attn.indexer.weights_proj.weight", "self_attn/indexer/weights_proj", LINEAR),
    *_hc_rules("attn", "attn_hc"),
    Rule("ffn_norm.weight", "post_attention_layernorm/weight", OFFSET, dtype=F32),
    Rule("ffn.gate.weight", "moe/router", LINEAR),
    Rule("ffn.gate.bias", "moe/router_bias", SAME, collection="balance", dtype=F32),
    Rule("ffn.gate.tid2eid", "moe/tid2eid", SAME, collection="balance", dtype="int64"),
    Rule("ffn.shared_experts.w1.weight", "moe/shared_expert/gate_proj/kernel", LINEAR),
    Rule("ffn.shared_experts.w2.weight", "moe/shared_expert/down_proj/kernel", LINEAR),
    Rule("ffn.shared_experts.w3.weight", "moe/shared_expert/up_proj/kernel", LINEAR),
    *_hc_rules("ffn", "ffn_hc"),
)
# Expert e's slice [d, I] / [I, d] of the stacked expert variables.
EXPERT_RULES = (
    Rule("ffn.experts.{e}.w1.weight", "moe/gate_proj", LINEAR),
    Rule("ffn.experts.{e}.w2.weight", "moe/down_proj", LINEAR),
    Rule("ffn.experts.{e}.w3.weight", "moe/up_proj", LINEAR),
)


# An MTP head's own tensors (under `mtp.{h}.`), beside its decoder layer's.
MTP_RULES = (
    Rule("e_proj.weight", "e_proj/kernel", LINEAR),
    Rule("h_proj.weight", "h_proj/kernel", LINEAR),
    Rule("enorm.weight", "enorm/weight", OFFSET, dtype=F32),
    Rule("hnorm.weight", "hnorm/weight", OFFSET, dtype=F32),
    Rule("norm.weight", "norm/weight", OFFSET, dtype=F32),
    Rule("hc_head_fn", "hc_head/hc_fn", Linear(inputs=2), dtype=F32),
    Rule("hc_head_base", "hc_head/hc_base", SAME, dtype=F32),
    Rule("hc_head_scale", "hc_head/hc_scale", SAME, dtype=F32),
)


def _mtp_entries(cfg: ModelConfig, abstract: dict) -> list[Entry | None]:
    found = []
    for h in range(cfg.mtp.num_heads):
        head, block = (f"mtp_{h}",), (f"mtp_{h}", "block")
        found += [entry(f"mtp.{h}.{rule.hf}", rule, abstract, block) for rule in BLOCK_RULES]
        found += [entry(f"mtp.{h}.{rule.hf.format(e=e)}", rule, abstract, block, (e,))
                  for e in range(cfg.moe.num_experts) for rule in EXPERT_RULES]
        found += [entry(f"mtp.{h}.{rule.hf}", rule, abstract, head) for rule in MTP_RULES]
    return found


def tensor_table(cfg: ModelConfig, abstract: dict) -> list[Entry]:
    """Every checkpoint tensor of `cfg` with its variable (slice), in checkpoint order.
    `abstract`: unboxed variables (or their ShapeDtypeStructs)."""
    embed, *tail = (entry(rule.hf, rule, abstract) for rule in TOP_RULES)
    entries = [embed, *layer_entries(cfg, abstract, BLOCK_RULES, EXPERT_RULES),
               *_mtp_entries(cfg, abstract), *tail]
    entries = [e for e in entries if e is not None]
    check_coverage(abstract, entries, "DeepSeek-V4")
    return entries
