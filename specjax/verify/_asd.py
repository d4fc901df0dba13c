"""asd (Approximate Speculative Decoding): mismatches paid from a request-level regret budget.

The logits give the exact flags and the regrets (one `row_stats` pass); SPEC.md's
loop itself is `specjax.pallas.regret_prefix` (a Pallas kernel on GPU/TPU, a
`lax.scan` on CPU), which adds the regrets in the loop's order, so the ledger is
the loop's float32 sum bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import pallas
from specjax.verify import _common
from specjax.verify._common import Verdict

SUFFIXES = ("count", "fraction")


def check_options(fn: str, *, gate, block_cap, suffix, temperature=0.0) -> None:
    # gate <= 0 or block_cap = 0 is the strict rule (SPEC.md); below that is a mistake, not a setting.
    _common.check_number(fn, "gate", gate, low=0)
    _common.check_number(fn, "block_cap", block_cap, low=0, integer=True)
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
    # reaches the ledger.
    r_K = jnp.where(mis_K, stats.max[:K] - stats.logit_at[:K], 0.0)
    sel = pallas.regret_prefix(mis_K, r_K, budget, gate=gate, block_cap=block_cap, suffix=suffix, num_draft=k,
                               loose_mask=_common.check_loose_mask(fn, loose_mask, K))
    n = sel.num_accepted
    return Verdict(n, stats.argmax[n], sel.num_loose), sel.budget_left
