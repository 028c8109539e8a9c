"""Tests of `train.optim.muon`: Polar Express / Newton-Schulz orthogonalisation against float64
numpy SVD, float16 robustness (report 4.1.1), per-expert batching (4.2.3), matrix views and the
update scale of `scale_by_muon`."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model.config import config_to_dict
from train.config import load_run_config
from train.resume_fields import incompatible_fields
from train.optim import muon
from train.optim.config import MuonConfig
from train.optim.muon import (
    POLAR_EXPRESS_COEFFS,
    MatrixView,
    matrix_view,
    scale_by_muon,
    update_scale,
)

# Jitted: one compilation per shape is faster than eager dispatch of 18 matmuls.
orthogonalize = jax.jit(muon.orthogonalize,
                        static_argnames=("method", "steps", "finish_steps", "dtype", "gram_form"))

# Measured on random Gaussian rectangular matrices, T = 6, float16 state: singular values in
# [0.9973, 1.0023] (float32: [0.9974, 1.0012]; bfloat16: [0.982, 1.008]).
PE_FP16_SV_TOL = 5e-3


def _gaussian(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _svals(x):
    """Singular values of every matrix of x [..., m, n] (float64), flattened."""
    return np.linalg.svd(np.asarray(x, np.float64), compute_uv=False).ravel()


def _polar(x):
    """Exact polar factor U V^T of every matrix of x [..., m, n] in float64."""
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    return u @ vt


def _with_spectrum(m, n, singular_values, seed=0):
    """m x n matrix with the given singular values and random singular vectors."""
    rng = np.random.default_rng(seed)
    r = len(singular_values)
    u, _ = np.linalg.qr(rng.standard_normal((m, r)))
    v, _ = np.linalg.qr(rng.standard_normal((n, r)))
    return ((u * singular_values) @ v.T).astype(np.float32)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (160, 32), (3, 48, 32), (2, 2, 32, 48)])
def test_polar_express_fp16_singular_values_near_one(shape):
    o = orthogonalize(jnp.asarray(_gaussian(shape)))
    assert o.dtype == jnp.float32 and o.shape == shape
    s = _svals(o)
    assert np.all(np.abs(s - 1) < PE_FP16_SV_TOL), (s.min(), s.max())


def test_polar_express_square_matrix_with_spread_spectrum():
    # Singular values over two decades: after the 1.01 * Frobenius normalisation the smallest is
    # ~1e-3 relative, the edge of the range the coefficients were fitted on.
    g = _with_spectrum(48, 48, np.logspace(0, -2, 48))
    s = _svals(orthogonalize(jnp.asarray(g)))
    assert np.all(np.abs(s - 1) < PE_FP16_SV_TOL), (s.min(), s.max())


def test_newton_schulz_quintic_plateaus_around_one():
    """Keller Jordan's quintic does not converge: singular values stay in about [0.7, 1.2]."""
    s = _svals(orthogonalize(jnp.asarray(_gaussian((64, 32))), method="newton_schulz", steps=6))
    assert 0.6 < s.min() < 0.8 and 1.05 < s.max() < 1.2, (s.min(), s.max())


def _hybrid_newton_schulz_float64(g, fast, finish):
    """DeepSeek-V4 report 2.4 eq. 28 as written, one matrix at a time in float64: M_0 = G /
    ||G||_F, then M <- a M + b (M M^T) M + c (M M^T)^2 M, `fast` times with (3.4445, -4.7750,
    2.0315) and `finish` times with (2, -1.5, 0.5)."""
    out = []
    for matrix in np.asarray(g, np.float64).reshape(-1, *g.shape[-2:]):
        m = matrix / np.sqrt(np.sum(matrix * matrix))
        for i in range(fast + finish):
            a, b, c = (3.4445, -4.7750, 2.0315) if i < fast else (2.0, -1.5, 0.5)
            gram = m @ m.T
            m = a * m + b * (gram @ m) + c * (gram @ gram @ m)
        out.append(m)
    return np.stack(out).reshape(g.shape)


@pytest.mark.parametrize("shape, steps, finish", [
    ((32, 48), 10, None),  # the report's 8 + 2 (finish_steps defaults to 2)
    ((48, 32), 10, None),  # tall: iterated on its transpose, p(M M^T) M = M p(M^T M)
    ((3, 24, 64), 10, None),  # a batch of matrices wide enough for the Gram form in float32
    ((40, 40), 7, 3),  # step counts configurable
    ((16, 24), 5, 0),  # no finishing iteration: the plain quintic
])
def test_hybrid_newton_schulz_matches_a_float64_loop(shape, steps, finish):
    g = _gaussian(shape, seed=3)
    got = orthogonalize(jnp.asarray(g), method="hybrid_newton_schulz", steps=steps,
                        finish_steps=finish, dtype=jnp.float32)
    fast = steps - (2 if finish is None else finish)
    # measured within 6.7e-7 in float32; Polar Express's 1.01 safety factor would move it 6e-5
    np.testing.assert_allclose(got, _hybrid_newton_schulz_float64(g, fast, steps - fast),
                               atol=3e-6)
    if steps - fast == 2:  # the finishing pair pins the quintic's plateau [0.7, 1.2] near 1
        s = _svals(got)
        assert np.abs(s - 1).max() < 0.05, (s.min(), s.max())


def test_the_hybrid_orthogonalizer_alone_runs_deepseek_v4s_eight_plus_two_at_rms_0_18():
    """DeepSeek-V4 report 2.4 eq. 28 (8 + 2 iterations) and 4.2.2 (update RMS 0.18) follow from
    the orthogonalizer when steps / update_rms are unset (the configs: test_run_config.py)."""
    g = _gaussian((24, 40), seed=9)
    tx = scale_by_muon(orthogonalizer="hybrid_newton_schulz", iteration_dtype="float32")
    update, _ = jax.jit(tx.update)(jnp.asarray(g), tx.init(jnp.zeros((24, 40))))
    expected = _hybrid_newton_schulz_float64(g, 8, 2) * 0.18 * np.sqrt(40)
    np.testing.assert_allclose(update, expected, atol=3e-6)


@pytest.mark.parametrize("method, steps", [("hybrid_newton_schulz", 10), ("polar_express", 6)])
def test_rank_deficient_gradients_stay_bounded(method, steps):
    """A gradient of rank 4 (a few tokens' worth) as a wide float32 matrix: the rank-4 part
    becomes orthogonal, the null directions stay near 0. Iterated on the Gram side, eq. 28's 10
    steps blew rounding errors of X X^T up to singular values of 1e25, so the hybrid iterates
    directly."""
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((32, 4)) @ rng.standard_normal((4, 128))).astype(np.float32)
    s = _svals(orthogonalize(jnp.asarray(g), method=method, steps=steps, dtype=jnp.float32))
    np.testing.assert_allclose(s[:4], 1.0, atol=5e-3)
    assert s[4:].max() < 0.01, s[4:].max()


@pytest.mark.parametrize("steps", [5, 6])
def test_polar_express_closer_to_polar_factor_than_newton_schulz(steps):
    g = _gaussian((3, 64, 40), seed=1)
    exact = _polar(g)
    err = {m: np.abs(np.asarray(orthogonalize(jnp.asarray(g), method=m, steps=steps)) - exact).max()
           for m in ("polar_express", "newton_schulz")}
    # Measured max |error|: T=5 0.043 vs 0.11, T=6 0.003 vs 0.11.
    assert err["polar_express"] < 0.5 * err["newton_schulz"], err


def test_polar_express_coefficients_approximate_sign_on_fitted_range():
    """The scalar composition p_T(...p_1(x)) on the fitted range [1e-3, 1] / 1.01 (float64):
    within 0.0065 of 1 after T = 6 (measured) and converged after T = 8, which also exercises
    the repeat-the-last-polynomial rule."""
    def compose(steps):
        x = np.geomspace(1e-3, 1.0, 4000) / 1.01
        for i in range(steps):
            a, b, c = POLAR_EXPRESS_COEFFS[min(i, len(POLAR_EXPRESS_COEFFS) - 1)]
            x = a * x + b * x**3 + c * x**5
        return np.abs(x - 1).max()
    assert compose(5) > 0.1
    assert compose(6) < 1e-2
    assert compose(8) < 1e-12


def test_more_steps_than_tabulated_repeat_the_last_polynomial():
    s = _svals(orthogonalize(jnp.asarray(_gaussian((64, 32))), steps=12, dtype=jnp.float32))
    assert np.abs(s - 1).max() < 1e-4


def test_invariant_to_gradient_scale():
    g = jnp.asarray(_gaussian((2, 48, 32)))
    # Equal up to float16 rounding of the normalised input (elementwise error vs the exact
    # polar factor is ~3e-3 here as well).
    np.testing.assert_allclose(orthogonalize(g), orthogonalize(1000.0 * g), atol=5e-3)
    np.testing.assert_allclose(orthogonalize(g), orthogonalize(1e-3 * g), atol=5e-3)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])  # float32: the Gram form
@pytest.mark.parametrize("scale", [1e4, 1.0, 1e-6])
def test_iteration_finite_on_ill_conditioned_inputs(scale, dtype):
    # Condition number 1e6; entries up to ~1e4 and down to ~1e-6 (below float16's normal range).
    g = scale * _with_spectrum(64, 32, np.logspace(0, -6, 32), seed=2)
    o = np.asarray(orthogonalize(jnp.asarray(g), dtype=dtype))
    assert np.all(np.isfinite(o))
    s = _svals(o)
    assert s.max() < 1 + PE_FP16_SV_TOL
    # Directions with singular value >= 1e-2 of the largest are orthogonalised.
    exact_s = np.logspace(0, -6, 32)
    assert np.all(np.abs(np.sort(s)[::-1][exact_s >= 1e-2] - 1) < 0.02)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_zero_gradient_gives_zero_update(dtype):
    o = orthogonalize(jnp.zeros((4, 16, 8)), dtype=dtype)
    assert np.all(np.asarray(o) == 0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_iteration_matmuls_run_in_the_iteration_dtype(dtype):
    """Report 4.1.1: state and intermediates in float16; only the normalisation is float32."""
    jaxpr = jax.make_jaxpr(lambda g: muon.orthogonalize(g, dtype=dtype, steps=6,
                                                        gram_form=False))(jnp.ones((3, 16, 8)))
    eqns = jaxpr.jaxpr.eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 * 6
    for e in dots:
        assert all(v.aval.dtype == dtype for v in (*e.invars, *e.outvars))
    first_dot = eqns.index(dots[0])
    for e in eqns[first_dot:]:
        if e.primitive.name in ("add", "mul", "sub"):
            assert all(v.aval.dtype == dtype for v in e.outvars), e
    assert jaxpr.out_avals[0].dtype == jnp.float32


@pytest.mark.parametrize("method", ["polar_express", "newton_schulz"])
@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (3, 48, 96), (2, 2, 32, 128)])
def test_gram_form_matches_the_direct_iteration_in_float32(shape, method):
    """Same polynomials carried by the r x r Gram side: measured max difference 1.6e-6."""
    g = jnp.asarray(_gaussian(shape, seed=2))
    gram, direct = (orthogonalize(g, method=method, dtype=jnp.float32, gram_form=form)
                    for form in (True, False))
    np.testing.assert_allclose(gram, direct, atol=1e-5)


@pytest.mark.parametrize("dtype, shape, dots", [
    (jnp.float32, (16, 8), 1 + 3 + 4 * 4 + 2 + 1),  # wide enough: Gram form, T = 6
    (jnp.float32, (8, 12), 3 * 6),  # aspect 1.5: direct
    (jnp.float16, (16, 8), 3 * 6),  # half precision: always direct
])
def test_gram_form_only_for_float32_matrices_twice_as_wide(dtype, shape, dots):
    jaxpr = jax.make_jaxpr(lambda g: muon.orthogonalize(g, dtype=dtype))(jnp.ones(shape))
    assert sum(e.primitive.name == "dot_general" for e in jaxpr.jaxpr.eqns) == dots


def test_auto_iteration_dtype_is_float16_only_where_float16_matmuls_are_native():
    resolve = muon.resolve_iteration_dtype
    assert resolve("auto", "gpu") == jnp.float16  # the report's choice (4.1.1)
    assert resolve("auto", "cpu") == resolve("auto", "tpu") == jnp.float32
    assert resolve("bfloat16", "gpu") == jnp.bfloat16 and resolve("float16", "cpu") == jnp.float16
    with pytest.raises(ValueError, match="iteration_dtype"):
        resolve("float64")
    assert MuonConfig().iteration_dtype == "auto"


def test_checkpoint_with_another_iteration_dtype_resumes():
    """Checkpoints saved with the former float16 default resume under 'auto' (the dtype only
    rounds the iteration; Muon's state is float32 either way)."""
    run = load_run_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    saved = run.to_dict()
    saved["train"]["muon"]["iteration_dtype"] = "float16"
    assert incompatible_fields(saved, run.to_dict()) == []
    saved["train"]["muon"]["steps"] = 5
    assert incompatible_fields(saved, run.to_dict()) == ["train.muon.steps"]


def test_default_muon_iterates_in_the_backends_auto_dtype():
    """float32 on CPU (the suite's backend; `resolve_iteration_dtype` is tested per backend
    above), float16 on GPU: every matmul of the update runs in that dtype."""
    expected = muon.resolve_iteration_dtype("auto")
    assert jax.default_backend() != "cpu" or expected == jnp.float32
    tx = scale_by_muon(**config_to_dict(MuonConfig()))
    g = jnp.ones((12, 8))
    eqns = jax.make_jaxpr(tx.update)(g, tx.init(g)).jaxpr.eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 * 6
    assert all(v.aval.dtype == expected for e in dots for v in (*e.invars, *e.outvars))


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (3, 48, 32), (2, 2, 32, 48)])
def test_float32_iteration_at_least_as_close_to_polar_factor_as_float16(shape):
    """Measured max |error| against the SVD polar factor: float32 4e-4 - 7e-4, float16
    1.9e-3 - 2.6e-3; float32 singular values in [0.9975, 1.0012]."""
    g = _gaussian(shape, seed=1)
    exact = _polar(g)
    out = {d: np.asarray(orthogonalize(jnp.asarray(g), dtype=d))
           for d in (jnp.float16, jnp.float32)}
    err = {d: np.abs(o - exact).max() for d, o in out.items()}
    assert err[jnp.float32] <= err[jnp.float16] and err[jnp.float32] < 1.5e-3, err
    assert np.all(np.abs(_svals(out[jnp.float32]) - 1) < PE_FP16_SV_TOL)


def test_experts_orthogonalised_one_by_one():
    g = jnp.asarray(_gaussian((4, 48, 32), seed=3))
    batched = np.asarray(orthogonalize(g))
    looped = np.stack([np.asarray(orthogonalize(g[e])) for e in range(4)])
    np.testing.assert_allclose(batched, looped, atol=2e-3)
    whole = np.asarray(orthogonalize(g.reshape(4 * 48, 32))).reshape(4, 48, 32)
    assert np.abs(batched - whole).max() > 0.1
    # Each expert's block is orthogonal on its own, which the whole-tensor polar factor is not.
    assert np.abs(_svals(batched) - 1).max() < PE_FP16_SV_TOL
    assert np.abs(_svals(whole) - 1).max() > 0.3


@pytest.mark.parametrize("axes, shape, view", [
    (("layers", "embed", "heads", "head_dim"), (3, 128, 6, 32), MatrixView((3,), 128, 192)),
    (("layers", "heads", "head_dim", "embed"), (3, 6, 32, 128), MatrixView((3,), 192, 128)),
    (("layers", "expert", "embed", "expert_mlp"), (3, 16, 128, 64), MatrixView((3, 16), 128, 64)),
    (("layers", "expert", "expert_mlp", "embed"), (3, 16, 64, 128), MatrixView((3, 16), 64, 128)),
    (("layers", "embed", "expert"), (3, 128, 16), MatrixView((3,), 128, 16)),
    (("mtp_concat", "embed"), (256, 128), MatrixView((), 256, 128)),
    (("embed", "kv_heads", "head_dim"), (128, 2, 32), MatrixView((), 128, 64)),
    (("expert", "embed", "expert_mlp"), (16, 128, 64), MatrixView((16,), 128, 64)),
    (("layers", "mlp", "embed"), (1, 384, 128), MatrixView((1,), 384, 128)),
    (("layers", "embed"), (3, 128), MatrixView((3,), 128, 1)),
    (("heads",), (6,), MatrixView((), 1, 6)),
    (("layers", "o_groups", "o_group_in", "o_lora"), (3, 4, 64, 16), MatrixView((3, 4), 64, 16)),
    (("o_groups", "o_group_in", "o_lora"), (4, 64, 16), MatrixView((4,), 64, 16)),
    (("layers", "hc_streams", "embed", "hc_mix"), (3, 4, 128, 24), MatrixView((3,), 512, 24)),
    (("hc_streams", "embed", "hc_mix"), (4, 128, 4), MatrixView((), 512, 4)),
])
def test_matrix_view(axes, shape, view):
    assert matrix_view(axes, shape) == view


def test_matrix_view_rejects_batch_axes_after_matrix_axes():
    with pytest.raises(ValueError, match="batch axes must come first"):
        matrix_view(("embed", "layers", "mlp"), (8, 2, 4))
    with pytest.raises(ValueError, match="do not match"):
        matrix_view(("embed", "mlp"), (8, 2, 4))


@pytest.mark.parametrize("m, n", [(128, 32), (32, 128), (64, 64)])
def test_update_scale(m, n):
    orthogonal = _polar(_gaussian((m, n)))
    rms = np.sqrt(np.mean(np.square(orthogonal * update_scale(m, n, update_rms=0.2))))
    assert rms == pytest.approx(0.2, rel=1e-6)
    # Original Muon: sqrt(max(1, fan_out / fan_in)); flax kernels are [fan_in, fan_out].
    assert update_scale(m, n, update_rms=0.0) == pytest.approx(np.sqrt(max(1, n / m)))


def test_scale_by_muon_per_expert_views_and_rms():
    """An expert weight [L, E, D, F] is orthogonalised per (layer, expert) and scaled to RMS 0.2;
    momentum is float32 whatever the gradient dtype."""
    axes = {"experts": ("layers", "expert", "embed", "expert_mlp"),
            "o_proj": ("heads", "head_dim", "embed")}
    grads = {"experts": jnp.asarray(_gaussian((2, 3, 32, 48), seed=4), jnp.bfloat16),
             "o_proj": jnp.asarray(_gaussian((4, 8, 40), seed=5))}
    tx = scale_by_muon(axes, nesterov=False)
    state = tx.init(grads)
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(state))
    updates, state = jax.jit(tx.update)(grads, state)
    assert updates["experts"].dtype == jnp.bfloat16
    experts = np.asarray(updates["experts"], np.float32)
    expected = np.stack([[_polar(np.asarray(grads["experts"][l, e], np.float32))
                          for e in range(3)] for l in range(2)]) * 0.2 * np.sqrt(48)
    np.testing.assert_allclose(experts, expected, atol=0.02)
    o_proj = np.asarray(updates["o_proj"]).reshape(32, 40)
    np.testing.assert_allclose(o_proj, _polar(_gaussian((4, 8, 40), seed=5).reshape(32, 40))
                               * 0.2 * np.sqrt(40), atol=5e-3)
    assert np.sqrt(np.mean(o_proj**2)) == pytest.approx(0.2, rel=5e-3)


def test_scale_by_muon_momentum_and_nesterov():
    """Momentum M <- mu M + (1 - mu) G; with Nesterov the direction is (1 - mu) G + mu M."""
    g1, g2 = _gaussian((16, 8), seed=6), _gaussian((16, 8), seed=7)
    mu = 0.9
    for nesterov in (False, True):
        tx = scale_by_muon(momentum=mu, nesterov=nesterov, update_rms=0.0)
        state = tx.init(jnp.zeros((16, 8)))
        update_fn = jax.jit(tx.update)
        _, state = update_fn(jnp.asarray(g1), state)
        update, state = update_fn(jnp.asarray(g2), state)
        m = mu * (1 - mu) * g1 + (1 - mu) * g2
        np.testing.assert_allclose(state.momentum, m, rtol=1e-5, atol=1e-6)
        direction = (1 - mu) * g2 + mu * m if nesterov else m
        np.testing.assert_allclose(update, _polar(direction), atol=5e-3)


def test_scale_by_muon_skips_masked_params():
    params = {"w": jnp.ones((8, 4)), "b": jnp.ones((4,))}
    tx = optax.partition({"muon": scale_by_muon(), "none": optax.set_to_zero()},
                         {"w": "muon", "b": "none"})
    grads = {"w": jnp.asarray(_gaussian((8, 4))), "b": jnp.ones((4,))}
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert np.all(np.asarray(updates["b"]) == 0)
    assert np.sqrt(np.mean(np.square(updates["w"]))) == pytest.approx(0.2, rel=5e-3)


def test_large_stacks_are_orthogonalised_in_slices_without_a_mesh(monkeypatch):
    """Slicing the stack (to bound the iteration's temporaries) changes nothing computed."""
    x = jax.random.normal(jax.random.key(3), (7, 3, 8, 12), jnp.float32)
    whole = muon.orthogonalize(x, dtype=jnp.float32)
    monkeypatch.setattr(muon, "STACK_CHUNK_ELEMENTS", 2 * 3 * 8 * 12)  # slices of 2 matrices' stacks
    sliced = jax.jit(lambda x: muon._orthogonalize_stack(x, dtype=jnp.float32))
    assert "scan" in str(jax.make_jaxpr(sliced)(x))  # 3 slices of 2 and the last one
    np.testing.assert_allclose(np.asarray(sliced(x)), np.asarray(whole), rtol=1e-5, atol=1e-6)
