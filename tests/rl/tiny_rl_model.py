"""The tiny policy/judge architecture of the task-mix and judge tests: configs/sft_arith.yaml's
model at two layers (SWA dense + full MoE) and one MTP head, so compiles stay short."""

from train_helpers import REPO

from train.config import load_run_config

TINY_RL_MODEL = [
    "model.num_layers=2", "model.layout=SF", "model.d_model=32", "model.window=4",
    "model.head_dim=8", "model.dense_hidden=32", "model.moe.num_experts=4", "model.moe.top_k=2",
    "model.moe.expert_hidden=16", "model.moe.shared_hidden=16", "model.moe.num_ep_groups=2",
    "model.mtp.num_heads=1",
]


def tiny_model_config(*overrides):
    return load_run_config(REPO / "configs" / "sft_arith.yaml", [*TINY_RL_MODEL, *overrides]).model
