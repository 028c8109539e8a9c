"""Flash attention for causal full and sliding-window (SWA) layers: Pallas kernels + custom VJP.
The Triton family of `attention_impl=pallas` (pallas_kernels/attention.py picks it everywhere
but on sm90, where flash_attention_mgpu.py runs) and its interpret mode on CPU.

Semantics are those of the XLA attention path (docs/architecture.md, "Exact semantics"):
q [B, T, H, D], k/v [B, T, K, D], H = K * G (GQA: query head h reads KV head h // G, never repeated
in memory). Query i sees key j iff j <= i, i - j < window (None: full causal) and, with segment ids,
both are in the same segment. An optional per-head sink logit adds exp(sink[h]) to every softmax
denominator. Scores are scaled by 1/sqrt(D); softmax statistics and accumulators are float32;
the output has q's dtype.

Grid and loops (Pallas-Triton style, after the FlashAttention-2 paper and the JAX GPU example)
---------------------------------------------------------------------------------------------
- forward, grid (B, H, T/block_q): a program owns one query block of one head. Its K/V
  BlockSpec is the whole (padded) sequence of KV head h // G, and an in-kernel `fori_loop` walks
  only the KV blocks `kv_block_range` returns, keeping the online-softmax state (m, l, acc) in
  registers. It writes the output block and the log-sum-exp `lse` (sink mass included).
- dq, grid (B, H, T/block_q): same loop; recomputes P = exp(S - lse) and accumulates dS K.
- dk/dv, grid (B, K, T/block_k): a program owns one KV block of one KV head and loops over the
  G query heads of its group and the query blocks `q_block_range` returns, so dK/dV are summed
  over the group in registers (no [B, T, H, D] per-query-head partials).
- delta = rowsum(dO * O) and the sink gradient are cheap [B, T, H] reductions left to XLA.

Block skipping comes from one piece of grid logic: `kv_block_range(q_block)` gives the KV blocks
intersecting the union of (i - W, i] over the query block (full causal: blocks 0 .. diagonal),
and `q_block_range(kv_block)` is the same set of (query block, KV block) pairs seen from the
other side. Without segment ids both are exact (every visited pair holds a visible (i, j)), so
SWA work is proportional to T * W and full causal to T^2 / 2; segment boundaries are masked,
not skipped. `visited_blocks` counts the pairs with the same function the kernels use for their
loop bounds. Every visited block is masked elementwise (a mask-free path for fully visible
interior blocks, and processing the G heads of a group in one forward program so each K/V
tile is loaded once per group, are the obvious next optimisations). The backward recomputes
S = Q K^T in both the dq and the dk/dv kernel (7 matmuls per visited block pair, not 5).

T need not be a multiple of the blocks: q is padded to a multiple of block_q and k/v to one of
block_k; loop bounds use the true T, and padded rows are sliced away.

Sink gradient (derivation). With lse_i = log(sum_j exp(s_ij) + exp(sink_h)) and
p_ij = exp(s_ij - lse_i), o_i = sum_j p_ij v_j. Since d lse_i / d sink_h = exp(sink_h - lse_i),
d p_ij / d sink_h = -p_ij exp(sink_h - lse_i), so d o_i / d sink_h = -exp(sink_h - lse_i) o_i and
    dL/d sink_h = -sum_{b, i} exp(sink_h - lse_{b,h,i}) * delta_{b,i,h},  delta = rowsum(dO * O).
The dS = P * (dP - delta) rule for q/k is unchanged by the sink: it only enlarges lse.

Lowering status (nothing here has run on an accelerator; CPU tests use interpret mode)
--------------------------------------------------------------------------------------
- GPU (Pallas Triton): written for it. Loaded tiles are [block, D] and [block] (Triton needs
  power-of-two sizes and tl.dot tiles >= 16, so blocks must be powers of two >= 16 and D a power
  of two); dots are `lax.dot_general` with float32 accumulation (float32 inputs use IEEE, not
  TF32); loop bounds are int32 scalars derived from `pl.program_id`. The tests lower the
  forward and both backward kernels for CUDA on CPU (`.lower(lowering_platforms=("cuda",))`),
  which runs the Pallas-to-Triton-IR lowering; compiling that IR to PTX and running it has not
  been done. Default blocks 64 x 64 with 8 warps at D = 128: one compromise for all three
  kernels (the dk/dv program keeps two [block_k, D] float32 accumulators plus the K and V tiles
  live; the forward alone would prefer block_q = 128). Untuned: tune block_q/block_k on the
  device with benchmarks/pallas_attention.py.
- TPU (Mosaic): this design does NOT lower. Lowering it for TPU stops at the block-shape check
  ("the last two dimensions of your block shape are divisible by 8 and 128 ... or equal to the
  respective dimensions of the overall array"), so `flash_attention` refuses compiled TPU runs
  up front. A TPU version needs:
  1. layout [B, H, T, D] (and [B, K, T, D]) so the two minor block dims are (block, D) instead
     of a squeezed head axis in the second-minor position of [B, T, H, D]; lse/delta as
     [B, H, 1, T] (or lane-broadcast [B, H, T, 128]) and segment ids as [B, T, 128] (queries)
     and [B, 8, T] (keys), as `jax.experimental.pallas.ops.tpu.splash_attention` does.
  2. no whole-sequence K/V blocks (VMEM holds 16-128 MiB; a 64k x 128 bf16 K plus V, double
     buffered, is 64 MiB): the KV loop becomes a trailing "arbitrary" grid axis of length
     max_i |kv_block_range(i)| whose index_map returns `first + min(j, last - first)` (a repeated
     block index skips the DMA) with `pl.when(j <= last - first)` around the compute, and
     m / l / acc in `pltpu.VMEM` scratch, initialised at j == 0 and written out at the last
     step. `kv_block_range` is plain integer arithmetic and serves unchanged in the index_map
     (the dk/dv kernel likewise with `q_block_range` over the group's G heads).
  3. `pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",))`, blocks that
     are multiples of 128 (MXU and lane width) and bf16 inputs.
  Until then use `attention_impl=xla` (or splash attention) on TPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.saved_names import name_attention
from pallas_kernels.target import target_backend

_NEG = -1e30  # finite "minus infinity" for masked scores, as in the XLA attention path
DEFAULT_BLOCKS = {"gpu": (64, 64)}  # (block_q, block_k) per backend (see the docstring)
FALLBACK_BLOCKS = (128, 128)  # interpret mode on CPU
MIN_BLOCK = 16  # tl.dot needs tiles of at least 16 along every dimension


# ---- grid logic: the single source of block skipping ------------------------------------------


def _div(a, b: int):
    """Floor division of a non-negative Python or traced int32 scalar (lax.div truncates,
    which equals floor for non-negative operands and lowers on every backend)."""
    return a // b if isinstance(a, int) else lax.div(a, jnp.asarray(b, a.dtype))


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def kv_block_range(q_block, block_q: int, block_k: int, window: int | None, seq_len: int):
    """Inclusive (first, last) KV blocks with a key visible to some query of `q_block`.

    Queries a..b of the block (b clipped to seq_len - 1) see the keys of the union of
    (i - W, i], i.e. [max(a - W + 1, 0), b]; full causal sees [0, b]. `q_block` may be a
    Python int (counting) or a traced int32 scalar (kernel loop bounds).
    """
    first_query = q_block * block_q
    last_query = _min(first_query + block_q, seq_len) - 1
    last = _div(last_query, block_k)
    if window is None:
        return 0, last
    return _div(_max(first_query - window + 1, 0), block_k), last


def q_block_range(kv_block, block_q: int, block_k: int, window: int | None, seq_len: int):
    """Inclusive (first, last) query blocks with a query that sees some key of `kv_block`:
    the same set of block pairs as `kv_block_range`, enumerated per KV block (keys c..d are
    seen by queries [c, d + W - 1], clipped to the sequence)."""
    first_key = kv_block * block_k
    last_key = _min(first_key + block_k, seq_len) - 1
    last_query = seq_len - 1 if window is None else _min(last_key + window - 1, seq_len - 1)
    return _div(first_key, block_q), _div(last_query, block_q)


def visited_blocks(seq_len: int, window: int | None, block_q: int, block_k: int) -> int:
    """(query block, KV block) pairs the kernels visit per (batch, query head): the forward and
    dq kernels walk exactly these (via kv_block_range), the dk/dv kernel the same pairs (via
    q_block_range, for each of the G query heads of its KV head)."""
    total = 0
    for q_block in range(pl.cdiv(seq_len, block_q)):
        first, last = kv_block_range(q_block, block_q, block_k, window, seq_len)
        total += last - first + 1
    return total


# ---- configuration ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) kernel parameters: a custom_vjp nondiff argument."""

    seq_len: int
    window: int | None
    block_q: int
    block_k: int
    interpret: bool
    backend: str
    poison: bool

    @property
    def num_q_blocks(self) -> int:
        return pl.cdiv(self.seq_len, self.block_q)

    @property
    def num_kv_blocks(self) -> int:
        return pl.cdiv(self.seq_len, self.block_k)

    @property
    def q_len(self) -> int:
        return self.num_q_blocks * self.block_q

    @property
    def kv_len(self) -> int:
        return self.num_kv_blocks * self.block_k

    def kv_range(self, q_block):
        return kv_block_range(q_block, self.block_q, self.block_k, self.window, self.seq_len)

    def q_range(self, kv_block):
        return q_block_range(kv_block, self.block_q, self.block_k, self.window, self.seq_len)


def _pad_seq(x: jax.Array | None, length: int) -> jax.Array | None:
    """Zero-pads axis 1 (the sequence) to `length`."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths)


def _pallas_call(kernel, cfg: _Config, *, name, grid, in_specs, out_specs, out_shape, args,
                 head_dim: int):
    """pl.pallas_call with backend compiler params; with cfg.poison every output starts as a
    NaN buffer aliased into the kernel, so an element the grid never writes stays NaN."""
    compiler_params = None
    if not cfg.interpret and cfg.backend == "gpu":
        from jax.experimental.pallas import triton as plgpu

        warps = 4 if cfg.block_q * cfg.block_k * head_dim <= 64 * 64 * 64 else 8
        compiler_params = plgpu.CompilerParams(num_warps=warps, num_stages=2)
    aliases = {}
    if cfg.poison:
        num_leaves = len(jax.tree.leaves(args))
        aliases = {num_leaves + i: i for i in range(len(out_shape))}
        in_specs = [*in_specs, *[pl.BlockSpec(memory_space=pl.ANY)] * len(out_shape)]
        num_args = len(args)
        args = (*args, *[jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape])
        body = kernel

        def kernel(*refs):  # the poisoned buffers are only there to be aliased
            return body(*refs[:num_args], *refs[num_args + len(out_shape):])

    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, compiler_params=compiler_params,
        interpret=cfg.interpret, name=name,
    )(*args)


# ---- kernel pieces ------------------------------------------------------------------------


def _dot(a, b, contract_a: int, contract_b: int):
    """2-D matmul contracting the given axes, float32 accumulation."""
    dims = (((contract_a,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _visible(q_pos, k_pos, window, q_seg, k_seg):
    """[bq, bk] visibility of keys k_pos from queries q_pos (causal, window, segment)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    if q_seg is not None:
        mask = mask & (q_seg[:, None] == k_seg[None, :])
    return mask


def _positions(block, size):
    return block * size + jnp.arange(size, dtype=jnp.int32)


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, sink_ref, o_ref, lse_ref, *,
                    cfg: _Config):
    block_q, block_k = cfg.block_q, cfg.block_k
    q_block = pl.program_id(2)
    q = q_ref[...]  # [bq, D]
    scale = q.shape[-1] ** -0.5
    q_pos = _positions(q_block, block_q)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    # The sink is an extra logit with a zero value: start the online softmax from it.
    if sink_ref is None:
        m0 = jnp.full((block_q,), _NEG, jnp.float32)
        l0 = jnp.zeros((block_q,), jnp.float32)
    else:
        sink = sink_ref[...].astype(jnp.float32)
        start = jnp.maximum(sink, _NEG)  # sink = -inf: m = _NEG, l = exp(-inf) = 0
        m0 = jnp.full((block_q,), start, jnp.float32)
        l0 = jnp.full((block_q,), jnp.exp(sink - start), jnp.float32)
    acc0 = jnp.zeros(q.shape, jnp.float32)

    def body(kv_block, carry):
        m, l, acc = carry
        keys = pl.ds(pl.multiple_of(kv_block * block_k, block_k), block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        mask = _visible(q_pos, _positions(kv_block, block_k), cfg.window, q_seg, k_seg)
        s = jnp.where(mask, _dot(q, k, 1, 1) * scale, _NEG)  # [bq, bk]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # 0 even if a row is all masked
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v, 1, 0)
        return m_new, l, acc

    first, last = cfg.kv_range(q_block)
    m, l, acc = lax.fori_loop(first, last + 1, body, (m0, l0, acc0))
    l = jnp.where(l > 0, l, 1.0)  # only padded query rows can see nothing
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, dq_ref, *,
               cfg: _Config):
    block_q, block_k = cfg.block_q, cfg.block_k
    q_block = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    scale = q.shape[-1] ** -0.5
    q_pos = _positions(q_block, block_q)
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def body(kv_block, dq):
        keys = pl.ds(pl.multiple_of(kv_block * block_k, block_k), block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_seg = None if kv_seg_ref is None else kv_seg_ref[keys]
        mask = _visible(q_pos, _positions(kv_block, block_k), cfg.window, q_seg, k_seg)
        p = jnp.where(mask, jnp.exp(_dot(q, k, 1, 1) * scale - lse[:, None]), 0.0)
        ds = p * (_dot(do, v, 1, 1) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, 1, 0)

    first, last = cfg.kv_range(q_block)
    dq = lax.fori_loop(first, last + 1, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref,
                dk_ref, dv_ref, *, cfg: _Config, groups: int):
    block_q, block_k = cfg.block_q, cfg.block_k
    kv_block = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    scale = k.shape[-1] ** -0.5
    k_pos = _positions(kv_block, block_k)
    k_seg = None if kv_seg_ref is None else kv_seg_ref[...]
    first, last = cfg.q_range(kv_block)

    def head(g, carry):  # the G query heads sharing this KV head
        def body(q_block, carry):
            dk, dv = carry
            rows = pl.ds(pl.multiple_of(q_block * block_q, block_q), block_q)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            lse, delta = lse_ref[g, rows], delta_ref[g, rows]
            q_seg = None if q_seg_ref is None else q_seg_ref[rows]
            mask = _visible(_positions(q_block, block_q), k_pos, cfg.window, q_seg, k_seg)
            p = jnp.where(mask, jnp.exp(_dot(q, k, 1, 1) * scale - lse[:, None]), 0.0)
            dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
            ds = p * (_dot(do, v, 1, 1) - delta[:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
            return dk, dv

        return lax.fori_loop(first, last + 1, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---- pallas_call wrappers -----------------------------------------------------------------


def _segments(segment_ids, cfg: _Config):
    if segment_ids is None:
        return None, None
    segment_ids = segment_ids.astype(jnp.int32)
    return _pad_seq(segment_ids, cfg.q_len), _pad_seq(segment_ids, cfg.kv_len)


def _forward(q, k, v, segment_ids, sink, cfg: _Config):
    """-> (out [B, T, H, D], lse [B, H, q_len] float32 including the sink mass)."""
    batch, _, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    q_seg, kv_seg = _segments(segment_ids, cfg)
    has_seg = segment_ids is not None
    q_block = pl.BlockSpec((None, cfg.block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    kv_all = pl.BlockSpec((None, cfg.kv_len, None, head_dim),
                          lambda b, h, i: (b, 0, _div(h, groups), 0))
    in_specs = [
        q_block, kv_all, kv_all,
        pl.BlockSpec((None, cfg.block_q), lambda b, h, i: (b, i)) if has_seg else None,
        pl.BlockSpec((None, cfg.kv_len), lambda b, h, i: (b, 0)) if has_seg else None,
        pl.BlockSpec((None,), lambda b, h, i: (h,)) if sink is not None else None,
    ]
    out, lse = _pallas_call(
        functools.partial(_forward_kernel, cfg=cfg), cfg, name="flash_attention_fwd",
        grid=(batch, heads, cfg.num_q_blocks),
        in_specs=in_specs,
        out_specs=[q_block, pl.BlockSpec((None, None, cfg.block_q), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((batch, cfg.q_len, heads, head_dim), q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, cfg.q_len), jnp.float32)],
        args=(_pad_seq(q, cfg.q_len), _pad_seq(k, cfg.kv_len), _pad_seq(v, cfg.kv_len),
              q_seg, kv_seg, None if sink is None else sink.astype(jnp.float32)),
        head_dim=head_dim,
    )
    return out[:, : cfg.seq_len], lse


def _backward(q, k, v, segment_ids, out, lse, d_out, cfg: _Config):
    """-> (dq, dk, dv, delta [B, T, H]) from the FlashAttention-2 recomputation."""
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, H]
    delta_bht = jnp.pad(jnp.swapaxes(delta, 1, 2), ((0, 0), (0, 0), (0, cfg.q_len - length)))
    q_seg, kv_seg = _segments(segment_ids, cfg)
    has_seg = segment_ids is not None
    args = (_pad_seq(q, cfg.q_len), _pad_seq(k, cfg.kv_len), _pad_seq(v, cfg.kv_len),
            _pad_seq(d_out.astype(q.dtype), cfg.q_len), lse, delta_bht, q_seg, kv_seg)

    # dq: one query block of one head per program, loop over its KV blocks.
    q_block = pl.BlockSpec((None, cfg.block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    kv_all = pl.BlockSpec((None, cfg.kv_len, None, head_dim),
                          lambda b, h, i: (b, 0, _div(h, groups), 0))
    row_block = pl.BlockSpec((None, None, cfg.block_q), lambda b, h, i: (b, h, i))
    (dq,) = _pallas_call(
        functools.partial(_dq_kernel, cfg=cfg), cfg, name="flash_attention_dq",
        grid=(batch, heads, cfg.num_q_blocks),
        in_specs=[q_block, kv_all, kv_all, q_block, row_block, row_block,
                  pl.BlockSpec((None, cfg.block_q), lambda b, h, i: (b, i)) if has_seg else None,
                  pl.BlockSpec((None, cfg.kv_len), lambda b, h, i: (b, 0)) if has_seg else None],
        out_specs=[q_block],
        out_shape=[jax.ShapeDtypeStruct((batch, cfg.q_len, heads, head_dim), q.dtype)],
        args=args, head_dim=head_dim,
    )

    # dk/dv: one KV block of one KV head per program, loop over its group's heads and queries.
    group_all = pl.BlockSpec((None, cfg.q_len, groups, head_dim), lambda b, h, j: (b, 0, h, 0))
    group_rows = pl.BlockSpec((None, groups, cfg.q_len), lambda b, h, j: (b, h, 0))
    kv_block = pl.BlockSpec((None, cfg.block_k, None, head_dim), lambda b, h, j: (b, j, h, 0))
    dk, dv = _pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, groups=groups), cfg, name="flash_attention_dkv",
        grid=(batch, kv_heads, cfg.num_kv_blocks),
        in_specs=[group_all, kv_block, kv_block, group_all, group_rows, group_rows,
                  pl.BlockSpec((None, cfg.q_len), lambda b, h, j: (b, 0)) if has_seg else None,
                  pl.BlockSpec((None, cfg.block_k), lambda b, h, j: (b, j)) if has_seg else None],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct((batch, cfg.kv_len, kv_heads, head_dim), k.dtype),
                   jax.ShapeDtypeStruct((batch, cfg.kv_len, kv_heads, head_dim), v.dtype)],
        args=args, head_dim=head_dim,
    )
    return dq[:, :length], dk[:, :length], dv[:, :length], delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, segment_ids, sink, cfg: _Config):
    return _forward(q, k, v, segment_ids, sink, cfg)[0]


def _flash_fwd(q, k, v, segment_ids, sink, cfg: _Config):
    out, lse = name_attention(*_forward(q, k, v, segment_ids, sink, cfg))  # named for remat
    return out, (q, k, v, segment_ids, sink, out, lse)


def _flash_bwd(cfg: _Config, residuals, d_out):
    q, k, v, segment_ids, sink, out, lse = residuals
    dq, dk, dv, delta = _backward(q, k, v, segment_ids, out, lse, d_out, cfg)
    d_sink = None if sink is None else sink_gradient(sink, lse[:, :, : cfg.seq_len], delta)
    return dq, dk, dv, None, d_sink


def sink_gradient(sink, lse, delta):
    """dL/dsink_h = -sum_{b,i} exp(sink_h - lse_{b,h,i}) delta_{b,i,h} (module docstring).
    sink [H]; lse [B, H, T] natural log-sum-exp including the sink; delta [B, T, H]."""
    sink_mass = jnp.exp(sink.astype(jnp.float32)[None, :, None] - lse)
    return -jnp.sum(sink_mass * jnp.swapaxes(delta, 1, 2), axis=(0, 2)).astype(sink.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- public API ---------------------------------------------------------------------------


def _check_block(name: str, block: int, compiled_gpu: bool) -> int:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{name}: expected a positive int, got {block!r}")
    if compiled_gpu and (block < MIN_BLOCK or block & (block - 1)):
        raise ValueError(f"{name}: the Triton kernel needs a power of two >= {MIN_BLOCK}, "
                         f"got {block}")
    return block


def flash_attention(q, k, v, *, window=None, segment_ids=None, sink=None, block_q=None,
                    block_k=None, interpret=None, debug_poison_outputs=False):
    """Causal (window=None) or sliding-window flash attention; see the module docstring.

    q: [B, T, H, D]; k, v: [B, T, K, D] with H % K == 0; segment_ids: [B, T] ints or None;
    sink: [H] per-head logits or None. Returns [B, T, H, D] in q.dtype; differentiable in
    q, k, v and sink. block_q/block_k default per backend (DEFAULT_BLOCKS, capped at the
    sequence length rounded up to a power of two). interpret=None runs the kernels in Pallas
    interpret mode when the default backend is the CPU. debug_poison_outputs (testing aid):
    every kernel output starts as NaN, so an element a kernel never writes stays NaN.
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"flash_attention: expected q [B,T,H,D], k/v [B,T,K,D]; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    batch, length, heads, head_dim = q.shape
    if k.shape[:2] != (batch, length) or k.shape[3] != head_dim or heads % k.shape[2]:
        raise ValueError(f"flash_attention: k/v {k.shape} do not match q {q.shape} "
                         f"(same B, T, D and H a multiple of K)")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected None or a positive int, got {window!r}")
    if segment_ids is not None and segment_ids.shape != (batch, length):
        raise ValueError(f"segment_ids: expected shape {(batch, length)}, got {segment_ids.shape}")
    if sink is not None and sink.shape != (heads,):
        raise ValueError(f"sink: expected shape {(heads,)}, got {sink.shape}")
    backend = target_backend()
    interpret = backend == "cpu" if interpret is None else bool(interpret)
    if not interpret and backend == "tpu":
        raise NotImplementedError(
            "flash_attention: the Pallas kernel is written for GPU (Triton) and does not lower "
            "with Mosaic on TPU (see pallas_kernels/flash_attention.py for what a TPU version "
            "needs); use attention_impl=xla on TPU")
    defaults = DEFAULT_BLOCKS.get(backend, FALLBACK_BLOCKS)
    cap = max(MIN_BLOCK, pl.next_power_of_2(length))
    compiled_gpu = not interpret and backend == "gpu"
    if compiled_gpu and head_dim & (head_dim - 1):
        raise ValueError(f"flash_attention: the Triton kernel needs a power-of-two head_dim, "
                         f"got {head_dim}")
    cfg = _Config(
        seq_len=length, window=window,
        block_q=_check_block("block_q", min(defaults[0], cap) if block_q is None else block_q,
                             compiled_gpu),
        block_k=_check_block("block_k", min(defaults[1], cap) if block_k is None else block_k,
                             compiled_gpu),
        interpret=interpret, backend=backend, poison=bool(debug_poison_outputs),
    )
    return _flash(q, k, v, segment_ids, sink, cfg)
