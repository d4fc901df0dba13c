"""Next-token choice from logits: greedy, temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp


_F32_MAX = float(jnp.finfo(jnp.float32).max)


def tempered(logits_V: jax.Array, temperature: float, axis: int = -1) -> jax.Array:
    """float32 (L - max L) / T: the logits of softmax(L / T), finite-safe at any T > 0.

    Shifting by the row max before scaling keeps the largest entry at exactly 0, so
    a temperature so small that 1 / T or L / T overflows float32 still gives the
    argmax (the distribution then is one-hot in float32): greedy, eagerly and under
    jit alike. The scale is a multiplication by 1 / T clamped to float32's range,
    so XLA cannot rewrite it into 0 * inf.
    """
    x = logits_V.astype(jnp.float32)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted * jnp.float32(min(1.0 / temperature, _F32_MAX))


INVALID_TOKEN = -1  # the token of a row with a NaN or +inf, or no finite logit (verify's NAN_POLICY)


def _valid(logits_BV: jax.Array) -> jax.Array:
    m_B = jnp.max(logits_BV, axis=-1)  # NaN if any entry is NaN
    return jnp.isfinite(m_B)


def greedy(logits_BV: jax.Array) -> jax.Array:
    """argmax with the lowest index on ties (jnp.argmax's rule), int32[B]; -1 for an invalid row."""
    return jnp.where(_valid(logits_BV), jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), INVALID_TOKEN)


def top_p_logits(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """Masks to -inf every token outside the smallest set whose probability reaches top_p.

    The most probable token always survives; ties at the boundary are all kept
    (the cut is a logit threshold), so the result does not depend on sort order.
    """
    if top_p >= 1.0:
        return logits_BV
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # mass strictly before each sorted position; keep positions whose prior mass < top_p
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_count_B = jnp.maximum(jnp.sum(before_BV < top_p, axis=-1), 1)
    threshold_B = jnp.take_along_axis(sorted_BV, (keep_count_B - 1)[:, None], axis=-1)
    return jnp.where(logits_BV >= threshold_B, logits_BV, -jnp.inf)


def sample(key: jax.Array, logits_BV: jax.Array, temperature: float, top_p: float = 1.0) -> jax.Array:
    """One token per row: greedy at temperature 0, else a sample of softmax(logits / T) within top-p."""
    if temperature == 0.0:
        return greedy(logits_BV)
    scaled = top_p_logits(tempered(logits_BV, temperature), top_p)
    token_B = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(_valid(logits_BV), token_B, INVALID_TOKEN)
