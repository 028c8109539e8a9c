"""The MIS-PO actor loss and its filters (rl/objectives/losses.py: `mis_po_loss`, `mis_filters`,
report eq. 2) against hand-derived literals (derivations in comments) and an explicit float64
loop reference written here, never against the code under test: token filter (closed bounds,
dropped tokens stay in the denominator), trajectory filter (geometric mean over masked tokens),
keep fractions, exact zero gradients for masked / filtered tokens and w.r.t. advantages, the
on-policy gradient, `select`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import losses as L

# Jitted once per module (one compile per shape instead of one per eager op: ~5x faster on CPU).
_BOUNDS = ("token_bounds", "traj_bounds")
mis_filters = jax.jit(L.mis_filters, static_argnames=_BOUNDS)
mis_po_loss = jax.jit(L.mis_po_loss, static_argnames=_BOUNDS)


def _loss_only(fn):
    return lambda *args, **kwargs: fn(*args, **kwargs)[0]


# d loss / d (logp, old_logp, infer_logp, advantages)
mis_po_grads = jax.jit(jax.grad(_loss_only(L.mis_po_loss), argnums=(0, 1, 2, 3)),
                       static_argnames=_BOUNDS)

LN2 = math.log(2.0)


def f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


# --------------------------------------------------------------------------------------------
# A float64 reference of eq. 2, written independently as explicit loops.

def reference_mis_po(logp, old_logp, infer_logp, advantages, mask, token_bounds=(0.5, 2.0),
                     traj_bounds=(0.996, 1.001), select=None):
    logp, old, infer, adv, mask = (np.asarray(a, np.float64)
                                   for a in (logp, old_logp, infer_logp, advantages, mask))
    select = np.ones_like(mask) if select is None else np.asarray(select, np.float64)
    B, T = mask.shape
    numerator, denominator = 0.0, 0.0
    for b in range(B):
        log_x = [old[b, t] - infer[b, t] for t in range(T) if mask[b, t] > 0]
        traj_ok = (not log_x) or (traj_bounds[0] <= math.exp(sum(log_x) / len(log_x))
                                  <= traj_bounds[1])
        for t in range(T):
            if mask[b, t] == 0:
                continue
            denominator += 1.0
            x = math.exp(old[b, t] - infer[b, t])
            if traj_ok and token_bounds[0] <= x <= token_bounds[1]:
                numerator += select[b, t] * -logp[b, t] * adv[b, t]
    return numerator / max(denominator, 1.0)


# Shared [2, 5] batch: row 0 has 5 response tokens, row 1 has 3 (then 2 padding positions).
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.float64)
LOGP = -np.array([[0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0]])
ADV = np.array([[1.0] * 5, [-0.5] * 5])


def test_mis_po_drops_out_of_bounds_token_but_keeps_it_in_denominator():
    # Row 0: token 0 has x = 2.5 > 2 (dropped); tokens 1..4 have log x = -ln(2.5)/4 each
    # (x = 0.795, kept), so the row's geometric mean is exp(0) = 1 (trajectory kept).
    # Row 1: old == infer (x = 1). Padding positions carry a huge ratio that must be ignored.
    log_x = np.array([[math.log(2.5)] + [-math.log(2.5) / 4] * 4, [0, 0, 0, 5.0, 5.0]])
    infer = np.full((2, 5), -1.0)
    old = infer + log_x
    loss, stats = mis_po_loss(f32(LOGP), f32(old), f32(infer), f32(ADV), f32(MASK))
    # kept: row 0 tokens 1..4: -logp*A = 0.2+0.3+0.4+0.5 = 1.4; row 1 tokens 0..2:
    # (0.6+0.7+0.8) * -0.5 = -1.05; sum 0.35 over all 8 response tokens -> 0.04375.
    np.testing.assert_allclose(loss, 0.04375, rtol=1e-6)
    np.testing.assert_allclose(loss, reference_mis_po(LOGP, old, infer, ADV, MASK), rtol=1e-6)
    np.testing.assert_allclose(stats["token_keep_frac"], 7 / 8, rtol=1e-6)
    np.testing.assert_allclose(stats["token_filter_frac"], 7 / 8, rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("row_log_ratio", [0.01, -0.01])
def test_mis_po_drops_whole_trajectory_outside_geometric_mean_bounds(row_log_ratio):
    # Row 1: every token x = exp(+-0.01) (inside [0.5, 2]) but the geometric mean 1.01 > 1.001
    # (resp. 0.990 < 0.996): the whole row contributes nothing. Row 0 is on-policy.
    infer = np.full((2, 5), -1.0)
    old = infer + np.array([[0.0] * 5, [row_log_ratio] * 3 + [0.0, 0.0]])
    loss, stats = mis_po_loss(f32(LOGP), f32(old), f32(infer), f32(ADV), f32(MASK))
    # Only row 0: (0.1+0.2+0.3+0.4+0.5) * 1 = 1.5, over 8 tokens -> 0.1875.
    np.testing.assert_allclose(loss, 0.1875, rtol=1e-6)
    np.testing.assert_allclose(loss, reference_mis_po(LOGP, old, infer, ADV, MASK), rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1 / 2, rtol=1e-6)  # 1 of 2 rows
    np.testing.assert_allclose(stats["token_keep_frac"], 5 / 8, rtol=1e-6)  # row 0's tokens
    np.testing.assert_allclose(stats["token_filter_frac"], 1.0, rtol=1e-6)  # no token filtered


def test_mis_po_trajectory_ratio_ignores_padding_positions():
    # Padding of row 1 has log x = 0.5 (x = 1.65, inside the token bounds): if it entered the
    # geometric mean, the row would be dropped. The response tokens have x = 1 -> row kept.
    infer = np.full((2, 5), -1.0)
    old = infer + np.array([[0.0] * 5, [0.0, 0.0, 0.0, 0.5, 0.5]])
    loss, stats = mis_po_loss(f32(LOGP), f32(old), f32(infer), f32(ADV), f32(MASK))
    # (1.5 - 1.05) / 8 = 0.05625
    np.testing.assert_allclose(loss, 0.05625, rtol=1e-6)
    np.testing.assert_allclose(stats["traj_keep_frac"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(stats["token_keep_frac"], 1.0, rtol=1e-6)


def test_mis_po_matches_float64_loop_reference_on_mixed_batch():
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 3.0, (2, 5))
    infer = -rng.uniform(0.1, 3.0, (2, 5))
    # Row 0: one token far off (x = e), small noise elsewhere; row 1: near on-policy.
    old = infer + np.array([[1.0, 1e-4, -2e-4, 1e-4, 0.0], [1e-4, -1e-4, 2e-4, 3.0, -3.0]])
    adv = rng.normal(size=(2, 5))
    select = np.array([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], np.float64)
    for kwargs in ({}, {"select": select}, {"traj_bounds": (0.5, 2.0)}):
        loss, _ = mis_po_loss(f32(logp), f32(old), f32(infer), f32(adv), f32(MASK),
                              **{k: f32(v) if k == "select" else v for k, v in kwargs.items()})
        expected = reference_mis_po(logp, old, infer, adv, MASK, **kwargs)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)


def _mis_po_grad(logp, old, infer, adv, mask, argnums=0):
    grads = mis_po_grads(f32(logp), f32(old), f32(infer), f32(adv), f32(mask))
    return grads[argnums]


def test_mis_po_gradient_is_exactly_zero_on_masked_and_filtered_tokens():
    # Row 0 token 0 is token-filtered (x = 2.5); row 1 padding positions are masked.
    log_x = np.array([[math.log(2.5)] + [-math.log(2.5) / 4] * 4, [0, 0, 0, 0, 0]])
    infer = np.full((2, 5), -1.0)
    grad = np.asarray(_mis_po_grad(LOGP, infer + log_x, infer, ADV, MASK))
    assert grad[0, 0] == 0.0  # filtered
    assert grad[1, 3] == 0.0 and grad[1, 4] == 0.0  # masked out
    assert np.all(grad[0, 1:] != 0.0) and np.all(grad[1, :3] != 0.0)  # the rest do learn
    # A filtered trajectory: every one of its tokens gets exactly zero gradient.
    old = infer + np.array([[0.0] * 5, [0.01] * 5])
    grad = np.asarray(_mis_po_grad(LOGP, old, infer, ADV, MASK))
    assert np.all(grad[1] == 0.0)
    assert np.all(grad[0] != 0.0)


def test_mis_po_on_policy_gradient_is_exact_policy_gradient():
    # old == infer: every x = 1, nothing filtered; d loss / d logp_t = -A_t * mask_t / sum(mask).
    # sum(mask) = 8 is a power of two, so the float32 division is exact and so is the check.
    adv = np.array([[1.0, -2.0, 0.5, 3.0, -0.25], [-0.5, 1.5, 2.0, 7.0, 9.0]])
    infer = np.full((2, 5), -1.0)
    grad = _mis_po_grad(LOGP, infer, infer, adv, MASK)
    expected = (-adv * MASK / 8.0).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(grad), expected)


def test_mis_po_advantages_get_no_gradient():
    infer = np.full((2, 5), -1.0)
    grad = np.asarray(_mis_po_grad(LOGP, infer, infer, ADV, MASK, argnums=3))
    assert np.all(grad == 0.0)


def test_mis_po_select_removes_numerator_terms_only():
    infer = np.full((2, 5), -1.0)
    select = np.array([[0, 1, 1, 0, 1], [1, 0, 1, 1, 1]], np.float64)
    loss, _ = mis_po_loss(f32(LOGP), f32(infer), f32(infer), f32(ADV), f32(MASK),
                          select=f32(select))
    # row 0 tokens 1, 2, 4: 0.2+0.3+0.5 = 1.0; row 1 tokens 0, 2: (0.6+0.8) * -0.5 = -0.7;
    # sum 0.3, still over all 8 response tokens -> 0.0375.
    np.testing.assert_allclose(loss, 0.0375, rtol=1e-6)


def test_mis_filters_bounds_are_inclusive():
    # Row 0 token ratios exactly 2.0 and 0.5 (float32 exp(+-ln 2) is exactly 2 / 0.5 here) and
    # 2.25 / 0.4 just outside. Each row is a single token so its geometric mean is its ratio:
    # with trajectory bounds (0.5, 2.0) those rows at exactly 2.0 / 0.5 are kept too.
    old = np.array([[LN2, -LN2, math.log(2.25), math.log(0.4), 0.0]])
    infer = np.zeros((1, 5))
    mask = np.ones((1, 5))
    assert float(jnp.exp(f32(LN2))) == 2.0 and float(jnp.exp(f32(-LN2))) == 0.5
    keep, _, _ = mis_filters(f32(old), f32(infer), f32(mask), traj_bounds=(0.0, 10.0))
    np.testing.assert_array_equal(np.asarray(keep), [[True, True, False, False, True]])

    old_rows = np.array([[LN2, 0.0], [-LN2, 0.0], [math.log(2.25), 0.0]])
    mask_rows = np.array([[1, 0], [1, 0], [1, 0]], np.float64)
    keep, traj_keep, stats = mis_filters(f32(old_rows), f32(np.zeros((3, 2))), f32(mask_rows),
                                         traj_bounds=(0.5, 2.0))
    np.testing.assert_array_equal(np.asarray(traj_keep), [True, True, False])
    np.testing.assert_allclose(stats["traj_keep_frac"], 2 / 3, rtol=1e-6)
