"""Replayed routing through the whole model (model/layers/router.py, "Replayed routing"): the
experts a forward chose (`aux["moe"]["routed_experts"]`) or a decoder recorded
(`Decoder.generate(record_routing=True)`) replayed into a forward, with scanned and unscanned
layer stacks and a hash-routed layer. The MoE layer itself (every moe_impl, the router's
gradient) is checked against float64 references in tests/model/test_moe_module.py."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from routing_checks import check_recorded_routes, model_forward
from tiny_preset import REPO

from model.config import load_config
from model.inference.decode import Decoder
from model.inference.sampling import Sampling
from model.lm import CausalLM, init_variables

# Two dense-free MoE layers around a sliding-window one, the first hash-routed, 8 experts top-2.
OVERRIDES = ["num_layers=4", "layout=SSFS", "num_dense_layers=1", "d_model=32", "window=4",
             "head_dim=8", "dense_hidden=32", "vocab_size=64", "moe.num_experts=8",
             "moe.top_k=2", "moe.expert_hidden=16", "moe.shared_hidden=16",
             "moe.num_ep_groups=2", "moe.hash_layers=1", "mtp.num_heads=0", "init_std=0.2",
             "swiglu_limits=0", "swiglu_limits_shared=0"]


LENGTH = 16  # every forward here: [2, LENGTH] tokens (one compile per program)


def config(scan: bool):
    return load_config(REPO / "configs" / "tiny.yaml",
                       OVERRIDES + [f"scan_layers={str(scan).lower()}"])


@functools.cache
def variables(scan: bool):
    return nn.meta.unbox(init_variables(CausalLM(config(scan)), jax.random.key(4)))


@functools.cache
def forward(scan: bool):
    """(tokens [B, T], routes [L_moe, B, T, k] or None) -> (logits, MTP logits, routed,
    mismatch or None)."""
    return model_forward(config(scan), variables(scan))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_replaying_a_forwards_own_routes_reproduces_it_exactly(scan):
    """The routes a forward chose, replayed: bit-identical logits and no mismatch. A different
    choice for the learned-routing layers changes the logits and is what they use; the
    hash-routed layer keeps its table's experts whatever is replayed."""
    cfg = config(scan)
    assert cfg.moe_layer_indices() == [1, 2, 3] and cfg.is_hash_layer(1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, LENGTH)), jnp.int32)
    logits, _, routes, mismatch = forward(scan)(tokens)
    assert mismatch is None and routes.shape == (3, 2, LENGTH, 2) and routes.dtype == jnp.int32
    replayed_logits, _, replayed_routes, mismatch = forward(scan)(tokens, routes)
    np.testing.assert_array_equal(np.asarray(replayed_logits), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(replayed_routes), np.asarray(routes))
    assert float(jnp.sum(mismatch)) == 0

    other = (routes + 1) % cfg.moe.num_experts  # every token: another expert pair
    other = other.at[2, 1, 4:].set(-1)  # ... except the end of row 1 in the last layer
    other_logits, _, used, mismatch = forward(scan)(tokens, other)
    assert not np.allclose(np.asarray(other_logits), np.asarray(logits), atol=1e-3)
    np.testing.assert_array_equal(np.asarray(used[0]), np.asarray(routes[0]))  # hash: the table
    np.testing.assert_array_equal(np.asarray(used[1]), np.asarray(other[1]))
    np.testing.assert_array_equal(np.asarray(used[2, 1, 4:]) >= 0, True)  # its own choice
    np.testing.assert_array_equal(np.asarray(used[2, 0]), np.asarray(other[2, 0]))
    assert float(jnp.sum(mismatch[0])) == 0 and float(jnp.min(mismatch[1])) == 1
    assert float(jnp.sum(mismatch[2, 1, 4:])) == 0


def test_replaying_the_wrong_number_of_layers_is_refused():
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="2 layers given, the model has 3 MoE layers"):
        CausalLM(config(True)).apply(variables(True), tokens,
                                     routed_experts=jnp.zeros((2, 1, 4, 2), jnp.int32))


@pytest.mark.slow
def test_decoding_records_the_routes_the_full_forward_replays():
    """Sampled decoding records, per row, the experts of every token it fed through the model
    (prompt, then each generated token but the last): in float32 the training path's own
    routes (tests/routing_checks.py), and the full forward replaying them scores the sampled
    tokens with the decoder's log-probabilities."""
    cfg = config(True)
    decoder = Decoder(cfg, variables(True), max_len=LENGTH, prefill_chunk=4)
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    out = decoder.generate(prompts, 5, sampling=Sampling(1.0), key=jax.random.key(2),
                           record_routing=True)
    _, logits = check_recorded_routes(forward(True), prompts, out, LENGTH)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    for b, (prompt, generated) in enumerate(zip(prompts, out.tokens)):
        positions = np.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
        scored = np.asarray(log_probs)[b, positions, generated]
        np.testing.assert_allclose(scored, out.logprobs[b], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="record_routing: .* plain decoding"):
        decoder.generate(prompts, 2, record_routing=True, speculative=True)
