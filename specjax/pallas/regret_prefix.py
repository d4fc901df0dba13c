"""Cumulative-regret prefix selection: the ASD loop (docs/rules.md) for a batch of rows.

    sel = regret_prefix(mismatch_BK, regret_BK, budget_left_B, gate=0.25, block_cap=2,
                        suffix="count", num_draft=k_B)
    sel.num_accepted    # n, int32 [B]
    sel.spent           # R_n = sum of regrets of mismatches in the accepted prefix, float32 [B]
    sel.budget_left     # budget_left - spent
    sel.num_loose       # mismatches in the accepted prefix, int32 [B]

The loop itself, one position for a vector of rows, is `position` (with the names of
docs/rules.md and of the rule's page, `specjax.verify._asd`, which reads it from here:
the kernels sit below the rules). Around it: validation, the per-position codes, the
[K, rows] layout with rows along lanes, padding, and the kernel/reference dispatch.

The kernel keeps the loop's order of float32 additions (a sequential loop over the K
positions, vectorised over 128 rows per program), so kernel, reference and a
NumPy loop agree bit for bit, including at a budget spent down to exactly zero.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from specjax.pallas import _dispatch

__all__ = ["RegretPrefix", "regret_prefix", "regret_prefix_reference", "suffix_weights"]

_LANES = 128  # rows per program: the lane axis on TPU, a power of two for Triton


class RegretPrefix(NamedTuple):
    num_accepted: jax.Array  # int32 [B]
    spent: jax.Array         # float32 [B]
    budget_left: jax.Array   # float32 [B], budget_left - spent
    num_loose: jax.Array     # int32 [B]


def suffix_weights(suffix: str, num_draft_B, K: int):
    """q[b, i] = k - i ("count") or (k - i) / k ("fraction"), k = num_draft[b]; float32 [B, K]."""
    k = num_draft_B.astype(jnp.float32)[:, None]
    i = jnp.arange(K, dtype=jnp.float32)[None, :]
    if suffix == "count":
        return k - i
    if suffix == "fraction":
        return (k - i) / k
    raise ValueError(f"suffix must be 'count', 'fraction' or an array of weights, got {suffix!r}")


# Per-position codes of the selection's input: an exact match, a mismatch, or a mismatch
# another rule vetoes before it is charged (loose_mask False, e.g. FLy's entropy gate).
MATCH, MISMATCH, VETOED = 0, 1, 2


class Scan(NamedTuple):
    """The loop's variables for a vector of rows (int32 / float32 only: Mosaic has no bool vectors)."""

    live: jax.Array  # 1 while the row is still scanning, else 0
    n: jax.Array  # accepted prefix length
    spent: jax.Array  # R: regret charged so far (float32)
    c: jax.Array  # mismatches charged so far (float32, compared with m)
    loose: jax.Array  # mismatches accepted


def start(shape) -> Scan:
    return Scan(jnp.ones(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32))


def position(i, s: Scan, code, r, q, budget_left, g, m, k, strict) -> Scan:
    """Position i of the loop for every row: code (MATCH / MISMATCH / VETOED), regret r,
    suffix weight q, budget_left, gate g, cap m, num_draft k, strict = g <= 0 or m <= 0."""
    mismatch = code != MATCH
    scanning = (s.live != 0) & (i < k)  # padding past num_draft is never accepted
    R_prev, R = s.spent, s.spent + r
    c = s.c + 1.0
    refused = (strict | (code == VETOED) | (r / q > g) | (c > m)
               | jnp.logical_not((R_prev < budget_left) & (R <= budget_left)))
    loose = scanning & mismatch & jnp.logical_not(refused)  # a loosely accepted mismatch
    scanning = scanning & jnp.logical_not(mismatch & refused)  # break
    return Scan(live=jnp.where(scanning, 1, 0), n=jnp.where(scanning, i + 1, s.n), spent=jnp.where(loose, R, s.spent),
                c=jnp.where(loose, c, s.c), loose=jnp.where(loose, s.loose + 1, s.loose))


def _kernel(code_ref, r_ref, q_ref, budget_ref, gate_ref, cap_ref, k_ref,
            n_ref, spent_ref, loose_ref, *, K):
    budget, gate, cap, k = budget_ref[...], gate_ref[...], cap_ref[...], k_ref[...]
    strict = (gate <= 0) | (cap <= 0)
    scan = start(budget.shape)
    for i in range(K):  # K is small and static: unrolled, static row slices only
        scan = position(i, scan, code_ref[i:i + 1, :], r_ref[i:i + 1, :], q_ref[i:i + 1, :],
                            budget, gate, cap, k, strict)
    n_ref[...] = scan.n
    spent_ref[...] = scan.spent
    loose_ref[...] = scan.loose


@functools.partial(jax.jit, static_argnames=("interpret", "variant"))
def _regret_prefix_kernel(code_BK, r_BK, q_BK, budget_B, gate_B, cap_B, k_B, *, interpret,
                          variant):
    B, K = code_BK.shape
    Kp = max(8, 1 << (K - 1).bit_length())   # sublane multiple of 8 and a power of two
    Bp = pl.cdiv(B, _LANES) * _LANES

    def kb(a, dtype):  # [B, K] -> [Kp, Bp], rows along lanes
        return jnp.pad(a.astype(dtype).T, ((0, Kp - K), (0, Bp - B)))

    def row(a, dtype):  # [B] -> [1, Bp]
        return jnp.pad(a.astype(dtype), (0, Bp - B))[None, :]

    kb_spec = pl.BlockSpec((Kp, _LANES), lambda b: (0, b))
    row_spec = pl.BlockSpec((1, _LANES), lambda b: (0, b))
    like = (code_BK, r_BK, q_BK, budget_B, gate_B, cap_B, k_B)
    n, spent, loose = pl.pallas_call(
        functools.partial(_kernel, K=K),
        grid=(Bp // _LANES,),
        in_specs=[kb_spec] * 3 + [row_spec] * 4,
        out_specs=[row_spec] * 3,
        out_shape=[_dispatch.out_struct((1, Bp), jnp.int32, *like),
                   _dispatch.out_struct((1, Bp), jnp.float32, *like),
                   _dispatch.out_struct((1, Bp), jnp.int32, *like)],
        compiler_params=_dispatch.compiler_params(
            variant, interpret, triton=dict(num_warps=1),
            mosaic=dict(dimension_semantics=("parallel",))),
        interpret=interpret,
        name="regret_prefix",
    )(kb(code_BK, jnp.int32), kb(r_BK, jnp.float32), kb(q_BK, jnp.float32),
      row(budget_B, jnp.float32), row(gate_B, jnp.float32), row(cap_B, jnp.float32),
      row(k_B, jnp.int32))
    return n[0, :B], spent[0, :B], loose[0, :B]


@jax.jit
def _regret_prefix_scan(code_BK, r_BK, q_BK, budget_B, gate_B, cap_B, k_B):
    strict = (gate_B <= 0) | (cap_B <= 0)

    def body(scan, xs):
        i, code, r, q = xs
        return position(i, scan, code, r, q, budget_B, gate_B, cap_B, k_B, strict), None

    K = code_BK.shape[1]
    xs = (jnp.arange(K, dtype=jnp.int32), code_BK.T, r_BK.T, q_BK.T)
    scan, _ = lax.scan(body, start(budget_B.shape), xs)
    return scan.n, scan.spent, scan.loose


def _prepare(mismatch, regret, budget_left, gate, block_cap, suffix, num_draft, loose_mask):
    """Validates (static shapes and dtypes, before tracing) and flattens to [B, K] / [B]."""
    for name, a in (("mismatch", mismatch), ("regret", regret)):
        if getattr(a, "shape", None) is None:
            raise ValueError(f"{name} must be an array of shape [..., K]")
    if len(mismatch.shape) < 1:
        raise ValueError("mismatch must have shape [..., K], got a scalar")
    if tuple(regret.shape) != tuple(mismatch.shape):
        raise ValueError(f"regret shape {tuple(regret.shape)} != mismatch shape {tuple(mismatch.shape)}")
    *lead, K = mismatch.shape
    if K < 1:
        raise ValueError(f"K (the last axis of mismatch) must be >= 1, got {K}")
    if not (jnp.issubdtype(mismatch.dtype, jnp.bool_) or jnp.issubdtype(mismatch.dtype, jnp.integer)):
        raise ValueError(f"mismatch must be bool (or 0/1 integers), got {mismatch.dtype}")
    if not jnp.issubdtype(regret.dtype, jnp.floating):
        raise ValueError(f"regret must be floating point, got {regret.dtype}")
    lead = tuple(lead)
    B = int(np.prod(lead, dtype=np.int64))

    def per_row(name, a, dtype):
        a = jnp.asarray(a)
        if a.ndim and tuple(a.shape) != lead:
            raise ValueError(f"{name} must be a scalar or have the leading shape {lead}, "
                             f"got {tuple(a.shape)}")
        return jnp.broadcast_to(a.astype(dtype), lead).reshape(B)

    if getattr(budget_left, "shape", None) is None or not hasattr(budget_left, "dtype"):
        budget_left = jnp.float32(budget_left)
    budget_B = per_row("budget_left", budget_left, jnp.float32)
    gate_B = per_row("gate", gate, jnp.float32)
    cap_B = per_row("block_cap", block_cap, jnp.float32)
    if num_draft is None:
        k_B = jnp.full((B,), K, jnp.int32)
    else:
        nd = jnp.asarray(num_draft)
        if not jnp.issubdtype(nd.dtype, jnp.integer):
            raise ValueError(f"num_draft must be an integer, got {nd.dtype}")
        k_B = jnp.clip(per_row("num_draft", nd, jnp.int32), 0, K)
    mis = jnp.reshape(mismatch, (B, K)).astype(jnp.bool_)
    if loose_mask is None:
        code = jnp.where(mis, MISMATCH, MATCH).astype(jnp.int32)
    else:
        if tuple(getattr(loose_mask, "shape", ())) != tuple(mismatch.shape):
            raise ValueError(f"loose_mask must have the shape of mismatch {tuple(mismatch.shape)}, "
                             f"got {tuple(getattr(loose_mask, 'shape', ()))}")
        allowed = jnp.reshape(loose_mask, (B, K)).astype(jnp.bool_)
        code = jnp.where(mis, jnp.where(allowed, MISMATCH, VETOED), MATCH).astype(jnp.int32)
    r = jnp.reshape(regret, (B, K)).astype(jnp.float32)
    if isinstance(suffix, str):
        q = suffix_weights(suffix, k_B, K)
    else:
        if tuple(getattr(suffix, "shape", ())) != tuple(mismatch.shape):
            raise ValueError(f"suffix weights must have the shape of mismatch {tuple(mismatch.shape)}, "
                             f"got {tuple(getattr(suffix, 'shape', ()))}")
        q = jnp.reshape(suffix, (B, K)).astype(jnp.float32)
    return lead, (code, r, q, budget_B, gate_B, cap_B, k_B)


def _finish(lead, budget_B, n, spent, loose) -> RegretPrefix:
    rs = lambda a: jnp.reshape(a, lead)
    return RegretPrefix(rs(n), rs(spent), rs(budget_B - spent), rs(loose))


def regret_prefix_reference(mismatch, regret, budget_left, *, gate=0.25, block_cap=2,
                            suffix="count", num_draft=None, loose_mask=None) -> RegretPrefix:
    """jnp reference (a `lax.scan` over positions); same arguments as `regret_prefix`."""
    lead, args = _prepare(mismatch, regret, budget_left, gate, block_cap, suffix, num_draft,
                          loose_mask)
    return _finish(lead, args[3], *_regret_prefix_scan(*args))


def regret_prefix(mismatch, regret, budget_left, *, gate=0.25, block_cap=2, suffix="count",
                  num_draft=None, loose_mask=None, impl=None, interpret=None, backend=None) -> RegretPrefix:
    """Accepted length and budget spent of the ASD loop of docs/rules.md, for rows [..., K].

    mismatch: bool [..., K], `not ex[i]`. regret: float [..., K], r[i] = max L[i] - L[i][d[i]].
    budget_left: float32 scalar or [...]. gate g, block_cap m: scalars or [...]
    (strict when g <= 0 or m <= 0). suffix: "count", "fraction" (q from num_draft) or
    float weights [..., K]. num_draft: None (K) or int [...] / scalar, clipped to [0, K].
    loose_mask: None or bool [..., K]; a mismatch where it is False is refused before it
    is charged, like a strict one (another rule's veto, e.g. FLy's entropy gate).
    impl / interpret / backend: see `specjax.pallas._dispatch`.
    """
    lead, args = _prepare(mismatch, regret, budget_left, gate, block_cap, suffix, num_draft,
                          loose_mask)
    if _dispatch.resolve_impl(impl, backend) == "reference" or args[0].shape[0] == 0:
        return _finish(lead, args[3], *_regret_prefix_scan(*args))
    interpret = _dispatch.resolve_interpret(interpret, backend)
    variant = _dispatch.resolve_variant(None, backend)
    _dispatch.check_compiled_variant(variant, interpret, backend)
    out = _dispatch.run_kernel(functools.partial(_regret_prefix_kernel, interpret=interpret, variant=variant),
                               *args, backend=backend)
    return _finish(lead, args[3], *out)
