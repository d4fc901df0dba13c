"""Pieces every acceptance rule shares (SPEC.md, Notation and Entropy).

`row_stats` is the one place where rules read the logits: a Pallas kernel will
later replace its internals, so every rule routes its per-row statistics
through it and keeps the rest of its arithmetic on K-sized vectors.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

ENTROPIES = ("normalized", "top3")


class Verdict(NamedTuple):
    """What a rule decides for one sequence (int32 scalars; [B] under vmap)."""

    num_accepted: jax.Array  # n: draft tokens committed, 0 <= n <= num_draft
    next_token: jax.Array  # token emitted after d[:n]
    num_loose: jax.Array  # accepted positions that the exact test rejected


class RowStats(NamedTuple):
    """float32 statistics of each row of a [R, V] logits block."""

    max: jax.Array  # f32[R]
    argmax: jax.Array  # i32[R], lowest index on ties
    lse: jax.Array  # f32[R], log-sum-exp
    entropy: jax.Array  # f32[R], nats
    entropy_normalized: jax.Array  # f32[R], entropy / log V clamped to [0, 1]
    entropy_top3: jax.Array  # f32[R], nats over the min(3, V) largest p
    logit_at: jax.Array  # f32[R], logits_RV[r, tokens_R[r]]


def _plogp_sum(z_RX, log_s_R):
    """sum of p log p over the given entries, p = exp(z - log s), with 0 log 0 = 0."""
    logp_RX = z_RX - log_s_R[:, None]
    p_RX = jnp.exp(logp_RX)
    return jnp.sum(jnp.where(p_RX > 0, p_RX * logp_RX, 0.0), axis=-1)


def row_stats(logits_RV: jax.Array, tokens_R: jax.Array) -> RowStats:
    """Per-row statistics in float32. Rows need at least one finite logit.

    -inf logits are legal: they get p = 0 and take no part in the entropies.
    """
    L_RV = logits_RV.astype(jnp.float32)
    V = L_RV.shape[1]
    max_R = jnp.max(L_RV, axis=-1)
    argmax_R = jnp.argmax(L_RV, axis=-1).astype(jnp.int32)  # first occurrence
    # Shift by the max so exp never overflows; a -inf entry gives e = 0, and the
    # where() below keeps 0 * -inf from turning into nan.
    z_RV = L_RV - max_R[:, None]
    e_RV = jnp.exp(z_RV)
    s_R = jnp.sum(e_RV, axis=-1)
    log_s_R = jnp.log(s_R)
    lse_R = max_R + log_s_R
    # H = log s - sum(e z) / s, with e = exp(z) and s = sum(e).
    ez_R = jnp.sum(jnp.where(e_RV > 0, e_RV * z_RV, 0.0), axis=-1)
    entropy_R = jnp.maximum(log_s_R - ez_R / s_R, 0.0)
    if V > 1:
        # A uniform row is exactly 1 (SPEC.md: theta = 1 is not greedy); the ratio
        # alone can land one ulp below it when XLA's log differs from NumPy's.
        uniform_R = jnp.min(L_RV, axis=-1) == max_R
        entropy_norm_R = jnp.where(uniform_R, 1.0, jnp.clip(entropy_R / np.float32(np.log(V)), 0.0, 1.0))
    else:
        entropy_norm_R = jnp.zeros_like(entropy_R)
    top_RX, _ = jax.lax.top_k(z_RV, min(3, V))
    entropy_top3_R = jnp.maximum(-_plogp_sum(top_RX, log_s_R), 0.0)
    logit_at_R = jnp.take_along_axis(L_RV, tokens_R[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return RowStats(max_R, argmax_R, lse_R, entropy_R, entropy_norm_R, entropy_top3_R, logit_at_R)


def entropy_of(stats: RowStats, kind: str) -> jax.Array:
    return stats.entropy_normalized if kind == "normalized" else stats.entropy_top3


# --- input checks: all at trace time, on static shapes and Python values ---


def check_choice(fn: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{fn}: unknown {name}={value!r}; expected one of {', '.join(map(repr, choices))}")


def check_number(fn: str, name: str, value) -> None:
    """A numeric scalar: a Python number or a (possibly traced) 0-d array."""
    try:
        ok = value is not None and jnp.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.number)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{fn}: {name} must be a numeric scalar, got {value!r}")


def check_temperature(fn: str, temperature) -> float:
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"{fn}: temperature must be a static Python number >= 0, got {temperature!r}")
    return float(temperature)


def check_inputs(fn: str, draft_tokens, target_logits, num_draft):
    """Validates one sequence's inputs; returns (d_K int32, L_RV f32, k int32[])."""
    d_K, L_RV = jnp.asarray(draft_tokens), jnp.asarray(target_logits)
    if d_K.ndim != 1 or not jnp.issubdtype(d_K.dtype, jnp.integer):
        raise ValueError(f"{fn}: draft_tokens must be an int array [K] for one sequence (jax.vmap for a batch), "
                         f"got {d_K.dtype}{list(d_K.shape)}")
    K = d_K.shape[0]
    if K == 0:
        raise ValueError(f"{fn}: K = 0 draft tokens; a round needs K >= 1")
    if L_RV.ndim != 2 or not jnp.issubdtype(L_RV.dtype, jnp.floating):
        raise ValueError(f"{fn}: target_logits must be a float array [K+1, V], got {L_RV.dtype}{list(L_RV.shape)}")
    if L_RV.shape[0] != K + 1:
        raise ValueError(f"{fn}: target_logits has {L_RV.shape[0]} rows, expected K+1 = {K + 1} for K = {K} drafts")
    if L_RV.shape[1] == 0:
        raise ValueError(f"{fn}: target_logits has an empty vocabulary")
    return d_K.astype(jnp.int32), L_RV.astype(jnp.float32), num_draft_scalar(fn, num_draft, K)


def num_draft_scalar(fn: str, num_draft, K: int) -> jax.Array:
    """num_draft as an int32 scalar in [0, K]; a traced value is clipped into range."""
    if num_draft is None:
        return jnp.int32(K)
    if isinstance(num_draft, numbers.Integral) and not 0 <= num_draft <= K:
        raise ValueError(f"{fn}: num_draft={num_draft} outside [0, K = {K}]")
    k = jnp.asarray(num_draft)
    if k.ndim != 0 or not jnp.issubdtype(k.dtype, jnp.integer):
        raise ValueError(f"{fn}: num_draft must be an int scalar per sequence, got {k.dtype}{list(k.shape)}")
    return jnp.clip(k.astype(jnp.int32), 0, K)


def check_draft_probs(fn: str, draft_probs, K: int, V: int):
    """draft_probs [K, V] as float32, or None for a point mass on each draft."""
    if draft_probs is None:
        return None
    q_KV = jnp.asarray(draft_probs)
    if q_KV.ndim != 2 or q_KV.shape[0] != K:
        raise ValueError(f"{fn}: draft_probs must be [K, V] = [{K}, V], got {list(q_KV.shape)}")
    if q_KV.shape[1] != V:
        raise ValueError(f"{fn}: vocabulary mismatch: draft_probs has V = {q_KV.shape[1]}, target_logits V = {V}")
    return q_KV.astype(jnp.float32)


def check_loose_mask(fn: str, loose_mask, K: int) -> jax.Array:
    """bool[K] veto on loose acceptance (another rule's gate); None allows all."""
    if loose_mask is None:
        return jnp.ones((K,), bool)
    mask_K = jnp.asarray(loose_mask)
    if mask_K.shape != (K,):
        raise ValueError(f"{fn}: loose_mask must be bool[K] = [{K}], got {list(mask_K.shape)}")
    return mask_K.astype(bool)


def check_key(fn: str, key):
    if key is None:
        raise ValueError(f"{fn}: temperature > 0 needs a PRNG key")
    return key


# --- small vector helpers over the K draft positions ---


def padded(d_K: jax.Array) -> jax.Array:
    """Draft tokens extended to K+1 entries so they index the K+1 logit rows."""
    return jnp.concatenate([d_K, jnp.zeros((1,), jnp.int32)])


def valid_mask(K: int, k: jax.Array) -> jax.Array:
    """Positions that hold real drafts; padding past num_draft is never accepted."""
    return jnp.arange(K) < k


def exact_flags(d_K: jax.Array, t_R: jax.Array, k: jax.Array) -> jax.Array:
    """ex[i] = (d[i] == t[i]) on real positions; padding is never a match."""
    K = d_K.shape[0]
    return (d_K == t_R[:K]) & valid_mask(K, k)


def accepted_count(acc_K: jax.Array) -> jax.Array:
    """n = sum(cumprod(acc)): the length of the accepted prefix."""
    return jnp.sum(jnp.cumprod(acc_K.astype(jnp.int32))).astype(jnp.int32)


def count_before(flags_K: jax.Array, n: jax.Array) -> jax.Array:
    """#{i < n : flags[i]}."""
    return jnp.sum(flags_K & (jnp.arange(flags_K.shape[0]) < n)).astype(jnp.int32)
