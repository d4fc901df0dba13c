"""fly (FLy): a mismatch is loosely accepted behind an entropy gate and a deferred window.

Two variants (docs/rules.md): rule="paper" is the paper's formula, rule="reference"
is what the published code does (W - 1 window matches, gate off at theta <= 0.01).
At T > 0 the exact flags are the lossless speculative-sampling accepts.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from specjax.verify import _common, _sampling
from specjax.verify._common import Verdict

RULES = ("paper", "reference")


def check_options(fn: str, *, theta, window, entropy, rule) -> None:
    _common.check_choice(fn, "entropy", entropy, _common.ENTROPIES)
    _common.check_choice(fn, "rule", rule, RULES)
    # window may be traced (one compile for a sweep); a static one is checked here.
    if isinstance(window, bool) or not (isinstance(window, numbers.Integral) or (
            isinstance(window, jax.Array) and window.ndim == 0 and jnp.issubdtype(window.dtype, jnp.integer))):
        raise ValueError(f"{fn}: window must be an int scalar, got {window!r}")
    if isinstance(window, numbers.Integral) and window < (1 if rule == "reference" else 0):
        raise ValueError(f"{fn}: window must be >= {1 if rule == 'reference' else 0} for rule={rule!r}, got {window}")
    _common.check_number(fn, "theta", theta)


entropy_gate = _common.entropy_gate  # gate[j] = h[j] >= theta (shared with Asd and Csd: `_common`)


def loose_flags(ex_K, h_K, *, theta, window, rule: str, k) -> jax.Array:
    """Which mismatches j FLy lets through, reading the raw ex flags.

    paper:     gate[j] and j + W <= k - 1 and ex[j+1 .. j+W] all true.
    reference: gate[j] and j <= k - W - 1 and ex[j+1 .. j+W-1] all true.
    """
    K = ex_K.shape[0]
    j_K = jnp.arange(K)
    span = window if rule == "paper" else window - 1
    # c[i] = #ex in [0, i); matches in (j, j + span] are c[j+1+span] - c[j+1].
    c_R = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(ex_K.astype(jnp.int32))])
    run_K = c_R[jnp.minimum(j_K + 1 + span, K)] - c_R[j_K + 1]
    fits_K = j_K + window <= k - 1  # the window lies inside the real drafts
    return ~ex_K & fits_K & (run_K == span) & entropy_gate(h_K, theta, rule)


def fly(draft_tokens, target_logits, *, theta=0.3, window=6, entropy="normalized", rule="paper",
        temperature=0.0, draft_probs=None, key=None, num_draft=None, backend=None) -> Verdict:
    """FLy verification of one sequence: draft_tokens int[K], target_logits float[K+1, V].

    At T > 0, ex[i] is "speculative sampling accepts i" (same key use as
    speculative_sampling), entropy is taken on the untempered logits, and
    next_token is the residual sample at n. An accepted mismatch keeps its draft.
    backend: a `specjax.backend.Backend` (Pallas choice, vocabulary sharding); None: plain.
    """
    fn = "fly"
    check_options(fn, theta=theta, window=window, entropy=entropy, rule=rule)
    temperature = _common.check_temperature(fn, temperature)
    d_K, L_RV, k = _common.check_inputs(fn, draft_tokens, target_logits, num_draft)
    q_KV = None
    if temperature > 0:
        q_KV = _common.check_draft_probs(fn, draft_probs, d_K.shape[0], L_RV.shape[1])
        key = _common.check_key(fn, key)
    return decide(d_K, L_RV, k, key, q_KV, theta=theta, window=window, entropy=entropy, rule=rule,
                  temperature=temperature, backend=_common.backend_of(backend))


def decide(d_K, L_RV, k, key, q_KV, *, theta, window, entropy, rule, temperature, backend) -> Verdict:
    """FLy on one checked sequence (d_K int32[K], L_RV [K+1, V], k int32[] in [0, K]; key and q_KV
    float32[K, V] or None at T > 0): the rule, top to bottom."""
    K = d_K.shape[0]
    stats = _common.row_stats(L_RV, _common.padded(d_K), backend, checked=True)
    # ex[i]: the exact test (argmax match at T = 0; speculative sampling's accept at T > 0)
    if temperature == 0:
        ex_K = _common.exact_flags(d_K, stats.argmax, k)
    else:
        ku, kr = jax.random.split(key)
        stats_T = _sampling.tempered_stats(d_K, L_RV, temperature, backend)
        ex_K = _sampling.sampling_flags(ku, d_K, stats_T, q_KV, k)
    # loose[i]: a mismatch behind the entropy gate and a window of matches (never on an invalid row)
    h_K = _common.entropy_of(stats, entropy)[:K]
    loose_K = loose_flags(ex_K, h_K, theta=theta, window=window, rule=rule, k=k) & (stats.argmax[:K] >= 0)
    n = _common.accepted_count(ex_K | loose_K)
    if temperature == 0:
        next_token = stats.argmax[n]
    else:
        next_token = _sampling.residual_sample(kr, d_K, L_RV, stats_T, q_KV, temperature, n, k)
    return Verdict(n, next_token, _common.count_before(~ex_K, n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fly(_common.Rule, name="fly", sampling=True):
    """FLy: a mismatch passes where the target is unsure (entropy gate) and the next W drafts match."""
    theta: float = _common.option(0.3, "fly: entropy threshold (also gates asd/csd when set)")
    window: int = _common.option(6, "fly: deferred window W")
    entropy: str = _common.option("normalized", "fly: entropy kind", _common.ENTROPIES)
    rule: str = _common.option("paper", "fly: paper | reference (the published code)", RULES)

    def check(self, fn):
        _common.check_number(fn, "theta", self.theta)
        check_options(fn, theta=self.theta, window=self.window, entropy=self.entropy, rule=self.rule)

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return decide(d_K, L_RV, k, key, q_KV, theta=self.theta, window=self.window, entropy=self.entropy,
                      rule=self.rule, temperature=temperature, backend=backend)
