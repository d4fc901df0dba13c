"""asd (Approximate Speculative Decoding): mismatches paid from a request-level regret budget.

SPEC.md writes the rule as a loop that breaks at the first refused position;
here every position's test is evaluated at once on prefix sums, and
n = sum(cumprod(acc)) keeps exactly the loop's prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.verify import _common
from specjax.verify._common import Verdict

SUFFIXES = ("count", "fraction")


def check_options(fn: str, *, gate, block_cap, suffix, temperature=0.0) -> None:
    _common.check_number(fn, "gate", gate)
    _common.check_number(fn, "block_cap", block_cap)
    _common.check_choice(fn, "suffix", suffix, SUFFIXES)
    if _common.check_temperature(fn, temperature) > 0:
        raise ValueError(f"{fn}: ASD is a temperature-0 rule; got temperature={temperature}")


def asd(draft_tokens, target_logits, budget_left, *, gate=0.25, block_cap=2, suffix="count",
        num_draft=None, loose_mask=None, temperature=0.0) -> tuple[Verdict, jax.Array]:
    """ASD verification of one sequence against its ledger; returns (Verdict, budget_left').

    draft_tokens int[K], target_logits float[K+1, V], budget_left float32[].
    loose_mask bool[K] (optional) lets another rule veto loose acceptance of a
    mismatch before it is charged (e.g. FLy's entropy gate, see the policy layer).
    """
    fn = "asd"
    check_options(fn, gate=gate, block_cap=block_cap, suffix=suffix, temperature=temperature)
    _common.check_number(fn, "budget_left", budget_left)
    d_K, L_RV, k = _common.check_inputs(fn, draft_tokens, target_logits, num_draft)
    K = d_K.shape[0]
    budget = jnp.asarray(budget_left, jnp.float32)
    stats = _common.row_stats(L_RV, _common.padded(d_K))
    ex_K = _common.exact_flags(d_K, stats.argmax, k)
    mis_K = _common.valid_mask(K, k) & ~ex_K
    # Logit regret of the mismatches only, so that padding (maybe nan) never
    # reaches the prefix sums.
    r_K = jnp.where(mis_K, stats.max[:K] - stats.logit_at[:K], 0.0)
    i_K = jnp.arange(K, dtype=jnp.float32)
    k_f = k.astype(jnp.float32)
    q_K = k_f - i_K if suffix == "count" else (k_f - i_K) / k_f
    R_K = jnp.cumsum(r_K)  # R after adding position i
    R_prev_K = jnp.concatenate([jnp.zeros((1,), jnp.float32), R_K[:-1]])
    c_K = jnp.cumsum(mis_K.astype(jnp.int32))  # mismatches so far, this one included
    strict = (gate <= 0) | (block_cap <= 0)  # specjax's choice: no loose acceptance
    allowed_K = _common.check_loose_mask(fn, loose_mask, K)
    pays_K = (~strict & allowed_K & ~(r_K / q_K > gate) & (c_K <= block_cap)
              & (R_prev_K < budget) & (R_K <= budget))
    n = _common.accepted_count(ex_K | (mis_K & pays_K))
    # Charge the very cumulative sum the last accepted mismatch was tested
    # against, so the ledger never goes below zero.
    last = jnp.max(jnp.where(mis_K & (jnp.arange(K) < n), jnp.arange(K), -1))
    spent = jnp.where(last >= 0, R_K[jnp.maximum(last, 0)], 0.0)
    return Verdict(n, stats.argmax[n], _common.count_before(mis_K, n)), budget - spent
