"""Entropy-gate statistics of target logits: one read of [..., V] gives every rule its numbers.

    stats = gate_stats(logits_BRV, draft_tokens_BR)
    stats.argmax                          # t[i] (lowest index on ties)
    stats.max_logit - stats.token_logit   # ASD regret r[i]
    stats.entropy_normalized, stats.entropy_top3   # docs/rules.md "Entropy"

`gate_stats` dispatches to the Pallas kernel or to its jnp reference (see `_dispatch`).
`gate_stats_reference` is the kernel's own algebra in jnp: the partial statistics of each row
computed directly (`gate_partials_reference`), then the same `finalize` the kernel's output
goes through. The plain statistics (softmax, top_k over a whole row: docs/rules.md's
definitions) are `specjax.verify._common.gate_stats_reference`, the one reference the rules run
on CPU and the kernels are tested against; this package cannot import it (it sits below
verify), and needs none of it: the kernels and this reference share `_online`'s algebra.
"""

from __future__ import annotations

import functools


import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.pallas import _dispatch, _gate_kernel, _online
from specjax.pallas._online import MAX_VOCAB, NEG_INF, GatePartials, GateStats

__all__ = ["GateStats", "GatePartials", "gate_stats", "gate_stats_reference",
           "gate_partials", "gate_partials_reference", "combine_partials",
           "finalize_partials"]

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

combine_partials = _online.combine_partials
finalize_partials = _online.finalize


def check_inputs(logits, tokens) -> None:
    """Raises ValueError for inputs the statistics do not support (before any tracing)."""
    shape = getattr(logits, "shape", None)
    dtype = getattr(logits, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"logits must be an array, got {type(logits).__name__}")
    if len(shape) < 1:
        raise ValueError("logits must have a vocabulary axis: shape [..., V], got a scalar")
    vocab = shape[-1]
    if vocab == 0:
        raise ValueError(f"logits have an empty vocabulary axis (shape {tuple(shape)}); V must be >= 1")
    if vocab >= MAX_VOCAB:
        raise ValueError(f"vocabulary size {vocab} is too large: V must be < {MAX_VOCAB}")
    if jnp.dtype(dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"logits must be float32 or bfloat16, got {jnp.dtype(dtype)}")
    if tokens is not None:
        tshape = getattr(tokens, "shape", None)
        tdtype = getattr(tokens, "dtype", None)
        if tshape is None or tdtype is None:
            raise ValueError(f"tokens must be an integer array, got {type(tokens).__name__}")
        if not jnp.issubdtype(tdtype, jnp.integer):
            raise ValueError(f"tokens must have an integer dtype, got {jnp.dtype(tdtype)}")
        if tuple(tshape) != tuple(shape[:-1]):
            raise ValueError(f"tokens must have the leading shape of the logits {tuple(shape[:-1])}, "
                             f"got {tuple(tshape)}")


def first_argmax(x, m):
    """Lowest index of the max `m` of each row of x [..., V] (jnp.argmax's rule, a NaN
    counting as the max), int32. A compare and a float32 min-reduction (indices are
    exact below MAX_VOCAB): XLA:CPU runs them several times faster than jnp.argmax's
    variadic (value, index) reduction."""
    col = lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    hit = (x == m[..., None]) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, col, jnp.inf), axis=-1).astype(jnp.int32)


def gate_stats_reference(logits, tokens=None) -> GateStats:
    """jnp statistics of `logits` [..., V] by the kernel's algebra (per-row partials, then
    `finalize`); tokens int [...] or None."""
    check_inputs(logits, tokens)
    *lead, V = logits.shape
    M = int(np.prod(lead, dtype=np.int64))
    x = jnp.reshape(logits, (M, V))
    tok = jnp.full((M,), -1, jnp.int32) if tokens is None else jnp.reshape(tokens, (M,)).astype(jnp.int32)
    stats = _online.finalize(gate_partials_reference(x, tok), V, None if tokens is None else tok)
    return GateStats(*(jnp.reshape(a, lead) for a in stats))


def gate_partials_reference(x_MV, tok_M) -> GatePartials:
    """jnp partial statistics of each row (the kernel's output, computed directly).

    tok_M: int32 [M] column index local to these rows (out of range contributes 0).
    """
    x = x_MV.astype(jnp.float32)
    V = x.shape[-1]
    m = jnp.max(x, axis=-1)
    d = x - jnp.where(m == NEG_INF, 0.0, m)[:, None]
    e = jnp.exp(d)
    top = jax.lax.top_k(x, min(3, V))[0]
    if V < 3:
        top = jnp.pad(top, ((0, 0), (0, 3 - V)), constant_values=NEG_INF)
    col = jnp.arange(V, dtype=jnp.int32)
    return GatePartials(
        max=m,
        sum_exp=jnp.sum(e, axis=-1),
        sum_exp_shift=jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=-1),
        top3=top,
        argmax=first_argmax(x, m),
        token_logit=jnp.sum(jnp.where(col[None] == tok_M[:, None], x, 0.0), axis=-1),
    )


def gate_partials(x_MV, tok_M, *, impl="kernel", interpret=None, variant=None,
                  block_v=None, block_n=None, num_splits=None, backend=None) -> GatePartials:
    """Partial statistics of rows [M, V] (kernel or jnp); used by the sharded path."""
    if impl == "reference":
        return gate_partials_reference(x_MV, tok_M)
    variant = _dispatch.resolve_variant(variant, backend)
    block_v = block_v or _gate_kernel.DEFAULT_BLOCK_V[variant]
    _gate_kernel.check_block_v(block_v, variant)
    if block_n is None:
        block_n = _gate_kernel.DEFAULT_BLOCK_N
    elif block_n < 8 or block_n % 8:
        raise ValueError(f"block_n must be a positive multiple of 8, got {block_n}")
    interpret = _dispatch.resolve_interpret(interpret, backend)
    _dispatch.check_compiled_variant(variant, interpret, backend)
    return _gate_kernel.gate_partials_kernel(
        x_MV, tok_M, variant=variant, block_v=block_v, block_n=block_n,
        num_splits=num_splits, interpret=interpret)


def gate_stats(logits, tokens=None, *, impl=None, interpret=None, variant=None,
               block_v=None, block_n=None, num_splits=None, backend=None, checked=False) -> GateStats:
    """Per-row GateStats of logits [..., V] (float32 or bfloat16), in one pass.

    tokens: integer [...] (e.g. the draft token of each row) whose logit to report, or None.
    impl: None (auto: kernel on GPU/TPU, reference on CPU; see `_dispatch`), "kernel",
      "reference". interpret: None (auto: on CPU) or bool. variant: None (by backend),
      "mosaic" (TPU) or "triton" (GPU). block_v: vocabulary block (multiple of 128; a power
      of two for triton). block_n: rows per mosaic tile (multiple of 8). num_splits:
      vocabulary splits per row (triton default: enough to fill the device). backend: a
      `specjax.backend.Backend` (its pallas impl, platform and mesh), None: the plain one.
    checked: the caller validated logits and tokens already (`verify`'s rules do, once per trace).
    Rows need at least one finite logit; a row of only -inf has lse -inf and NaN entropies.
    """
    if not checked:
        check_inputs(logits, tokens)
    if _dispatch.resolve_impl(impl, backend) == "reference":
        return gate_stats_reference(logits, tokens)
    *lead, V = logits.shape
    M = int(np.prod(lead, dtype=np.int64))
    if M == 0:
        return gate_stats_reference(logits, tokens)
    x = jnp.reshape(logits, (M, V))
    tok = (jnp.full((M,), -1, jnp.int32) if tokens is None
           else jnp.reshape(tokens, (M,)).astype(jnp.int32))
    p = _dispatch.run_kernel(functools.partial(gate_partials, impl="kernel", interpret=interpret, variant=variant,
                                               block_v=block_v, block_n=block_n, num_splits=num_splits,
                                               backend=backend), x, tok, backend=backend)
    stats = _online.finalize(p, V, None if tokens is None else tok)
    return GateStats(*(jnp.reshape(a, lead) for a in stats))
