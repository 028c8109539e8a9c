"""Flash attention on Mosaic GPU (Hopper: wgmma + TMA), forward and backward, with the semantics
of pallas_kernels/flash_attention.py: q [B, T, H, Dk], k [B, T, K, Dk], v [B, T, K, Dv]
(GQA: query head h reads KV head h // G; Dv may differ from Dk, MiMo-V2-Flash's 192 / 128),
causal with an optional sliding window W (query i sees keys i - W < j <= i), packed-document
segment ids and a per-head sink logit. Scores are scaled by 1/sqrt(Dk); statistics float32.

Why our own kernels rather than JAX's `pallas.ops.gpu.attention_mgpu` (read, built after):
that example has no sliding window, sink or segment ids, no causal backward, one head dim for
q, k and v, float16 scratch buffers only, and sums dK/dV over the G query heads of a group
outside the kernel. What is kept from it: warp specialisation (two compute warpgroups of 64
query rows each and a TMA memory warpgroup, `mgpu_attention_common`), the softmax in base 2
with the scale folded into one multiply, wgmma with P taken from registers.

Added here:
- block skipping: the memory warpgroup streams only the KV blocks `kv_block_range` of the
  Triton kernel returns for the program's rows (SWA: O(T·W) work), and each compute
  warpgroup applies the mask only on blocks that cross the diagonal or the window's far edge
  (`mgpu_attention_common.steps`); with segment ids every block is masked;
- the sink is applied outside the kernels (the kernel's output and log-sum-exp exclude it):
  out = out' · exp(lse' - lse) with lse = logaddexp(lse', sink), an elementwise XLA pass; the
  backward kernels take lse with the sink mass, so they need no sink, and dsink follows
  `flash_attention.sink_gradient`;
- the backward (flash_attention_mgpu_bwd.py): a dq kernel over KV blocks and a dk/dv kernel
  that walks the G query heads of its KV head, so dK/dV are summed in registers.

T is padded to a multiple of every kernel's program rows; padded rows are sliced away (they
add zero to dK/dV: their q and dO are zero). Blocks come from
pallas_kernels/flash_attention_blocks.py (the device-tuned table).

Verified where: lowered to Mosaic GPU for CUDA on a CPU-only machine (JAX 0.10.2 in the tests,
0.11.2 by hand), forward and both backward kernels, every feature and head-dim combination
(tests/pallas_kernels/test_flash_attention_mgpu.py). JAX 0.10.2's Mosaic GPU interpreter
cannot run it (no transposed or register wgmma operands, no layout casts), so the numbers are
checked on the device by `make gpu-check` (`attention_impl=pallas` on sm90).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import mgpu_attention_common as mc
from pallas_kernels.flash_attention import kv_block_range, sink_gradient
from pallas_kernels.flash_attention_mgpu_bwd import backward
from pallas_kernels.saved_names import name_attention


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Static parameters (a custom_vjp nondiff argument)."""

    seq_len: int
    window: int | None
    forward: mc.Blocks  # block: query rows per warpgroup, stream: KV rows per step
    dq: mc.Blocks  # the same roles
    dkv: mc.Blocks  # block: KV rows per warpgroup, stream: query rows per step

    @property
    def padded_len(self) -> int:
        tile = max(b.tile for b in (self.forward, self.dq, self.dkv))
        tile = max(tile, self.forward.stream, self.dq.stream, self.dkv.stream)
        return pl.cdiv(self.seq_len, tile) * tile


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, out_ref, lse_ref, *scratch,
                    cfg: MosaicConfig, groups: int):
    blocks, has_seg = cfg.forward, q_seg_ref is not None
    bq, bk = blocks.block, blocks.stream
    (q_smem, o_smem, lse_smem, *q_seg_smem), own_loaded, ring_smem, loaded, consumed = scratch
    ring = mc.Ring(tuple(ring_smem), tuple(loaded), consumed, blocks.stages)
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    tile, wg = lax.axis_index("tile"), lax.axis_index("wg")
    first, last = kv_block_range(tile, blocks.tile, bk, cfg.window, cfg.seq_len)
    dtype, v_dim = q_ref.dtype, v_ref.shape[-1]
    scale = q_ref.shape[-1] ** -0.5 * mc.LOG2E  # base-2 softmax

    @pl.when(wg < blocks.compute_wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        row0 = tile * blocks.tile + wg * bq
        rows = pl.ds(row0, bq)
        pairs = [(q_ref.at[batch, rows, head], q_smem)]
        if has_seg:
            pairs.append((q_seg_ref.at[batch, rows], q_seg_smem[0]))
        mc.own_copies(pairs, own_loaded, wg)
        q_seg = mc.load_vector(q_seg_smem[0].at[wg], 0) if has_seg else None
        own_first, own_last = kv_block_range(tile * blocks.compute_wgs + wg, bq, bk, cfg.window,
                                             cfg.seq_len)
        plain_first, plain_last = mc.plain_blocks(row0, bq, bk, cfg.window)
        walk = mc.steps(first, last, own_first, own_last, plain_first, plain_last, has_seg)

        def step(kv_block, slot, masked, carry):
            acc, m, l = carry
            k_smem, v_smem = ring.smem[0].at[slot], ring.smem[1].at[slot]
            s = mc.matmul(q_smem.at[wg], mc.transposed(k_smem), (bq, bk)) * scale
            if masked:
                segs = ((mc.broadcast(q_seg, s.shape, 0),
                         mc.broadcast(mc.load_vector(ring.smem[2].at[slot], 1), s.shape, 1))
                        if has_seg else ())
                mask = mc.visible(mc.positions(row0, s.shape, 0),
                                  mc.positions(kv_block * bk, s.shape, 1), cfg.window, *segs)
                s = jnp.where(mask, s, mc.NEG)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - mc.broadcast(m_new, s.shape, 0))
            if masked:  # a row with nothing visible yet keeps l = 0 (not exp2(0) per key)
                p = jnp.where(mask, p, 0.0)
            l = l * alpha + p.sum(axis=1)
            acc = acc * mc.broadcast(alpha, acc.shape, 0)
            acc = mc.matmul(p.astype(dtype), v_smem, (bq, v_dim), acc)
            return acc, m_new, l

        init = (mc.zeros((bq, v_dim)), mc.full_rows(mc.NEG, bq), mc.full_rows(0.0, bq))
        acc, m, l = mc.walk(ring, walk, step, init, origin=first, index_of=lambda i: i)
        l = jnp.where(l > 0, l, 1.0)  # only padded rows see no key
        o_smem.at[wg][...] = (acc / mc.broadcast(l, acc.shape, 0)).astype(dtype)
        lse_smem.at[wg][...] = m + jnp.log2(l)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[batch, rows, head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, rows])
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


def forward(q, k, v, segment_ids, cfg: MosaicConfig):
    """Padded inputs (T = cfg.padded_len) -> (out [B, T, H, Dv] without the sink,
    log2-sum-exp [B, H, T] float32 without the sink)."""
    batch, length, heads, head_dim = q.shape
    kv_heads, v_dim = k.shape[2], v.shape[-1]
    blocks = cfg.forward
    bq, bk, has_seg = blocks.block, blocks.stream, segment_ids is not None
    own = [(bq, head_dim), (bq, v_dim), (bq,)] + [(bq,)] * has_seg
    streamed = [(bk, head_dim), (bk, v_dim)] + [(bk,)] * has_seg
    mc.check_smem("forward", mc.smem_bytes(own, streamed, blocks), blocks)
    dtype = q.dtype
    own_scratch = [plgpu.SMEM((blocks.compute_wgs, bq, head_dim), dtype, transforms=mc.TILE),
                   plgpu.SMEM((blocks.compute_wgs, bq, v_dim), dtype, transforms=mc.TILE),
                   plgpu.SMEM((blocks.compute_wgs, bq), jnp.float32)]
    own_scratch += [plgpu.SMEM((blocks.compute_wgs, bq), jnp.int32)] * has_seg
    ring = mc.ring_scratch([((bk, head_dim), dtype), ((bk, v_dim), dtype)]
                           + [((bk,), jnp.int32)] * has_seg, blocks)
    out, lse = plgpu.kernel(
        functools.partial(_forward_kernel, cfg=cfg, groups=heads // kv_heads),
        out_type=[jax.ShapeDtypeStruct((batch, length, heads, v_dim), dtype),
                  jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
        scratch_types=[own_scratch, plgpu.Barrier(num_barriers=(1 + has_seg, blocks.compute_wgs)),
                       *ring],
        grid=(heads, length // blocks.tile, batch), grid_names=("heads", "tile", "batch"),
        num_threads=blocks.compute_wgs + 1, thread_name="wg",
        compiler_params=mc.compiler_params(),
    )(q, k, v, segment_ids, segment_ids)
    return out, lse


def _pad(x, length: int):
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths)


def _with_sink(out, lse, sink):
    """Folds the sink into the kernel's output [B, T, H, Dv] and natural log-sum-exp
    [B, H, T_padded] (T_padded >= T)."""
    if sink is None:
        return out, lse
    lse_sink = jnp.logaddexp(lse, sink.astype(jnp.float32)[None, :, None])
    factor = jnp.exp(lse - lse_sink)[:, :, : out.shape[1]]  # Z / (Z + e^sink)
    out = (out.astype(jnp.float32) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(out.dtype)
    return out, lse_sink


def _attention(q, k, v, segment_ids, sink, cfg: MosaicConfig):
    """-> (out [B, T, H, Dv], natural lse [B, H, T_padded] with the sink mass)."""
    length = cfg.padded_len
    segments = None if segment_ids is None else _pad(segment_ids.astype(jnp.int32), length)
    out, lse2 = forward(_pad(q, length), _pad(k, length), _pad(v, length), segments, cfg)
    out, lse = _with_sink(out[:, : cfg.seq_len], lse2 / mc.LOG2E, sink)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, segment_ids, sink, cfg: MosaicConfig):
    return _attention(q, k, v, segment_ids, sink, cfg)[0]


def _flash_fwd(q, k, v, segment_ids, sink, cfg: MosaicConfig):
    out, lse = name_attention(*_attention(q, k, v, segment_ids, sink, cfg))  # named for remat
    return out, (q, k, v, segment_ids, sink, out, lse)


def _flash_bwd(cfg: MosaicConfig, residuals, d_out):
    q, k, v, segment_ids, sink, out, lse = residuals
    length = cfg.padded_len
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, H]
    segments = None if segment_ids is None else _pad(segment_ids.astype(jnp.int32), length)
    dq, dk, dv = backward(_pad(q, length), _pad(k, length), _pad(v, length),
                          _pad(d_out.astype(q.dtype), length), lse * mc.LOG2E,
                          jnp.swapaxes(_pad(delta, length), 1, 2), segments, cfg)
    seq = cfg.seq_len
    d_sink = None if sink is None else sink_gradient(sink, lse[:, :, :seq], delta)
    return dq[:, :seq], dk[:, :seq], dv[:, :seq], None, d_sink


_flash.defvjp(_flash_fwd, _flash_bwd)


def unsupported_reason(q, k, v) -> str | None:
    """Why these inputs cannot take the Mosaic GPU kernels (the caller falls back), or None."""
    if q.dtype not in (jnp.bfloat16, jnp.float16) or not q.dtype == k.dtype == v.dtype:
        return f"16-bit q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, dim in (("q/k", q.shape[-1]), ("v", v.shape[-1])):
        if dim % 64 or dim > 256:
            return f"{name} head dim {dim}: the kernels take multiples of 64 up to 256"
    return None


def mgpu_flash_attention(q, k, v, *, window=None, segment_ids=None, sink=None, blocks=None):
    """Causal / sliding-window flash attention on Mosaic GPU (module docstring).

    q [B, T, H, Dk]; k [B, T, K, Dk]; v [B, T, K, Dv] (16-bit, Dk and Dv multiples of 64 up to
    256); segment_ids [B, T] or None; sink [H] or None -> [B, T, H, Dv] in q.dtype,
    differentiable in q, k, v and sink. blocks: (forward, dq, dkv) `Blocks`, default from the
    tuned table (pallas_kernels/flash_attention_blocks.py)."""
    reason = unsupported_reason(q, k, v)
    if reason:
        raise ValueError(f"mgpu_flash_attention: {reason}")
    if blocks is None:
        from pallas_kernels.flash_attention_blocks import mosaic_blocks
        blocks = mosaic_blocks(q.shape[-1], v.shape[-1])
    cfg = MosaicConfig(q.shape[1], window, *blocks)
    for name, block in zip(("forward", "dq", "dkv"), blocks):
        block.check(name)
    return _flash(q, k, v, segment_ids, sink, cfg)
