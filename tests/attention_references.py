"""Independent float64 attention references shared by tests/model/test_attention_cores.py and
tests/model/test_attention_module.py: numpy with an explicit per-query list of visible keys (query
i sees key j iff j <= i, i - j < W and same segment), KV heads repeated explicitly for GQA (query
head h uses KV head h // G), the sink as one extra softmax logit whose value vector is zero; and
the tolerance check both use. Nothing here imports `model/`."""

import jax
import jax.numpy as jnp
import numpy as np

TOL = 1e-5


def assert_close(actual, expected, tol=TOL, err_msg=""):
    """|actual - expected| <= tol * (|expected| + max|expected|): relative to the magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=err_msg)


# ---- independent float64 references ----------------------------------------------------------


def visible_keys(i, length, window, segment_row):
    """Key indices query i may attend to, written straight from the spec."""
    return [
        j for j in range(length)
        if j <= i
        and (window is None or i - window < j)
        and (segment_row is None or segment_row[i] == segment_row[j])
    ]


def reference_attention(q, k, v, window=None, segment_ids=None, sink=None):
    """q [B,T,H,D], k [B,T,K,D], v [B,T,K,Dv] -> [B,T,H,Dv] float64; loops over batch and
    query."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, length, heads, dim = q.shape
    groups = heads // k.shape[2]
    k = np.repeat(k, groups, axis=2)  # head h -> KV head h // groups
    v = np.repeat(v, groups, axis=2)
    out = np.zeros((batch, length, heads, v.shape[-1]))
    for b in range(batch):
        seg_row = None if segment_ids is None else np.asarray(segment_ids)[b]
        for i in range(length):
            keys = visible_keys(i, length, window, seg_row)
            logits = np.einsum("hd,jhd->hj", q[b, i], k[b, keys]) / np.sqrt(dim)
            if sink is not None:  # one extra logit per head with a zero value vector
                logits = np.concatenate([logits, np.asarray(sink, np.float64)[:, None]], axis=1)
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            out[b, i] = np.einsum("hj,jhd->hd", probs[:, : len(keys)], v[b, keys])
    return out


def visibility_mask(length, window, segment_ids, batch):
    """[B, T, T] bool, built entry by entry from `visible_keys`."""
    mask = np.zeros((batch, length, length), bool)
    for b in range(batch):
        seg_row = None if segment_ids is None else np.asarray(segment_ids)[b]
        for i in range(length):
            mask[b, i, visible_keys(i, length, window, seg_row)] = True
    return mask


def jnp_reference_attention(q, k, v, sink, mask):
    """Differentiable masked-softmax attention (used in float64 under jax.enable_x64)."""
    heads, dim = q.shape[2], q.shape[3]
    groups = heads // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dim)
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    sink_col = jnp.broadcast_to(sink[None, :, None, None], logits.shape[:-1] + (1,))
    logits = jnp.concatenate([logits, sink_col], axis=-1)
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", probs[..., :-1], v)


def segments_from_boundaries(length, boundaries):
    """Segment ids 0, 1, 2, ... starting a new document at each boundary index."""
    seg = np.zeros(length, np.int32)
    for start in boundaries:
        seg[start:] += 1
    return seg


def positions_restarting(segment_row, offset=0):
    """Position within the document (restarts at each segment change), plus a constant offset."""
    pos = np.zeros(len(segment_row), np.int32)
    for i in range(1, len(segment_row)):
        pos[i] = 0 if segment_row[i] != segment_row[i - 1] else pos[i - 1] + 1
    return pos + offset


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))
