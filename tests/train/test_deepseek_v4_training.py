"""A tiny DeepSeek-V4 model end to end: every trainable parameter gets a gradient (the
lightning indexer through its own loss only), the losses it adds are in the metrics, and its
loss falls when trained on the embedded corpus as `python -m train` trains configs/tiny.yaml."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.lm import CausalLM, init_variables
from train.loop import train
from train.state import build_training, create_state
from train.step import loss_fn, make_train_step
from train.telemetry.metrics import METRICS_FILE, read_metrics
from tests.train_helpers import FAST_COMPILE, small_v4_run, synthetic_batch

@pytest.mark.slow
def test_every_trainable_parameter_gets_a_gradient():
    run = small_v4_run()
    model = CausalLM(run.model)
    variables = nn.meta.unbox(init_variables(model, jax.random.key(0)))
    batch = {k: jnp.asarray(v[0]) for k, v in synthetic_batch(1, 2, 32, 64).items()}
    counts = jnp.ones((2,), jnp.float32) * 64

    def loss(params):
        return loss_fn(model, run, params, variables["balance"], batch, jnp.asarray(False),
                       counts, 1)

    (_, (parts, _)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                     compiler_options=FAST_COMPILE)(variables["params"])
    assert {"loss/lm", "loss/mtp", "loss/balance", "loss/sequence_balance",
            "loss/indexer"} <= set(parts)
    assert float(parts["loss/indexer"]) > 0
    silent = [jax.tree_util.keystr(path) for path, g in
              jax.tree_util.tree_flatten_with_path(grads)[0] if not np.any(np.asarray(g))]
    assert silent == []
    # The hash table is data, not a parameter.
    assert "tid2eid" not in str(jax.tree_util.tree_structure(grads))


@pytest.mark.slow
def test_loss_falls_on_the_embedded_corpus(tmp_path):
    run = small_v4_run("train.steps=30", "train.lr=1e-2", "train.min_lr=1e-3", "train.log_every=1",
                 "train.eval_every=0", "train.checkpoint_every=30", vocab=4096)
    summary = train(run, tmp_path)
    assert summary.last_step == 30
    records = [r for r in read_metrics(tmp_path / METRICS_FILE) if "loss/lm" in r]
    first, last = records[0]["loss/lm"], np.mean([r["loss/lm"] for r in records[-4:]])
    assert last < first - 1.0, (first, last)
    assert all(np.isfinite(r["loss/indexer"]) and np.isfinite(r["loss/sequence_balance"])
               for r in records)


@pytest.mark.slow
def test_indexer_warm_up_step_trains_the_indexers_alone():
    """DeepSeek-V4's indexer warm-up as a training step (report 4.2.2): CSA attending densely,
    `train.trainable=indexer`. Two updates change every indexer param and nothing else (router
    biases included); the indexer's recall is logged; the MTP weight drops from 0.3 to 0.1 where
    the learning rate starts to decay (here after one step)."""
    run = small_v4_run("model.num_layers=2", "model.layout=WC", "model.hyper_connections.hc_mult=1",
                       "model.shared_kv_attention.csa_attention=dense", "train.trainable=indexer",
                       "train.router_bias_rate=0", "train.warmup_steps=0", "train.steps=5",
                       "train.schedule=stages",
                       "train.lr_stages=[[1, 1e-2, constant], [4, 1e-3, cosine]]",
                       "train.mtp_loss_weight_at_decay=0.1", "train.lr=1e-2")
    training = build_training(run)
    state = create_state(training.model, training.optimizer, 0)
    step = jax.jit(make_train_step(training, run), compiler_options=FAST_COMPILE)
    batch = {k: jnp.asarray(v) for k, v in synthetic_batch(1, 4, 32, 64).items()}
    new, first = step(state, batch, jnp.asarray(False))
    new, second = step(new, batch, jnp.asarray(False))
    assert (float(first["mtp_weight"]), float(second["mtp_weight"])) == pytest.approx((0.3, 0.1))
    assert 0 <= float(first["indexer/recall"]) <= 1
    changed = {jax.tree_util.keystr(path): bool(np.any(np.asarray(a) != np.asarray(b)))
               for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                                       jax.tree.leaves(new.params))}
    indexer = {k for k in changed if "'indexer'" in k}
    assert indexer and all(changed[k] for k in indexer)
    assert not any(changed[k] for k in changed.keys() - indexer)
    chex.assert_trees_all_equal(state.balance, new.balance)
