"""A tiny MiMo-V2-Flash model end to end (per-type GQA geometry, sinks on the SWA layers only,
values narrower than keys and scaled, no shared expert): every trainable parameter gets a
gradient, and its loss falls when trained on the embedded corpus as `python -m train` trains
configs/tiny_mimo.yaml."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.lm import CausalLM, init_variables
from train.loop import train
from train.step import loss_fn
from train.telemetry.metrics import METRICS_FILE, read_metrics
from tests.train_helpers import FAST_COMPILE, small_mimo_run, synthetic_batch


@pytest.mark.slow
def test_every_trainable_parameter_gets_a_gradient():
    run = small_mimo_run()
    cfg = run.model
    assert [cfg.attention_geometry(t).num_kv_heads for t in "FS"] == [1, 2]
    assert [cfg.attention_geometry(t).gate for t in "FS"] == ["none", "sink"]
    model = CausalLM(cfg)
    variables = nn.meta.unbox(init_variables(model, jax.random.key(0)))
    batch = {k: jnp.asarray(v[0]) for k, v in synthetic_batch(1, 2, 32, 64).items()}
    counts = jnp.ones((2,), jnp.float32) * 64

    def loss(params):
        return loss_fn(model, run, params, variables["balance"], batch, jnp.asarray(False),
                       counts, 1)

    (_, (parts, _)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                     compiler_options=FAST_COMPILE)(variables["params"])
    assert {"loss/lm", "loss/mtp", "loss/balance"} <= set(parts)
    flat = {jax.tree_util.keystr(path): g
            for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    assert [path for path, g in flat.items() if not np.any(np.asarray(g))] == []
    # the sinks: one per SWA layer and per MTP block (SWA), none on the full layers
    sinks = {path: g.shape for path, g in flat.items() if path.endswith("['sink']")}
    assert sorted(sinks.values()) == [(4,), (4, 4)] and len(sinks) == 2
    assert "shared_expert" not in str(jax.tree_util.tree_structure(grads))


@pytest.mark.slow
def test_loss_falls_on_the_embedded_corpus(tmp_path):
    run = small_mimo_run("train.steps=30", "train.lr=1e-2", "train.min_lr=1e-3",
                         "train.log_every=1", "train.eval_every=0",
                         "train.checkpoint_every=30", vocab=4096)
    summary = train(run, tmp_path)
    assert summary.last_step == 30
    records = [r for r in read_metrics(tmp_path / METRICS_FILE) if "loss/lm" in r]
    first, last = records[0]["loss/lm"], np.mean([r["loss/lm"] for r in records[-4:]])
    assert last < first - 1.0, (first, last)
    assert all(np.isfinite(r["loss/mtp"]) for r in records)
