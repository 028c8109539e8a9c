"""Backward kernels of the Mosaic GPU flash attention (pallas_kernels/flash_attention_mgpu.py):
FlashAttention-2's recomputation, warp-specialised as the forward (`mgpu_attention_common`).

- dq, grid (H, T / tile, B): each compute warpgroup owns `block` query rows of one head and
  walks the KV blocks `kv_block_range` gives (streamed by the memory warpgroup with their
  segment ids): S = Q Kᵀ, P = 2^(S·c - lse₂), dP = dO Vᵀ, dS = P (dP - delta), dQ += dS K.
- dk/dv, grid (K, T / tile, B): each compute warpgroup owns `block` KV rows of one KV head and
  walks, for each of the G query heads of its group, the query blocks `q_block_range` gives
  (streamed with lse, delta and segment ids): Sᵀ = K Qᵀ, Pᵀ = 2^(Sᵀ·c - lse₂), dV += Pᵀ dO,
  dPᵀ = V dOᵀ, dSᵀ = Pᵀ (dPᵀ - delta), dK += dSᵀ Q. dK/dV are summed over the group in
  registers and written once per KV head.
lse₂ is the base-2 log-sum-exp including the sink mass, so the sink needs nothing here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mgpu_attention_common as mc
from pallas_kernels.flash_attention import kv_block_range, q_block_range


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref, dq_ref,
               *scratch, cfg, groups: int):
    blocks, has_seg = cfg.dq, q_seg_ref is not None
    bq, bk = blocks.block, blocks.stream
    (q_smem, do_smem, lse_smem, delta_smem, *q_seg_smem), own_loaded, ring_smem, loaded, \
        consumed = scratch
    ring = mc.Ring(tuple(ring_smem), tuple(loaded), consumed, blocks.stages)
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    tile, wg = lax.axis_index("tile"), lax.axis_index("wg")
    first, last = kv_block_range(tile, blocks.tile, bk, cfg.window, cfg.seq_len)
    scale = q_ref.shape[-1] ** -0.5

    @pl.when(wg < blocks.compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        row0 = tile * blocks.tile + wg * bq
        rows = pl.ds(row0, bq)
        pairs = [(q_ref.at[batch, rows, head], q_smem), (do_ref.at[batch, rows, head], do_smem),
                 (lse_ref.at[batch, head, rows], lse_smem),
                 (delta_ref.at[batch, head, rows], delta_smem)]
        if has_seg:
            pairs.append((q_seg_ref.at[batch, rows], q_seg_smem[0]))
        mc.own_copies(pairs, own_loaded, wg)

        lse, delta = mc.load_vector(lse_smem.at[wg], 0), mc.load_vector(delta_smem.at[wg], 0)
        q_seg = mc.load_vector(q_seg_smem[0].at[wg], 0) if has_seg else None
        own_first, own_last = kv_block_range(tile * blocks.compute_wgs + wg, bq, bk, cfg.window,
                                             cfg.seq_len)
        plain_first, plain_last = mc.plain_blocks(row0, bq, bk, cfg.window)
        walk = mc.steps(first, last, own_first, own_last, plain_first, plain_last, has_seg)

        def step(kv_block, slot, masked, dq):
            k_smem, v_smem = ring.smem[0].at[slot], ring.smem[1].at[slot]
            shape = (bq, bk)
            p = jnp.exp2(mc.matmul(q_smem.at[wg], mc.transposed(k_smem), shape)
                         * (scale * mc.LOG2E) - mc.broadcast(lse, shape, 0))
            if masked:
                segs = ((mc.broadcast(q_seg, shape, 0),
                         mc.broadcast(mc.load_vector(ring.smem[2].at[slot], 1), shape, 1))
                        if has_seg else ())
                p = jnp.where(mc.visible(mc.positions(row0, shape, 0),
                                         mc.positions(kv_block * bk, shape, 1), cfg.window,
                                         *segs), p, 0.0)
            dp = mc.matmul(do_smem.at[wg], mc.transposed(v_smem), shape)
            ds = p * (dp - mc.broadcast(delta, shape, 0))
            return mc.matmul(ds.astype(k_smem.dtype), k_smem, dq.shape, dq)

        dq = mc.walk(ring, walk, step, mc.zeros((bq, q_ref.shape[-1])), origin=first,
                     index_of=lambda i: i)
        q_smem.at[wg][...] = (dq * scale).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[batch, rows, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == blocks.compute_wgs)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.asarray(groups, head.dtype))

        def sources(i):
            keys = pl.ds((first + i) * bk, bk)
            views = [k_ref.at[batch, keys, kv_head], v_ref.at[batch, keys, kv_head]]
            return views + ([k_seg_ref.at[batch, keys]] if has_seg else [])

        ring.feed(sources, last - first + 1)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, k_seg_ref,
                dk_ref, dv_ref, *scratch, cfg, groups: int):
    blocks, has_seg = cfg.dkv, q_seg_ref is not None
    bk, bq = blocks.block, blocks.stream
    (k_smem, v_smem, *k_seg_smem), own_loaded, ring_smem, loaded, consumed = scratch
    ring = mc.Ring(tuple(ring_smem), tuple(loaded), consumed, blocks.stages)
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    tile, wg = lax.axis_index("tile"), lax.axis_index("wg")
    first, last = q_block_range(tile, bq, blocks.tile, cfg.window, cfg.seq_len)
    per_head = last - first + 1  # streamed steps per query head of the group
    scale = q_ref.shape[-1] ** -0.5

    @pl.when(wg < blocks.compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        key0 = tile * blocks.tile + wg * bk
        keys = pl.ds(key0, bk)
        pairs = [(k_ref.at[batch, keys, kv_head], k_smem), (v_ref.at[batch, keys, kv_head], v_smem)]
        if has_seg:
            pairs.append((k_seg_ref.at[batch, keys], k_seg_smem[0]))
        mc.own_copies(pairs, own_loaded, wg)
        k_seg = mc.load_vector(k_seg_smem[0].at[wg], 0) if has_seg else None
        own_first, own_last = q_block_range(tile * blocks.compute_wgs + wg, bq, bk, cfg.window,
                                            cfg.seq_len)
        plain_first, plain_last = mc.plain_query_blocks(key0, bk, bq, cfg.window, last)
        shape = (bk, bq)
        walk = mc.steps(0, per_head - 1, own_first - first, own_last - first,
                        plain_first - first, plain_last - first, has_seg)

        def columns_of(buffer, slot):
            return mc.broadcast(mc.load_vector(buffer.at[slot], 1), shape, 1)

        def step(q_block, slot, masked, carry):
            dk, dv = carry
            q_smem, do_smem = ring.smem[0].at[slot], ring.smem[1].at[slot]
            s_t = mc.matmul(k_smem.at[wg], mc.transposed(q_smem), shape)
            p_t = jnp.exp2(s_t * (scale * mc.LOG2E) - columns_of(ring.smem[2], slot))
            if masked:
                segs = ((columns_of(ring.smem[4], slot), mc.broadcast(k_seg, shape, 0))
                        if has_seg else ())
                p_t = jnp.where(mc.visible(mc.positions(q_block * bq, shape, 1),
                                           mc.positions(key0, shape, 0), cfg.window, *segs),
                                p_t, 0.0)
            dv = mc.matmul(p_t.astype(do_smem.dtype), do_smem, dv.shape, dv)
            dp_t = mc.matmul(v_smem.at[wg], mc.transposed(do_smem), shape)
            ds_t = p_t * (dp_t - columns_of(ring.smem[3], slot))
            dk = mc.matmul(ds_t.astype(q_smem.dtype), q_smem, dk.shape, dk)
            return dk, dv

        def one_head(g, carry):
            # Ring step of (head g, query block b): g * per_head + b - first.
            offset = g * per_head
            shifted = mc.Steps(*(bound + offset for bound in walk))
            return mc.walk(ring, shifted, step, carry, origin=0,
                           index_of=lambda i: i - offset + first)

        carry = (mc.zeros((bk, k_ref.shape[-1])), mc.zeros((bk, v_ref.shape[-1])))
        dk, dv = lax.fori_loop(0, groups, one_head, carry)
        k_smem.at[wg][...] = (dk * scale).astype(k_smem.dtype)
        v_smem.at[wg][...] = dv.astype(v_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[batch, keys, kv_head])
        plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[batch, keys, kv_head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == blocks.compute_wgs)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def sources(i):
            head = kv_head * groups + lax.div(i, per_head)
            rows = pl.ds((first + lax.rem(i, per_head)) * bq, bq)
            views = [q_ref.at[batch, rows, head], do_ref.at[batch, rows, head],
                     lse_ref.at[batch, head, rows], delta_ref.at[batch, head, rows]]
            return views + ([q_seg_ref.at[batch, rows]] if has_seg else [])

        ring.feed(sources, groups * per_head)


def backward(q, k, v, d_out, lse2, delta, segment_ids, cfg):
    """Padded inputs (T = cfg.padded_len); lse2 [B, H, T] base-2 log-sum-exp with the sink
    mass, delta [B, H, T] = rowsum(dO · O) -> (dq, dk, dv) in the dtypes of q, k, v."""
    batch, length, heads, head_dim = q.shape
    kv_heads, v_dim = k.shape[2], v.shape[-1]
    groups, has_seg, dtype = heads // kv_heads, segment_ids is not None, q.dtype
    args = (q, k, v, d_out, lse2, delta, segment_ids, segment_ids)

    blocks = cfg.dq
    bq, bk = blocks.block, blocks.stream
    own = [(bq, head_dim), (bq, v_dim), (bq,), (bq,)] + [(bq,)] * has_seg
    streamed = [(bk, head_dim), (bk, v_dim)] + [(bk,)] * has_seg
    mc.check_smem("dq", mc.smem_bytes(own, streamed, blocks), blocks)
    own_scratch = [plgpu.SMEM((blocks.compute_wgs, bq, head_dim), dtype, transforms=mc.TILE),
                   plgpu.SMEM((blocks.compute_wgs, bq, v_dim), dtype, transforms=mc.TILE),
                   plgpu.SMEM((blocks.compute_wgs, bq), jnp.float32),
                   plgpu.SMEM((blocks.compute_wgs, bq), jnp.float32)]
    own_scratch += [plgpu.SMEM((blocks.compute_wgs, bq), jnp.int32)] * has_seg
    ring = mc.ring_scratch([((bk, head_dim), dtype), ((bk, v_dim), dtype)]
                           + [((bk,), jnp.int32)] * has_seg, blocks)
    dq = plgpu.kernel(
        functools.partial(_dq_kernel, cfg=cfg, groups=groups),
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=[own_scratch, plgpu.Barrier(num_barriers=(len(own), blocks.compute_wgs)),
                       *ring],
        grid=(heads, length // blocks.tile, batch), grid_names=("heads", "tile", "batch"),
        num_threads=blocks.compute_wgs + 1, thread_name="wg",
        compiler_params=mc.compiler_params(),
    )(*args)

    blocks = cfg.dkv
    bk, bq = blocks.block, blocks.stream
    own = [(bk, head_dim), (bk, v_dim)] + [(bk,)] * has_seg
    streamed = [(bq, head_dim), (bq, v_dim), (bq,), (bq,)] + [(bq,)] * has_seg
    mc.check_smem("dkv", mc.smem_bytes(own, streamed, blocks), blocks)
    own_scratch = [plgpu.SMEM((blocks.compute_wgs, bk, head_dim), k.dtype, transforms=mc.TILE),
                   plgpu.SMEM((blocks.compute_wgs, bk, v_dim), v.dtype, transforms=mc.TILE)]
    own_scratch += [plgpu.SMEM((blocks.compute_wgs, bk), jnp.int32)] * has_seg
    ring = mc.ring_scratch([((bq, head_dim), dtype), ((bq, v_dim), dtype),
                            ((bq,), jnp.float32), ((bq,), jnp.float32)]
                           + [((bq,), jnp.int32)] * has_seg, blocks)
    dk, dv = plgpu.kernel(
        functools.partial(_dkv_kernel, cfg=cfg, groups=groups),
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_types=[own_scratch, plgpu.Barrier(num_barriers=(len(own), blocks.compute_wgs)),
                       *ring],
        grid=(kv_heads, length // blocks.tile, batch), grid_names=("heads", "tile", "batch"),
        num_threads=blocks.compute_wgs + 1, thread_name="wg",
        compiler_params=mc.compiler_params(),
    )(*args)
    return dq, dk, dv
