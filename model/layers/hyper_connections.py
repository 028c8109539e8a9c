"""Manifold-constrained hyper-connections, mHC (DeepSeek-V4 report 2.2, eqs. 1-8).

The residual becomes n parallel streams X [B, T, n, D]. Around each sublayer F (attention, FFN)
per-token mappings computed from the RMS-normed flattened streams (eqs. 3-5) collapse the
streams into F's input and write F's output back:

    x        = sum_j pre[j] X[j]                                  A_l X_l of eq. 1
    X'[k]    = post[k] F(x) + sum_j res[j, k] X[j]                eq. 1
    pre      = sigmoid(α_pre  · X̂ W_pre  + S_pre) + eps           eqs. 3, 6
    post     = 2 sigmoid(α_post · X̂ W_post + S_post)              eqs. 5, 7
    res      = Sinkhorn(α_res · Mat(X̂ W_res) + S_res)             eqs. 4, 8

Where the report leaves details open they follow the Hugging Face implementation
(`DeepseekV4HyperConnection`, `DeepseekV4HyperHead`, `DeepseekV4Model.forward`):
- `res[j, k]` weighs source stream j in target stream k, i.e. the transpose of the report's
  B_l; `sum_j res[j, k] = 1` is B_l's row sum (after the last step, exact up to eps).
- Sinkhorn starts with a softmax over k plus eps (eq. 8's exp then T_c), then alternates the
  normalisations, each `m / (sum + eps)`, for `sinkhorn_iters` iterations in all, in float32.
- The RMSNorm of X̂ has no weight (eps: the model's norm eps); the pre mapping carries +eps.
- The embedding enters as n copies (`expand_embeddings`); before the final norm `HyperHead`
  collapses the streams with a pre-like mapping of its own (no post, no res).
- The mappings are float32; the collapse sums in float32, the write-back runs in the streams'
  dtype (mappings cast to it), as upstream.

Parameters (HF tensor `layers.{i}.attn_hc.*` / `layers.{i}.ffn_hc.*`, and `hc_head.*`):
  fn    [n, D, (2+n)n]  W_pre | W_post | W_res columns (HF order pre, post, res), HF `fn`
                        [(2+n)n, n*D] transposed (`Linear(inputs=2)`)       -> Muon
  base  [(2+n)n]        static biases S_pre | S_post | S_res (same order)   -> AdamW
  scale [3]             gates α_pre, α_post, α_res                          -> AdamW
  hc_fn [n, D, n], hc_base [n], hc_scale [1]: HyperHead's, same roles and layouts.
The logical axes give the optimizer's split by rank alone: the `fn` kernels have two matrix
axes (Muon views them as [n*D, width]), biases and gates one.

n = 1 does not reduce to x + F(x) (the gates stay learned and res converges to 1 - eps), so a
plain-residual model builds no hyper-connections at all rather than n = 1 ones.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.layers.common import normal_init
from model.ops.linear import linear

STREAM_AXES = ("hc_streams", "embed", "hc_mix")  # logical axes of fn / hc_fn


class StreamMix(NamedTuple):
    """The write-back mappings of one sublayer, float32."""

    post: jax.Array  # [B, T, n]
    res: jax.Array  # [B, T, n, n], res[..., j, k]: weight of source stream j in target k


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Eq. 8 on res logits [..., n, n] (source j, target k) -> [..., n, n] float32 whose
    columns sum to 1 (up to eps) and rows approximately.

    exp then the first normalisation is a softmax over k (shift-invariant, so exp cannot
    overflow); each of the `iters` iterations normalises over k except the first, then over j.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn: iters must be >= 1, got {iters}")
    m = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
    m = m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    def iteration(_, m):
        m = m / (jnp.sum(m, axis=-1, keepdims=True) + eps)
        return m / (jnp.sum(m, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, iteration, m)


def _normed_mixes(streams: jax.Array, kernel: jax.Array, norm_eps: float) -> jax.Array:
    """X̂ W of eqs. 3-5: streams [B, T, n, D], kernel [n, D, W] -> [B, T, W] float32, X̂ the
    weightless RMSNorm over the flattened n*D values."""
    flat = streams.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(flat), axis=(-2, -1), keepdims=True)
    return linear(flat * jax.lax.rsqrt(mean_square + norm_eps), kernel.astype(jnp.float32), 2)


def stream_mappings(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *,
                    sinkhorn_iters: int, hc_eps: float, norm_eps: float
                    ) -> tuple[jax.Array, StreamMix]:
    """Eqs. 3-8. streams [B, T, n, D]; fn [n, D, (2+n)n]; base [(2+n)n]; scale [3]
    -> (pre [B, T, n], StreamMix), all float32."""
    n = streams.shape[-2]
    mixes = _normed_mixes(streams, fn, norm_eps)
    pre_w, post_w, res_w = jnp.split(mixes, [n, 2 * n], axis=-1)
    pre_s, post_s, res_s = jnp.split(base.astype(jnp.float32), [n, 2 * n])
    pre_a, post_a, res_a = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(pre_a * pre_w + pre_s) + hc_eps
    post = 2.0 * jax.nn.sigmoid(post_a * post_w + post_s)
    res_logits = (res_a * res_w + res_s).reshape(*mixes.shape[:-1], n, n)  # Mat() of eq. 4
    res = sinkhorn(res_logits, sinkhorn_iters, hc_eps)
    return pre, StreamMix(post, res)


def collapse_streams(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """A_l X_l of eq. 1: streams [B, T, n, D], pre [B, T, n] -> [B, T, D] in the streams' dtype
    (summed in float32)."""
    weighted = pre.astype(jnp.float32)[..., None] * streams.astype(jnp.float32)
    return jnp.sum(weighted, axis=-2).astype(streams.dtype)


def expand_streams(streams: jax.Array, y: jax.Array, mix: StreamMix) -> jax.Array:
    """Eq. 1's B_l X_l + C_l y: streams [B, T, n, D], sublayer output y [B, T, D]
    -> [B, T, n, D] in the streams' dtype."""
    dtype = streams.dtype
    carried = jnp.einsum("btjk,btjd->btkd", mix.res.astype(dtype), streams)
    return mix.post.astype(dtype)[..., None] * y.astype(dtype)[..., None, :] + carried


def expand_embeddings(x: jax.Array, hc_mult: int) -> jax.Array:
    """The bottom of the stack: every stream starts as the embedding. [B, T, D] -> [B, T, n, D]."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], hc_mult, x.shape[-1]))


class HyperConnection(nn.Module):
    """One sublayer's mHC (HF `attn_hc` / `ffn_hc`): streams [B, T, n, D] -> (sublayer input
    [B, T, D], StreamMix). Write the sublayer's output back with `expand_streams`:

        x, mix = HyperConnection(...)(streams)
        streams = expand_streams(streams, sublayer(norm(x)), mix)

    Init as upstream's `_init_weights`: fn ~ N(0, init_std), base 0, scale 1."""

    sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    init_std: float = 0.02
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, streams: jax.Array) -> tuple[jax.Array, StreamMix]:
        n, d = streams.shape[-2:]
        width = (2 + n) * n
        fn = self.param("fn", normal_init(self.init_std, STREAM_AXES), (n, d, width),
                        self.param_dtype)
        base = self.param("base", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                               ("hc_mix",)),
                          (width,), self.param_dtype)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(),
                                                                 ("hc_gate",)),
                           (3,), self.param_dtype)
        pre, mix = stream_mappings(streams, fn, base, scale, sinkhorn_iters=self.sinkhorn_iters,
                                   hc_eps=self.hc_eps, norm_eps=self.norm_eps)
        return collapse_streams(streams, pre), mix


def head_collapse(streams: jax.Array, hc_fn: jax.Array, hc_base: jax.Array,
                  hc_scale: jax.Array, *, hc_eps: float, norm_eps: float) -> jax.Array:
    """The streams' last collapse, before the final norm: streams [B, T, n, D]; hc_fn [n, D, n];
    hc_base [n]; hc_scale [1] -> [B, T, D] in the streams' dtype."""
    mixes = _normed_mixes(streams, hc_fn, norm_eps)
    pre = jax.nn.sigmoid(mixes * hc_scale.astype(jnp.float32) + hc_base.astype(jnp.float32))
    return collapse_streams(streams, pre + hc_eps)


class HyperHead(nn.Module):
    """HF `hc_head`: streams [B, T, n, D] -> [B, T, D] (see `head_collapse`). Init as upstream:
    hc_fn ~ N(0, init_std), hc_base 0, hc_scale 1."""

    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    init_std: float = 0.02
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, streams: jax.Array) -> jax.Array:
        n, d = streams.shape[-2:]
        hc_fn = self.param("hc_fn", normal_init(self.init_std, STREAM_AXES), (n, d, n),
                           self.param_dtype)
        hc_base = self.param("hc_base", nn.with_logical_partitioning(
            nn.initializers.zeros_init(), ("hc_mix",)), (n,), self.param_dtype)
        hc_scale = self.param("hc_scale", nn.with_logical_partitioning(
            nn.initializers.ones_init(), ("hc_gate",)), (1,), self.param_dtype)
        return head_collapse(streams, hc_fn, hc_base, hc_scale, hc_eps=self.hc_eps,
                             norm_eps=self.norm_eps)
