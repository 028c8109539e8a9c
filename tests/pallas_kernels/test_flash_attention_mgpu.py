"""The Mosaic GPU flash attention (pallas_kernels/flash_attention_mgpu.py) on a CPU-only machine.

JAX 0.10.2's Mosaic GPU interpreter cannot run these kernels (no transposed or register wgmma
operands, no layout casts), so their numbers are checked on the device by `make gpu-check`.
What is checked here:
- every kernel lowers to Mosaic GPU for CUDA (forward, dq, dk/dv: three `mosaic_gpu` custom
  calls, no Triton) across the features and head dims, and oversized blocks are refused with
  a one-line error before lowering;
- the block schedule the kernels walk (`mgpu_attention_common.steps` over `kv_block_range` /
  `q_block_range`): every block holding a visible (query, key) pair is computed, blocks run
  without a mask have every pair visible, skipped blocks none;
- everything around the kernels (padding T to the tiles, the sink folded from the
  log-sum-exp, base-2 statistics, delta, the sink gradient, GQA shapes), with the two kernel
  calls swapped for dense stand-ins that keep their contract, against the plain-jnp reference;
- which family `attention_impl=pallas` picks: Mosaic on sm90 for what it takes, else Triton.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention_mgpu as fm
from pallas_kernels import mgpu_attention_common as mc
from pallas_kernels.attention import kernel_family
from pallas_kernels.flash_attention import kv_block_range, q_block_range
from pallas_kernels.flash_attention_blocks import load_table, mosaic_blocks
from pallas_kernels.reference import attention_mask, attention_reference

H100, A100 = (9, 0), (8, 0)


def shapes(length, heads, kv_heads, head_dim, v_dim, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((1, length, heads, head_dim), dtype),
            jax.ShapeDtypeStruct((1, length, kv_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((1, length, kv_heads, v_dim), dtype))


@pytest.mark.slow
def test_kernels_lower_to_mosaic_gpu_for_cuda_with_every_feature():
    cases = [  # (T, H, K, Dk, Dv, window, segments, sink)
        (300, 4, 4, 128, 128, None, False, True),  # T off the tiles, full causal, sink
        (512, 6, 2, 192, 128, 64, True, False),  # MiMo's dims, SWA, segment ids, GQA
        (256, 2, 1, 256, 256, 100, True, True),  # one compute warpgroup at D = 256
    ]
    for length, heads, kv_heads, head_dim, v_dim, window, segments, sink in cases:
        q, k, v = shapes(length, heads, kv_heads, head_dim, v_dim)
        seg = jax.ShapeDtypeStruct((1, length), jnp.int32) if segments else None
        sink_arg = jax.ShapeDtypeStruct((heads,), jnp.float32) if sink else None

        def loss(q, k, v, seg, sink_arg, window=window):
            out = fm.mgpu_flash_attention(q, k, v, window=window, segment_ids=seg, sink=sink_arg)
            return jnp.sum(out.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4) if sink else (0, 1, 2)))
        text = grad.trace(q, k, v, seg, sink_arg).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 3, (head_dim, window)
        assert "triton" not in text


def test_bad_blocks_and_inputs_get_one_line_errors_before_lowering():
    q, k, v = shapes(256, 2, 2, 256, 256)
    big = (mc.Blocks(64, 128, 2, 2),) * 3  # 2 x (Q + O) + 2 x (K + V) at D = 256: 384 KiB
    with pytest.raises(ValueError, match="KiB of shared memory"):
        jax.jit(lambda q, k, v: fm.mgpu_flash_attention(q, k, v, blocks=big)).trace(q, k, v)
    with pytest.raises(ValueError, match="block: a power of two multiple of 64"):
        fm.mgpu_flash_attention(q, k, v, blocks=(mc.Blocks(96, 64),) * 3)
    q32, k32, v32 = shapes(256, 2, 2, 128, 128, jnp.float32)
    with pytest.raises(ValueError, match="16-bit"):
        fm.mgpu_flash_attention(q32, k32, v32)
    q, k, v = shapes(256, 2, 1, 512, 512)  # DeepSeek-V4's shared KV: registers cannot hold it
    assert "multiples of 64 up to 256" in fm.unsupported_reason(q, k, v)


def test_committed_block_table_fits_shared_memory_and_says_whether_it_was_measured():
    table = load_table()
    assert "status" in table and table["entries"]["default"]
    for dims in ((128, 128), (192, 128), (256, 256), (64, 64)):
        forward, dq, dkv = mosaic_blocks(*dims)
        head_dim, v_dim = dims
        for name, blocks, own, streamed in (
                ("forward", forward, [(forward.block, head_dim), (forward.block, v_dim), (64,)],
                 [(forward.stream, head_dim), (forward.stream, v_dim)]),
                ("dq", dq, [(dq.block, head_dim), (dq.block, v_dim), (64,), (64,)],
                 [(dq.stream, head_dim), (dq.stream, v_dim)]),
                ("dkv", dkv, [(dkv.block, head_dim), (dkv.block, v_dim)],
                 [(dkv.stream, head_dim), (dkv.stream, v_dim), (64,), (64,)])):
            # with segment ids: one int32 vector more per warpgroup and per slot
            mc.check_smem(name, mc.smem_bytes(own + [(64,)], streamed + [(64,)], blocks), blocks)


def _classified(walk: mc.Steps) -> dict[int, str]:
    kinds = {}
    for start, stop, kind in walk.ranges():
        for index in range(int(start), int(stop)):
            assert index not in kinds
            kinds[index] = kind
    return kinds


def _check_block(kind, pairs_visible):
    if kind == "plain":
        assert pairs_visible.all()
    elif kind == "skip":
        assert not pairs_visible.any()


@pytest.mark.parametrize("length,window,block,stream,wgs", [
    (500, None, 64, 128, 2), (512, 64, 64, 64, 2), (700, 200, 64, 128, 2),
    (384, 100, 128, 64, 1), (256, 32, 64, 64, 2)])
def test_block_schedule_computes_every_visible_pair_and_masks_only_where_needed(
        length, window, block, stream, wgs):
    rows = np.arange(length)
    visible = np.asarray(attention_mask(length, window, None)[0])  # [T, T] real rows only
    blocks = mc.Blocks(block, stream, wgs)
    padded = -(-length // blocks.tile) * blocks.tile
    for tile in range(padded // blocks.tile):  # forward / dq: rows own, KV blocks streamed
        first, last = kv_block_range(tile, blocks.tile, stream, window, length)
        for wg in range(wgs):
            row0 = tile * blocks.tile + wg * block
            own = kv_block_range(tile * wgs + wg, block, stream, window, length)
            plain = mc.plain_blocks(row0, block, stream, window)
            kinds = _classified(mc.steps(first, last, *own, *plain, masked_only=False))
            assert sorted(kinds) == list(range(first, last + 1))
            q_rows = rows[row0:row0 + block]
            for kv in range(-(-length // stream)):
                pairs = visible[q_rows][:, kv * stream:(kv + 1) * stream]
                if pairs.any():
                    assert kinds.get(kv) in ("masked", "plain"), (tile, wg, kv)
                if kv in kinds:
                    _check_block(kinds[kv], pairs)
    for tile in range(padded // blocks.tile):  # dk/dv: keys own, query blocks streamed
        first, last = q_block_range(tile, stream, blocks.tile, window, length)
        for wg in range(wgs):
            key0 = tile * blocks.tile + wg * block
            own = q_block_range(tile * wgs + wg, stream, block, window, length)
            plain = mc.plain_query_blocks(key0, block, stream, window, last)
            kinds = _classified(mc.steps(first, last, *own, *plain, masked_only=False))
            for qb in range(-(-length // stream)):
                pairs = visible[qb * stream:(qb + 1) * stream, key0:key0 + block]
                if pairs.any():
                    assert kinds.get(qb) in ("masked", "plain"), (tile, wg, qb)
                if qb in kinds:
                    _check_block(kinds[qb], pairs)
    with_segments = mc.steps(0, 5, 1, 4, 2, 3, masked_only=True)
    assert set(_classified(with_segments).values()) == {"skip", "masked"}


def _dense_forward(q, k, v, segment_ids, cfg):
    """The forward kernel's contract on padded inputs: (out without the sink, base-2 lse
    without the sink [B, H, T])."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * q.shape[-1] ** -0.5
    mask = attention_mask(q.shape[1], cfg.window, segment_ids)[:, None]
    scores = jnp.where(mask, scores, -1e30)
    lse = jax.nn.logsumexp(scores, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", jnp.exp(scores - lse[..., None]), v)
    return out.astype(q.dtype), lse * mc.LOG2E


def _dense_backward(q, k, v, d_out, lse2, delta, segment_ids, cfg):
    """The backward kernels' contract: P = 2^(S·c - lse₂) with lse₂ holding the sink mass."""
    groups = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5
    kr, vr = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kr) * scale
    mask = attention_mask(q.shape[1], cfg.window, segment_ids)[:, None]
    p = jnp.where(mask, jnp.exp2(scores * mc.LOG2E - lse2[..., None]), 0.0)
    dp = jnp.einsum("bthd,bshd->bhts", d_out.astype(jnp.float32), vr)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bhts,bshd->bthd", ds, kr) * scale

    def per_kv_head(x):  # [B, T, H, D] -> [B, T, K, D], summed over each group
        return x.reshape(*x.shape[:2], k.shape[2], groups, x.shape[-1]).sum(axis=3)

    dk = per_kv_head(jnp.einsum("bhts,bthd->bshd", ds, q.astype(jnp.float32)) * scale)
    dv = per_kv_head(jnp.einsum("bhts,bthd->bshd", p, d_out.astype(jnp.float32)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@pytest.mark.parametrize("window,with_segments,with_sink", [
    (None, False, True), (5, True, True)])
def test_wrapper_pads_folds_the_sink_and_differentiates_like_the_reference(
        monkeypatch, window, with_segments, with_sink):
    monkeypatch.setattr(fm, "forward", _dense_forward)
    monkeypatch.setattr(fm, "backward", _dense_backward)
    length, heads, kv_heads, head_dim, v_dim = 37, 4, 2, 8, 6  # T off the 128-row tiles
    rng = np.random.default_rng(0)
    q, k, v, cot = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (
        (2, length, heads, head_dim), (2, length, kv_heads, head_dim),
        (2, length, kv_heads, v_dim), (2, length, heads, v_dim)))
    segment_ids = (jnp.asarray((np.arange(length)[None] >= [[11], [25]]).astype(np.int32))
                   if with_segments else None)
    sink = jnp.asarray(rng.uniform(-1, 2, size=heads), jnp.float32) if with_sink else None
    blocks = (mc.Blocks(64, 64), mc.Blocks(64, 64), mc.Blocks(64, 64))
    cfg = fm.MosaicConfig(length, window, *blocks)
    assert cfg.padded_len == 128

    def loss(attend, q, k, v, sink):
        return jnp.sum(attend(q, k, v, sink) * cot)

    ours = lambda q, k, v, sink: fm._flash(q, k, v, segment_ids, sink, cfg)  # noqa: E731
    ref = lambda q, k, v, sink: attention_reference(  # noqa: E731
        q, k, v, window=window, segment_ids=segment_ids, sink=sink)
    argnums = (0, 1, 2, 3) if with_sink else (0, 1, 2)
    def outputs(attend):
        return jax.jit(lambda *a: (attend(*a), jax.grad(
            lambda *b: loss(attend, *b), argnums=argnums)(*a)))(q, k, v, sink)

    got, want = outputs(ours), outputs(ref)
    assert len(jax.tree.leaves(got)) == 1 + len(argnums)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_pallas_picks_mosaic_on_sm90_for_what_it_takes_and_triton_elsewhere():
    bf16 = shapes(256, 4, 2, 128, 128)
    mimo = shapes(256, 4, 2, 192, 128)
    assert kernel_family(*bf16, H100) == kernel_family(*mimo, H100) == "mosaic"
    assert kernel_family(*bf16, A100) == kernel_family(*bf16, None) == "triton"
    assert kernel_family(*shapes(256, 4, 2, 128, 128, jnp.float32), H100) == "triton"
    assert kernel_family(*shapes(256, 4, 1, 512, 512), H100) == "triton"  # V4's 512
