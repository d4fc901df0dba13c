"""Online softmax algebra shared by the gate-statistics kernels and their combiners.

A set of logits x (a vocabulary block, a split, a shard, or a whole row) is
summarised by its partial statistics, all float32 except the index:

  max            m = max x                               (-inf for an empty / all -inf set)
  sum_exp        s = sum exp(x - m)                      (>= 1 when m is finite)
  sum_exp_shift  t = sum exp(x - m) * (x - m)            (<= 0; terms with exp = 0 count 0)
  top3           the 3 largest values, with multiplicity, descending (-inf fills);
                 top3[0] == max
  argmax         lowest global index of m
  token_logit    x[token] if the token lies in the set, else 0

Two summaries merge exactly (up to float rounding): with M = max(m1, m2) and
a_i = exp(m_i - M), s = a_1 s_1 + a_2 s_2 and t = sum_i a_i (t_i + (m_i - M) s_i).
From a whole row: lse = m + log s and entropy H = log s - t / s (nats).

The functions here are written on plain arrays so the same code runs inside a
Pallas kernel (Mosaic or Triton lowering) and in jnp. Indices are reduced as
float32 (exact below 2**24), which every lowering supports.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = float("-inf")
MAX_VOCAB = 2**24  # indices are reduced as float32 inside the kernels


class GatePartials(NamedTuple):
    """Partial statistics of a set of logits (see module docstring); shapes [M] / [M, 3]."""
    max: jax.Array
    sum_exp: jax.Array
    sum_exp_shift: jax.Array
    top3: jax.Array
    argmax: jax.Array
    token_logit: jax.Array


class GateStats(NamedTuple):
    """Per-row statistics of softmax(logits); every field has the leading shape of the logits.

    max_logit:          float32, max_v L[v]
    argmax:             int32, lowest index of the max
    lse:                float32, log sum_v exp L[v]
    entropy:            float32, -sum p log p in nats (0 log 0 = 0)
    entropy_normalized: float32, entropy / log V clamped to [0, 1]; 0 when V == 1 (docs/rules.md "normalized")
    entropy_top3:       float32, -sum over the min(3, V) largest p of p log p, clamped at 0 (docs/rules.md "top3")
    token_logit:        float32, L[token]; NaN when the token is out of [0, V) or not given
    """
    max_logit: jax.Array
    argmax: jax.Array
    lse: jax.Array
    entropy: jax.Array
    entropy_normalized: jax.Array
    entropy_top3: jax.Array
    token_logit: jax.Array


# ---------------------------------------------------------------- in-kernel pieces

def _reducers(keepdims):
    red = lambda f, a: f(a, axis=-1, keepdims=keepdims)
    ex = (lambda a: a) if keepdims else (lambda a: jnp.expand_dims(a, -1))
    return red, ex


def block_softmax(x, *, keepdims):
    """(m, s, t) of one block, reduced over the last axis.

    x: float32 block with entries outside the vocabulary already set to -inf.
    """
    red, ex = _reducers(keepdims)
    m = red(jnp.max, x)
    d = x - ex(jnp.where(m == NEG_INF, 0.0, m))
    e = jnp.exp(d)
    return m, red(jnp.sum, e), red(jnp.sum, jnp.where(e > 0, e * d, 0.0))


def block_top(x, col, m, *, keepdims):
    """(i1, v2, v3) of one block with max m: the lowest column of m (float32) and the
    2nd and 3rd largest values, ties kept with multiplicity (one occurrence removed at
    a time). col: int32 global column of every entry."""
    red, ex = _reducers(keepdims)
    colf = col.astype(jnp.float32)
    big = jnp.float32(jnp.inf)
    i1 = red(jnp.min, jnp.where(x == ex(m), colf, big))
    x2 = jnp.where(colf == ex(i1), NEG_INF, x)
    v2 = red(jnp.max, x2)
    i2 = red(jnp.min, jnp.where(x2 == ex(v2), colf, big))
    v3 = red(jnp.max, jnp.where(colf == ex(i2), NEG_INF, x2))
    return i1, v2, v3


def block_token(x, col, tok, *, keepdims):
    """x[tok] if tok is a column of this block, else 0 (tok broadcastable against x)."""
    red, _ = _reducers(keepdims)
    return red(jnp.sum, jnp.where(col == tok, x, 0.0))


def _rescale(m, s, t, M):
    """(a*s, a*(t + (m - M) s)) with a = exp(m - M), and 0 where a == 0 (no 0 * inf)."""
    Ms = jnp.where(M == NEG_INF, 0.0, M)
    a = jnp.exp(m - Ms)
    live = a > 0
    return (jnp.where(live, a * s, 0.0),
            jnp.where(live, a * (t + (m - Ms) * s), 0.0))


def merge_softmax(m, s, t, bm, bs, bt):
    """(m, s, t) of the union of two sets."""
    M = jnp.maximum(m, bm)
    s1, t1 = _rescale(m, s, t, M)
    s2, t2 = _rescale(bm, bs, bt, M)
    return M, s1 + s2, t1 + t2


def merge_top3(a1, a2, a3, b1, b2, b3):
    """Top 3 (with multiplicity) of two descending triples."""
    c1 = jnp.maximum(a1, b1)
    c2 = jnp.maximum(jnp.minimum(a1, b1), jnp.maximum(a2, b2))
    a_wins = a1 >= b1
    c3 = jnp.where(
        a_wins,
        jnp.maximum(jnp.maximum(jnp.minimum(a2, b1), a3), b2),
        jnp.maximum(jnp.maximum(jnp.minimum(b2, a1), b3), a2))
    return c1, c2, c3


def merge_top(m, v2, v3, arg, bm, b2, b3, barg):
    """(v2, v3, arg) of the union of a state (max m) and a later block (max bm).

    The block cannot change them when bm <= v3: kernels may skip `block_top` then.
    """
    _, c2, c3 = merge_top3(m, v2, v3, bm, b2, b3)
    return c2, c3, jnp.where(bm > m, barg, arg)  # strict: the earlier index wins ties


# ---------------------------------------------------------------- jnp combiners

def combine_partials(p: GatePartials) -> GatePartials:
    """Combines partials stacked on a leading axis (splits or shards, in vocabulary order)."""
    M = jnp.max(p.max, axis=0)
    s, t = _rescale(p.max, p.sum_exp, p.sum_exp_shift, M[None])
    first = jnp.argmax(p.max == M[None], axis=0)  # lowest split holding the max
    arg = jnp.take_along_axis(p.argmax, first[None], axis=0)[0]
    Y = p.top3.shape[0]
    cand = jnp.moveaxis(p.top3, 0, -2).reshape(*p.top3.shape[1:-1], Y * 3)
    top3 = jax.lax.top_k(cand, 3)[0]
    return GatePartials(M, jnp.sum(s, 0), jnp.sum(t, 0), top3, arg.astype(jnp.int32),
                        jnp.sum(p.token_logit, 0))


def finalize(p: GatePartials, vocab: int, tokens) -> GateStats:
    """GateStats of whole rows from their partials; `tokens` None or int32 [M]."""
    log_s = jnp.log(p.sum_exp)
    lse = p.max + log_s
    entropy = jnp.maximum(log_s - p.sum_exp_shift / p.sum_exp, 0.0)
    normalized = normalized_entropy(entropy, p.sum_exp, vocab)
    top3 = top3_entropy(p.top3, p.max, log_s)
    if tokens is None:
        token_logit = jnp.full_like(entropy, jnp.nan)
    else:
        ok = (tokens >= 0) & (tokens < vocab)
        token_logit = jnp.where(ok, p.token_logit, jnp.nan)
    return GateStats(p.max, p.argmax.astype(jnp.int32), lse, entropy, normalized, top3, token_logit)


def normalized_entropy(entropy, sum_exp, vocab: int):
    """entropy / log V clamped to [0, 1]; 0 when V == 1; exactly 1 for a uniform row.

    A row is uniform when every exp(x - max) is 1, i.e. sum_exp == V. Pinning it to 1
    keeps docs/rules.md's "a uniform row has h = 1" independent of how the compiler
    evaluates log. log V is a correctly rounded float32 constant (NumPy, float64).
    """
    if vocab == 1:
        return jnp.zeros_like(entropy)
    h = jnp.clip(entropy / np.float32(np.log(vocab)), 0.0, 1.0)
    return jnp.where(sum_exp == jnp.float32(vocab), 1.0, h)


def top3_entropy(top_vals, max_logit, log_sum_exp):
    """-sum p log p over the given largest logits [..., k] (k <= 3, -inf allowed), clamped at 0.

    log p = (x - max) - log s, with s = sum exp(x - max): shifting by the max first
    keeps log p of the top entries accurate when the logits are large.
    """
    shift = jnp.where(max_logit == NEG_INF, 0.0, max_logit)
    lp = (top_vals - shift[..., None]) - log_sum_exp[..., None]
    term = jnp.where(top_vals == NEG_INF, 0.0, jnp.exp(lp) * lp)
    return jnp.maximum(-jnp.sum(term, axis=-1), 0.0)
