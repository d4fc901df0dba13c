"""Pallas kernels for the gate statistics: one pass over vocabulary blocks per row.

Two lowerings of the same online algebra (`_online.block_softmax`, `block_top`,
`merge_softmax`, `merge_top`):

- "mosaic" (TPU): grid (splits, row blocks, vocabulary blocks). Logits arrive
  through a BlockSpec pipeline in (block_n, block_v) tiles; the vocabulary axis
  is the innermost, "arbitrary" reduction axis, and the running state lives in
  the output blocks, which stay resident across it. Block shapes: block_n a
  multiple of 8 (16 for 16-bit logits) or all rows; block_v a multiple of 128 or
  the whole vocabulary. A partial last block reads unspecified values that the
  column mask replaces by -inf; rows past M are never written back.
- "triton" (GPU): grid (rows, splits), one program per row and vocabulary split,
  a `fori_loop` over power-of-two blocks read with masked loads (`other=-inf`);
  the running state lives in registers, the top-3 / argmax update runs only for
  blocks whose max beats the running 3rd value, and the token's logit is one
  scalar load.

Both write float32 partial statistics per split, [Y, M] each; the splits (Y > 1
lets a few long rows occupy many cores) are combined by `_online.combine_partials`.
Nothing is padded or copied: logits are read exactly once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax.pallas import _dispatch, _online
from specjax.pallas._online import NEG_INF, GatePartials

_NUM_OUT = 7  # m, s, t, v2, v3 (top3[0] is m), argmax (as float32), token logit
_INIT = (NEG_INF, 0.0, 0.0, NEG_INF, NEG_INF, 0.0, 0.0)

DEFAULT_BLOCK_V = {"mosaic": 4096, "triton": 2048}
DEFAULT_BLOCK_N = 16  # mosaic rows per tile (multiple of 8 and of 16 for bf16 packing)
_TARGET_PROGRAMS = 512  # triton: split the vocabulary until about this many programs run


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_block_v(block_v: int, variant: str) -> None:
    if block_v < 128 or block_v % 128:
        raise ValueError(f"block_v must be a positive multiple of 128, got {block_v}")
    if variant == "triton" and block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two for the triton kernel, got {block_v}")


def _mosaic_kernel(tok_ref, x_ref, m_ref, s_ref, t_ref, v2_ref, v3_ref, arg_ref, tk_ref, *,
                   vocab, block_v, blocks_per_split):
    split, j = pl.program_id(0), pl.program_id(2)
    out_refs = (m_ref, s_ref, t_ref, v2_ref, v3_ref, arg_ref, tk_ref)

    @pl.when(j == 0)
    def _init():
        for ref, v in zip(out_refs, _INIT):
            ref[...] = jnp.full(ref.shape, v, jnp.float32)

    x = x_ref[...].astype(jnp.float32)
    col = ((split * blocks_per_split + j) * block_v
           + lax.broadcasted_iota(jnp.int32, x.shape, 1))
    x = jnp.where(col < vocab, x, NEG_INF)
    bm, bs, bt = _online.block_softmax(x, keepdims=True)
    # Unconditional top-3 update: no data-dependent branch (a vector -> scalar
    # condition) in the Mosaic kernel.
    bi, b2, b3 = _online.block_top(x, col, bm, keepdims=True)
    m = m_ref[...]
    v2, v3, arg = _online.merge_top(m, v2_ref[...], v3_ref[...], arg_ref[...], bm, b2, b3, bi)
    v2_ref[...], v3_ref[...], arg_ref[...] = v2, v3, arg
    m, s, t = _online.merge_softmax(m, s_ref[...], t_ref[...], bm, bs, bt)
    m_ref[...], s_ref[...], t_ref[...] = m, s, t
    tk_ref[...] += _online.block_token(x, col, tok_ref[...], keepdims=True)


def _mosaic_partials(x_MV, tok_M, *, block_v, block_n, num_splits, interpret):
    M, V = x_MV.shape
    bv = V if V <= block_v else block_v
    bn = M if M <= block_n else block_n
    nb = pl.cdiv(V, bv)
    Y = max(1, min(num_splits, nb))
    bps = pl.cdiv(nb, Y)
    Y = pl.cdiv(nb, bps)
    grid = (Y, pl.cdiv(M, bn), bps)
    kernel = functools.partial(_mosaic_kernel, vocab=V, block_v=bv, blocks_per_split=bps)
    x_spec = pl.BlockSpec((bn, bv), lambda s, i, j: (i, jnp.minimum(s * bps + j, nb - 1)))
    tok_spec = pl.BlockSpec((bn, 1), lambda s, i, j: (i, 0))
    out_spec = pl.BlockSpec((None, bn, 1), lambda s, i, j: (s, i, 0))
    compiler_params = _dispatch.compiler_params("mosaic", interpret, mosaic=dict(
        dimension_semantics=("parallel", "parallel", "arbitrary")))
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[tok_spec, x_spec],
        out_specs=[out_spec] * _NUM_OUT,
        out_shape=[_dispatch.out_struct((Y, M, 1), jnp.float32, x_MV, tok_M)] * _NUM_OUT,
        compiler_params=compiler_params,
        interpret=interpret,
        name="gate_stats_mosaic",
    )(tok_M[:, None], x_MV)
    return [o[..., 0] for o in outs]


def _triton_kernel(tok_ref, x_ref, *out_refs, vocab, block_v, blocks_per_split):
    from jax.experimental.pallas import triton as plgpu
    split = pl.program_id(1)

    def body(j, state):
        m, s, t, v2, v3, arg = state
        start = pl.multiple_of((split * blocks_per_split + j) * block_v, block_v)
        col = start + jnp.arange(block_v, dtype=jnp.int32)
        x = plgpu.load(x_ref.at[pl.ds(start, block_v)], mask=col < vocab, other=NEG_INF)
        x = x.astype(jnp.float32)
        bm, bs, bt = _online.block_softmax(x, keepdims=False)

        def update_top():
            bi, b2, b3 = _online.block_top(x, col, bm, keepdims=False)
            return _online.merge_top(m, v2, v3, arg, bm, b2, b3, bi)

        # Only a block whose max beats the running 3rd value can change top-3 / argmax;
        # after the first blocks of a row that is rare, and the 5 extra reductions skip.
        v2, v3, arg = lax.cond(bm > v3, update_top, lambda: (v2, v3, arg))
        m, s, t = _online.merge_softmax(m, s, t, bm, bs, bt)
        return m, s, t, v2, v3, arg

    init = tuple(jnp.float32(v) for v in _INIT[:6])
    state = lax.fori_loop(0, blocks_per_split, body, init)
    # The token's logit: one element, read by split 0 (tok is -1 when out of range).
    tok = tok_ref[...]
    x_tok = jnp.sum(x_ref[pl.ds(jnp.maximum(tok, 0), 1)].astype(jnp.float32))
    tk = jnp.where((tok >= 0) & (split == 0), x_tok, 0.0)
    for ref, v in zip(out_refs, (*state, tk)):
        ref[...] = v


def _triton_partials(x_MV, tok_M, *, block_v, num_splits, interpret):
    M, V = x_MV.shape
    bv = min(block_v, max(128, _next_pow2(V)))
    nb = pl.cdiv(V, bv)
    Y = num_splits if num_splits else pl.cdiv(_TARGET_PROGRAMS, M)
    Y = max(1, min(Y, nb))
    bps = pl.cdiv(nb, Y)
    Y = pl.cdiv(nb, bps)
    kernel = functools.partial(_triton_kernel, vocab=V, block_v=bv, blocks_per_split=bps)
    compiler_params = _dispatch.compiler_params("triton", interpret, triton=dict(
        num_warps=4 if bv <= 2048 else 8, num_stages=2))
    out_spec = pl.BlockSpec((None, None), lambda i, s: (s, i))
    outs = pl.pallas_call(
        kernel,
        grid=(M, Y),
        in_specs=[pl.BlockSpec((None,), lambda i, s: (i,)),
                  pl.BlockSpec((None, V), lambda i, s: (i, 0))],
        out_specs=[out_spec] * _NUM_OUT,
        out_shape=[_dispatch.out_struct((Y, M), jnp.float32, x_MV, tok_M)] * _NUM_OUT,
        compiler_params=compiler_params,
        interpret=interpret,
        name="gate_stats_triton",
    )(tok_M, x_MV)
    return outs


@functools.partial(jax.jit, static_argnames=(
    "variant", "block_v", "block_n", "num_splits", "interpret"))
def gate_partials_kernel(x_MV, tok_M, *, variant, block_v, block_n=DEFAULT_BLOCK_N,
                         num_splits=None, interpret=False) -> GatePartials:
    """Partial statistics of each row of `x_MV` (float, V >= 1) by the Pallas kernel.

    tok_M: int32 [M], column whose logit to report (any value; out of range gives 0).
    Argmax indices are local to `x_MV` (column 0 is index 0).
    """
    V = x_MV.shape[1]
    # Columns past V inside a partial block read as -inf: keep them from matching.
    tok_M = jnp.where((tok_M >= 0) & (tok_M < V), tok_M, -1).astype(jnp.int32)
    if variant == "mosaic":
        outs = _mosaic_partials(x_MV, tok_M, block_v=block_v, block_n=block_n,
                                num_splits=num_splits or 1, interpret=interpret)
    else:
        outs = _triton_partials(x_MV, tok_M, block_v=block_v, num_splits=num_splits,
                                interpret=interpret)
    m, s, t, v2, v3, arg, tk = outs
    stacked = GatePartials(m, s, t, jnp.stack([m, v2, v3], -1), arg.astype(jnp.int32), tk)
    if m.shape[0] == 1:
        return GatePartials(*(a[0] for a in stacked))
    return _online.combine_partials(stacked)
