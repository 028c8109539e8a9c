"""The multi-token-prediction heads' config (report 2.2; model/layers/mtp.py)."""

from __future__ import annotations

import dataclasses

from model.config.core import Config, check_bool, check_choice, check_int

MTP_BLOCKS = ("dense", "layer")


@dataclasses.dataclass(frozen=True)
class MTPConfig(Config):
    """Multi-token prediction heads (report 2.2; model/layers/mtp.py). `block`: `dense` (Step
    3.5, DeepSeek-V3: eh_proj + one SWA block with a dense FFN on the collapsed residual) or
    `layer` (DeepSeek-V4's release: e_proj + h_proj into a full decoder layer, routed MoE and
    the model's mHC streams, collapsed by the head's own hc_head)."""

    section = "mtp"

    num_heads: int = 3
    share_output_head: bool = False  # the released checkpoint stores one head per MTP layer
    attention_type: str = "S"  # the MTP block's layer character (DeepSeek-V4 models: W)
    block: str = "dense"

    def validate(self) -> None:
        check_int("num_heads", self.num_heads, 0)
        check_choice("attention_type", self.attention_type, ("S", "W"))
        check_bool("share_output_head", self.share_output_head)
        check_choice("block", self.block, MTP_BLOCKS)
