"""typical: Medusa's typical acceptance, a loose baseline at T > 0 (greedy at T = 0; docs/rules.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.verify import _common, _greedy, _sampling
from specjax.verify._common import Verdict


def check_options(fn: str, *, epsilon, delta) -> None:
    _common.check_number(fn, "epsilon", epsilon, low=0)
    _common.check_number(fn, "delta", delta, low=0)


def typical(draft_tokens, target_logits, key, *, epsilon=0.09, delta=0.3, temperature=1.0,
            num_draft=None, backend=None) -> Verdict:
    """Accept position i while p[i][d[i]] > min(epsilon, delta * exp(-H[i])), p = softmax(L / T).

    H is the entropy of p in nats; next_token is a sample of p[n] drawn with
    kr of `ku, kr = split(key)`. num_loose counts accepted d[i] != argmax L[i].
    """
    fn = "typical"
    check_options(fn, epsilon=epsilon, delta=delta)
    temperature = _common.check_temperature(fn, temperature)
    if temperature == 0:
        return _greedy.greedy(draft_tokens, target_logits, num_draft=num_draft, backend=backend)
    d_K, L_RV, k = _common.check_inputs(fn, draft_tokens, target_logits, num_draft)
    return decide(d_K, L_RV, k, _common.check_key(fn, key), epsilon=epsilon, delta=delta, temperature=temperature,
                  backend=_common.backend_of(backend))


def decide(d_K, L_RV, k, key, *, epsilon, delta, temperature: float, backend) -> Verdict:
    """Typical acceptance on one checked sequence (greedy at T = 0)."""
    if temperature == 0:
        return _greedy.decide(d_K, L_RV, k, backend)
    K = d_K.shape[0]
    stats_T = _sampling.tempered_stats(d_K, L_RV, temperature, backend)
    p_d_K = jnp.exp(stats_T.logit_at - stats_T.lse)[:K]
    threshold_K = jnp.minimum(epsilon, delta * jnp.exp(-stats_T.entropy[:K]))
    n = _common.accepted_count((p_d_K > threshold_K) & _common.valid_mask(K, k))
    _, kr = jax.random.split(key)
    next_token = jax.random.categorical(kr, _common.tempered(L_RV[n], temperature) - stats_T.lse[n]).astype(jnp.int32)
    next_token = jnp.where(stats_T.argmax[n] >= 0, next_token, _common.INVALID_TOKEN)
    # "Loose" is measured against the untempered argmax, as docs/rules.md defines ex.
    ex_K = _common.exact_flags(d_K, _common.row_stats(L_RV, _common.padded(d_K), backend, checked=True).argmax, k)
    return Verdict(n, next_token, _common.count_before(~ex_K, n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Typical(_common.Rule, name="typical", sampling=True):
    """Medusa's typical acceptance (a baseline; greedy at T = 0)."""
    epsilon: float = _common.option(0.09, "typical: epsilon")
    delta: float = _common.option(0.3, "typical: delta")

    def check(self, fn):
        check_options(fn, epsilon=self.epsilon, delta=self.delta)

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return decide(d_K, L_RV, k, key, epsilon=self.epsilon, delta=self.delta, temperature=temperature,
                      backend=backend)
