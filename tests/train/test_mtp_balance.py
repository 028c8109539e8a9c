"""The loss-free router-bias update (train/balance.py) on DeepSeek-V4's MTP blocks
(`mtp.block: layer`), whose MoE has a router bias of its own."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from train_helpers import TINY

from model.config import load_config
from train.balance import update_router_bias


def test_the_bias_update_reaches_layer_mtp_blocks():
    """`mtp.block: layer` heads have their own router bias: the same sign rule moves it with
    their loads; layers without a bias (all dense here) are left alone."""
    cfg = load_config(TINY, ["num_dense_layers=4", "num_layers=4", "layout=SSSF",
                             "swiglu_limits=0", "swiglu_limits_shared=0",
                             "mtp.block=layer", "mtp.num_heads=2", "moe.num_experts=4"])
    balance = {f"mtp_{h}": {"block": {"moe": {"router_bias": jnp.full(4, float(h))}}}
               for h in range(2)}
    loads = jnp.asarray([[0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]])
    updated = update_router_bias(balance, None, cfg, 0.01, loads)
    np.testing.assert_allclose(updated["mtp_0"]["block"]["moe"]["router_bias"],
                               [-0.01, 0.0, 0.0, 0.01])
    np.testing.assert_allclose(updated["mtp_1"]["block"]["moe"]["router_bias"],
                               [1.01, 1.01, 0.99, 0.99])
