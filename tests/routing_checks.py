"""The two halves of routing replay checked on any model (tests/model/test_decode*.py and
test_routing_replay.py): decoding records the experts the training path's full forward
chooses, and that forward, replaying them, reproduces itself bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from model.lm import CausalLM


def model_forward(config, variables):
    """-> jitted forward(tokens [B, T], routes [L_moe, B, T, k] or None) = (logits, MTP
    logits, the routed experts [L_moe, B, T, k], replay_mismatch [L_moe, B, T] or None)."""
    model = CausalLM(config)

    @jax.jit
    def forward(tokens, routes=None):
        out = model.apply(variables, tokens, routed_experts=routes)
        moe = out.aux["moe"]
        return out.logits, out.mtp_logits, moe["routed_experts"], moe.get("replay_mismatch")

    return forward


def check_recorded_routes(forward, prompts, generation, length: int):
    """`generation`: `Decoder.generate(prompts, ..., record_routing=True)` in float32;
    `forward` as `model_forward` makes it. Checks that each row's recorded experts are the full
    forward's at every position the decoder fed (prompt, generated tokens but the last) and
    that the forward replaying them gives exactly its own logits.
    -> (rows [B, length], the replaying forward's logits [B, length, V])."""
    rows = np.zeros((len(prompts), length), np.int32)
    for b, (prompt, generated) in enumerate(zip(prompts, generation.tokens)):
        rows[b, :len(prompt) + len(generated)] = list(prompt) + list(generated)
    logits, _, routes, _ = forward(jnp.asarray(rows))
    recorded = np.full(routes.shape, -1, np.int32)
    for b, (prompt, generated) in enumerate(zip(prompts, generation.tokens)):
        fed = len(prompt) + len(generated) - 1
        assert generation.routed_experts[b].shape == (*routes.shape[:1], fed, routes.shape[-1])
        np.testing.assert_array_equal(generation.routed_experts[b],
                                      np.asarray(routes)[:, b, :fed], err_msg=f"row {b}")
        recorded[:, b, :fed] = generation.routed_experts[b]
    replayed, _, _, mismatch = forward(jnp.asarray(rows), jnp.asarray(recorded))
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
    assert float(jnp.sum(mismatch)) == 0
    return rows, np.asarray(replayed)
