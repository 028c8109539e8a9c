"""Hash routing (DeepSeek-V4 report 2.1): the experts come from the token id's row of the
frozen table, the combine weights from the router's sqrt(softplus) scores; against a float64
numpy reference with explicit loops and against transformers' DeepseekV4HashRouter."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import MoEConfig
from model.layers.hash_routing import hash_route, random_hash_table

VOCAB, EXPERTS, TOP_K = 11, 8, 3


def _cfg(**changes):
    base = dict(num_experts=EXPERTS, top_k=TOP_K, routed_scaling_factor=1.5, num_ep_groups=1,
                router_activation="sqrt_softplus")
    return MoEConfig(**{**base, **changes})


def _table(seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(VOCAB)])


def np_hash_route(token_ids, table, logits, scale):
    """Per token: experts = table[id] in table order; weights = s of those / their sum * scale,
    s = sqrt(log(1 + e^x)); probs = s / sum over all experts."""
    indices = np.zeros((len(token_ids), table.shape[1]), np.int64)
    weights = np.zeros(indices.shape)
    probs = np.zeros(logits.shape)
    for n, token in enumerate(token_ids):
        s = [math.sqrt(math.log1p(math.exp(float(v)))) for v in logits[n]]
        chosen = [int(e) for e in table[token]]
        total = sum(s[e] for e in chosen)
        indices[n] = chosen
        weights[n] = [scale * s[e] / total for e in chosen]
        probs[n] = [v / sum(s) for v in s]
    return indices, weights, probs


def test_hash_route_picks_exactly_the_table_experts():
    rng = np.random.default_rng(1)
    table = _table()
    token_ids = rng.integers(0, VOCAB, size=20)
    token_ids[:2] = [4, 4]  # a repeated token gets the same experts whatever its logits
    logits = rng.normal(scale=2.0, size=(20, EXPERTS)).astype(np.float32)
    routing = hash_route(jnp.asarray(token_ids), jnp.asarray(table), jnp.asarray(logits), _cfg())
    indices, weights, probs = np_hash_route(token_ids, table, logits, 1.5)
    assert routing.indices.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(routing.indices), indices)
    np.testing.assert_array_equal(np.asarray(routing.indices)[0], np.asarray(routing.indices)[1])
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(routing.probs), probs, rtol=1e-5)
    # the table, not the scores, decides: top-k of the scores would choose other experts
    assert not all(set(np.argsort(-logits[n])[:TOP_K]) == set(indices[n]) for n in range(20))


def test_hash_route_rejects_a_table_of_the_wrong_width():
    with pytest.raises(ValueError, match="top_k=3"):
        hash_route(jnp.zeros(4, jnp.int32), jnp.zeros((VOCAB, 2), jnp.int32),
                   jnp.zeros((4, EXPERTS)), _cfg())


def test_gradient_reaches_the_router_weights_through_the_combine_weights():
    rng = np.random.default_rng(2)
    table = jnp.asarray(_table())
    token_ids = jnp.asarray(rng.integers(0, VOCAB, size=9))
    x = jnp.asarray(rng.normal(size=(9, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, EXPERTS)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(9, TOP_K)), jnp.float32)

    def loss(w):
        return jnp.sum(hash_route(token_ids, table, x @ w, _cfg()).weights * target)

    g = np.asarray(jax.grad(loss)(w))
    assert np.all(np.isfinite(g))
    chosen = np.unique(np.asarray(table)[np.asarray(token_ids)])
    assert np.all(np.abs(g[:, chosen]).sum(0) > 0)  # every expert that was used learns
    # the integer table is data: it has no gradient, and the selection does not move with w
    moved = hash_route(token_ids, table, x @ (w + 5.0 * g), _cfg())
    np.testing.assert_array_equal(np.asarray(moved.indices), np.asarray(table)[token_ids])


def test_random_hash_table_has_distinct_in_range_experts_and_is_deterministic():
    key = jax.random.key(0)
    table = np.asarray(random_hash_table(key, 200, EXPERTS, TOP_K))
    assert table.shape == (200, TOP_K) and table.dtype == np.int32
    assert table.min() >= 0 and table.max() < EXPERTS
    assert all(len(set(row)) == TOP_K for row in table)
    counts = np.bincount(table.reshape(-1), minlength=EXPERTS)
    assert counts.min() > 0.5 * counts.mean()  # roughly uniform over experts
    np.testing.assert_array_equal(table, np.asarray(random_hash_table(key, 200, EXPERTS, TOP_K)))
    other = np.asarray(random_hash_table(jax.random.key(1), 200, EXPERTS, TOP_K))
    assert not np.array_equal(table, other)


@pytest.mark.parity
def test_hash_router_parity_with_transformers():
    import torch
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    config = DeepseekV4Config(hidden_size=16, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
                              vocab_size=VOCAB, moe_intermediate_size=12, num_hidden_layers=2)
    assert config.mlp_layer_types[0] == "hash_moe"
    torch.manual_seed(0)
    router = DeepseekV4HashRouter(config)
    table = _table(3)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        router.tid2eid.copy_(torch.from_numpy(table))
    input_ids = torch.randint(0, VOCAB, (2, 6))
    hidden = torch.randn(2, 6, 16)
    with torch.no_grad():
        _, weights_t, indices_t = router(hidden, input_ids)

    logits = jnp.asarray(hidden.numpy()).reshape(12, 16) @ jnp.asarray(router.weight.detach().numpy()).T
    routing = hash_route(jnp.asarray(input_ids.numpy().reshape(-1)),
                         jnp.asarray(router.tid2eid.numpy()), logits, _cfg())
    np.testing.assert_array_equal(np.asarray(routing.indices), indices_t.numpy())
    np.testing.assert_allclose(np.asarray(routing.weights), weights_t.numpy(), rtol=1e-4)
