"""asd (Approximate Speculative Decoding): mismatches paid from a request-level regret budget.

The rule, per sequence (docs/rules.md, "asd"):

    r[i] = max(L[i]) - L[i][d[i]]                   regret of draft i
    q[i] = K - i ("count") or (K - i) / K ("fraction")
    strict = g <= 0 or m <= 0
    R = 0; c = 0; n = 0
    for i in 0..K-1:
        if not ex[i]:
            if strict: break
            R_prev = R; R += r[i]; c += 1
            if r[i] / q[i] > g or c > m or not (R_prev < budget_left and R <= budget_left): break
        n = i + 1
    budget_left' = budget_left - R

`position` below is one step of that loop, written once for a vector of rows; the
Pallas kernel (`specjax.pallas.regret_prefix`, GPU/TPU) and its `lax.scan`
reference (CPU) both run it, in the loop's order of float32 additions, so the
ledger is the loop's sum bit for bit. `asd` reads the logits once (`row_stats`)
for the exact flags and the regrets and hands them to that selection.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax import pallas
from specjax.verify import _common
from specjax.verify._common import Verdict

SUFFIXES = ("count", "fraction")

# Per-position codes of the selection's input: an exact match, a mismatch, or a mismatch
# another rule vetoes before it is charged (loose_mask False, e.g. FLy's entropy gate).
MATCH, MISMATCH, VETOED = 0, 1, 2


class Scan(NamedTuple):
    """The loop's variables for a vector of rows (int32 / float32 only: Mosaic has no bool vectors)."""

    live: jax.Array  # 1 while the row is still scanning, else 0
    n: jax.Array  # accepted prefix length
    spent: jax.Array  # R: regret charged so far (float32)
    c: jax.Array  # mismatches charged so far (float32, compared with m)
    loose: jax.Array  # mismatches accepted


def start(shape) -> Scan:
    return Scan(jnp.ones(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32))


def position(i, s: Scan, code, r, q, budget_left, g, m, k, strict) -> Scan:
    """Position i of the loop for every row: code (MATCH / MISMATCH / VETOED), regret r,
    suffix weight q, budget_left, gate g, cap m, num_draft k, strict = g <= 0 or m <= 0."""
    mismatch = code != MATCH
    scanning = (s.live != 0) & (i < k)  # padding past num_draft is never accepted
    R_prev, R = s.spent, s.spent + r
    c = s.c + 1.0
    refused = (strict | (code == VETOED) | (r / q > g) | (c > m)
               | jnp.logical_not((R_prev < budget_left) & (R <= budget_left)))
    loose = scanning & mismatch & jnp.logical_not(refused)  # a loosely accepted mismatch
    scanning = scanning & jnp.logical_not(mismatch & refused)  # break
    return Scan(live=jnp.where(scanning, 1, 0), n=jnp.where(scanning, i + 1, s.n), spent=jnp.where(loose, R, s.spent),
                c=jnp.where(loose, c, s.c), loose=jnp.where(loose, s.loose + 1, s.loose))


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
    mismatch before it is charged (e.g. FLy's entropy gate, see `verify.Asd(theta=...)`).
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
