"""speculative_sampling: lossless rejection sampling at T > 0 (docs/rules.md).

Key use is part of the contract: `ku, kr = split(key)`, `u = uniform(ku, (K,))`
for the acceptance tests and `categorical(kr, .)` for the token after the
accepted prefix. With JAX's default partitionable threefry, `uniform(ku, (K,))`
starts with `uniform(ku, (k,))`, so num_draft = k gives exactly the K = k result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.verify import _common, _greedy
from specjax.verify._common import Verdict


def tempered_stats(d_K, L_RV, temperature: float, backend=None) -> _common.RowStats:
    """Statistics of (L - max L) / T, so that p[i] = exp(tempered(L[i]) - lse[i]) (`_common.tempered`)."""
    return _common.row_stats(_common.tempered(L_RV, temperature), _common.padded(d_K), backend, checked=True)


def sampling_flags(ku, d_K, stats_T, q_KV, k) -> jax.Array:
    """acc[i] = u[i] < min(1, p[i][d[i]] / q[i][d[i]]) on real positions."""
    K = d_K.shape[0]
    p_d_K = jnp.exp(stats_T.logit_at - stats_T.lse)[:K]
    # A point-mass drafter has q[i][d[i]] = 1.
    q_d_K = 1.0 if q_KV is None else jnp.take_along_axis(q_KV, d_K[:, None], axis=-1)[:, 0]
    u_K = jax.random.uniform(ku, (K,), jnp.float32)
    return (u_K < jnp.minimum(1.0, p_d_K / q_d_K)) & _common.valid_mask(K, k)


def residual_sample(kr, d_K, L_RV, stats_T, q_KV, temperature: float, n, k) -> jax.Array:
    """A sample of normalize(max(0, p[n] - q[n])), with q[k] = 0 (so p[k] at n == k).

    An all-zero residual (q[n] covering p[n]) falls back to p[n].
    """
    K, V = d_K.shape[0], L_RV.shape[1]
    p_V = jnp.exp(_common.tempered(L_RV[n], temperature) - stats_T.lse[n])
    i = jnp.minimum(n, K - 1)  # row n of q exists only for n < k; masked below
    q_V = jax.nn.one_hot(d_K[i], V, dtype=jnp.float32) if q_KV is None else q_KV[i]
    r_V = jnp.maximum(0.0, p_V - jnp.where(n < k, q_V, 0.0))
    total = jnp.sum(r_V)
    r_V = jnp.where(total > 0, r_V / jnp.where(total > 0, total, 1.0), p_V)
    token = jax.random.categorical(kr, jnp.log(r_V)).astype(jnp.int32)
    return jnp.where(stats_T.argmax[n] >= 0, token, _common.INVALID_TOKEN)  # an invalid row names no token


def speculative_sampling(draft_tokens, target_logits, key, *, draft_probs=None, temperature=1.0,
                         num_draft=None, backend=None) -> Verdict:
    """Lossless speculative sampling: the emitted tokens follow softmax(L / T).

    draft_tokens int[K], target_logits float[K+1, V], draft_probs float[K, V]
    (None: the drafter put all mass on d[i]). At temperature 0 it is greedy.
    """
    fn = "speculative_sampling"
    temperature = _common.check_temperature(fn, temperature)
    if temperature == 0:
        return _greedy.greedy(draft_tokens, target_logits, num_draft=num_draft, backend=backend)
    d_K, L_RV, k = _common.check_inputs(fn, draft_tokens, target_logits, num_draft)
    q_KV = _common.check_draft_probs(fn, draft_probs, d_K.shape[0], L_RV.shape[1])
    return decide(d_K, L_RV, k, _common.check_key(fn, key), q_KV, temperature, _common.backend_of(backend))


def decide(d_K, L_RV, k, key, q_KV, temperature: float, backend) -> Verdict:
    """Speculative sampling on one checked sequence (greedy at T = 0)."""
    if temperature == 0:
        return _greedy.decide(d_K, L_RV, k, backend)
    ku, kr = jax.random.split(key)
    stats_T = tempered_stats(d_K, L_RV, temperature, backend)
    n = _common.accepted_count(sampling_flags(ku, d_K, stats_T, q_KV, k))
    return Verdict(n, residual_sample(kr, d_K, L_RV, stats_T, q_KV, temperature, n, k), jnp.int32(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling(_common.Rule, name="sampling", sampling=True):
    """Lossless speculative sampling (T > 0; greedy at T = 0)."""

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return decide(d_K, L_RV, k, key, q_KV, temperature, backend)
