"""FP4 quantization-aware training (DeepSeek-V4 report §3.4, §5.2.1): which parts of the network
compute in their deployment formats (model/ops/mx_quant.py), gradients straight through to the
float32 masters. The report brings it in for post-training; everything off is the float model.
"""

from __future__ import annotations

import dataclasses

from model.config.core import Config, ConfigError, check_choice

WEIGHT_FORMATS = ("none", "mxfp4")
SCORE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class QATConfig(Config):
    """`expert_weights: mxfp4`: routed experts' weights through MXFP4 and its lossless FP8
    tiles; `indexer_qk: mxfp4`: the CSA lightning indexer's queries and keys Hadamard-rotated
    and through MXFP4 (index_head_dim a power of two); `index_scores: bfloat16`: the index
    scores I rounded to bfloat16 before the top-k (the report pairs it with `indexer_qk`)."""

    section = "qat"

    expert_weights: str = "none"
    indexer_qk: str = "none"
    index_scores: str = "float32"

    def validate(self) -> None:
        check_choice("expert_weights", self.expert_weights, WEIGHT_FORMATS)
        check_choice("indexer_qk", self.indexer_qk, WEIGHT_FORMATS)
        check_choice("index_scores", self.index_scores, SCORE_DTYPES)

    def check_model(self, *, experts: bool, indexer: bool, index_head_dim: int) -> None:
        """The switches fit the model (`experts`: it has routed experts; `indexer`: CSA layers,
        whose lightning indexer has heads of `index_head_dim`). A switch on a part the model
        lacks would change nothing: refused, not ignored. Fields named as in ModelConfig."""
        lacks = "the CSA lightning indexer, but the layout has no CSA ('C') layer"
        for name, default, present, part in (
                ("expert_weights", "none", experts, "the routed experts, but the model has none"),
                ("indexer_qk", "none", indexer, lacks),
                ("index_scores", "float32", indexer, lacks)):
            value = getattr(self, name)
            if value != default and not present:
                raise ConfigError(f"qat.{name}", f"{value!r} applies to {part}; leave it "
                                  f"{default!r}")
        if self.indexer_qk != "none" and index_head_dim & (index_head_dim - 1):
            raise ConfigError("qat.indexer_qk", f"rotates the indexer's queries and keys with a "
                              f"Hadamard matrix: shared_kv_attention.index_head_dim must be a "
                              f"power of two, got {index_head_dim}")
