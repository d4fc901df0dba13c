"""Speculative sampling reproduces the target distribution (chi-square over many keys).

Tiny vocabulary (V = 5, so 4 degrees of freedom), K = 2, a drafter q unlike
the target p. With L's rows fixed, the emitted tokens must follow:
first token ~ p[0]; second ~ p[1] given the first draft was accepted; the bonus
token ~ p[2] given both were. The test must also have teeth: the same
statistic, at the same level, rejects deliberately off-by-one samplers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import verify
from specjax.verify import _common, _sampling

M = 40_000  # keys
ALPHA = 1e-4  # a correct sampler fails one seed in 10^4; the mutants sit at p ~ 0
L = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05],
                       [0.05, 0.1, 0.2, 0.25, 0.4],
                       [0.3, 0.05, 0.3, 0.05, 0.3]]))
Q = jnp.array([[0.2, 0.2, 0.2, 0.2, 0.2],
               [0.4, 0.3, 0.1, 0.1, 0.1]])
P = np.asarray(jax.nn.softmax(L, -1), np.float64)


def chi2_pvalue(counts, p):
    """Survival function of chi-square with V - 1 = 4 (even) degrees of freedom, in closed form."""
    expected = counts.sum() * p
    x = float(((counts - expected) ** 2 / expected).sum())
    assert len(p) - 1 == 4
    return math.exp(-x / 2) * (1 + x / 2)


def emitted(draft_probs_is_none=False):
    """Draft with q, verify, and return (first token, second | n >= 1, bonus | n == 2)."""
    def one(key):
        kd, kv = jax.random.split(key)
        d = jax.random.categorical(kd, jnp.log(Q), axis=-1).astype(jnp.int32)
        v = verify.speculative_sampling(d, L, kv, draft_probs=None if draft_probs_is_none else Q)
        return d, v.num_accepted, v.next_token

    d, n, nxt = (np.asarray(x) for x in jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), M)))
    first = np.where(n >= 1, d[:, 0], nxt)
    second = np.where(n >= 2, d[:, 1], nxt)[n >= 1]
    bonus = nxt[n == 2]
    return [np.bincount(x, minlength=5) for x in (first, second, bonus)]


def test_output_follows_the_target_and_off_by_ones_are_rejected(monkeypatch):
    counts = emitted()
    for row, c in enumerate(counts):
        assert c.sum() > 2000  # each check has a real sample
        assert chi2_pvalue(c, P[row]) > ALPHA, f"row {row}: {c} vs {P[row]}"
        # the neighbouring rows' distributions are rejected at the same level
        for other in {max(row - 1, 0), min(row + 1, 2)} - {row}:
            assert chi2_pvalue(c, P[other]) < 1e-12

    # Mutants: the residual taken from row n + 1, and the bonus drawn from row k - 1.
    real = _sampling.residual_sample
    for shift in [lambda n, k: jnp.minimum(n + 1, k), lambda n, k: jnp.where(n == k, k - 1, n)]:
        monkeypatch.setattr(_sampling, "residual_sample",
                            lambda kr, d, L_, s, q, T, n, k, shift=shift: real(kr, d, L_, s, q, T, shift(n, k), k))
        mutant = emitted()
        assert min(chi2_pvalue(c, P[row]) for row, c in enumerate(mutant)) < 1e-12


def test_point_mass_drafts_follow_the_target():
    # draft_probs=None: the drafter is a point mass on its token (prompt lookup).
    counts = emitted(draft_probs_is_none=True)
    assert chi2_pvalue(counts[0], P[0]) > ALPHA and chi2_pvalue(counts[2], P[2]) > ALPHA


# --- token choice from logits (verify._common: the loop's, the drafters' and the rules') ---


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    kept = np.isfinite(np.asarray(_common.top_p_logits(logits, 0.7)))
    np.testing.assert_array_equal(kept[0], [True, True, False, False])
    np.testing.assert_array_equal(kept[1], [True, True, True, True])  # ties at the cut all stay


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1, 0.0])
    logits = jnp.log(jnp.asarray(probs))[None].repeat(4000, 0)
    draws = np.asarray(_common.sample(jax.random.PRNGKey(0), logits, 1.0))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, probs, atol=0.03)
