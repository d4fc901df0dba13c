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

`pallas.regret_prefix.position` is one step of that loop, written once for a vector of
rows with these names; the Pallas kernel (GPU/TPU) and its `lax.scan` reference (CPU)
both run it, in the loop's order of float32 additions, so the
ledger is the loop's sum bit for bit. `asd` reads the logits once (`row_stats`)
for the exact flags and the regrets and hands them to that selection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import pallas
from specjax.pallas.regret_prefix import MATCH, MISMATCH, VETOED, Scan, position, start  # noqa: F401
from specjax.verify import _common
from specjax.verify._common import Verdict

# The loop's step (`position`), its state (`Scan`) and the per-position codes live with the
# selection that runs it (`specjax.pallas.regret_prefix`): the kernel below the rules cannot
# import them from here.
SUFFIXES = ("count", "fraction")


def check_options(fn: str, *, gate, block_cap, suffix, temperature=0.0) -> None:
    # gate <= 0 or block_cap = 0 is the strict rule (SPEC.md); below that is a mistake, not a setting.
    _common.check_number(fn, "gate", gate, low=0)
    _common.check_number(fn, "block_cap", block_cap, low=0, integer=True)
    _common.check_choice(fn, "suffix", suffix, SUFFIXES)
    if _common.check_temperature(fn, temperature) > 0:
        raise ValueError(f"{fn}: ASD is a temperature-0 rule; got temperature={temperature}")


def asd(draft_tokens, target_logits, budget_left, *, gate=0.25, block_cap=2, suffix="count",
        num_draft=None, loose_mask=None, temperature=0.0, backend=None) -> tuple[Verdict, jax.Array]:
    """ASD verification of one sequence against its ledger; returns (Verdict, budget_left').

    draft_tokens int[K], target_logits float[K+1, V], budget_left float32[].
    loose_mask bool[K] (optional) lets another rule veto loose acceptance of a
    mismatch before it is charged (e.g. FLy's entropy gate, see `verify.Asd(theta=...)`).
    """
    fn = "asd"
    check_options(fn, gate=gate, block_cap=block_cap, suffix=suffix, temperature=temperature)
    _common.check_number(fn, "budget_left", budget_left)
    d_K, L_RV, k = _common.check_inputs(fn, draft_tokens, target_logits, num_draft)
    return decide(d_K, L_RV, budget_left, k, _common.check_loose_mask(fn, loose_mask, d_K.shape[0]), gate=gate,
                  block_cap=block_cap, suffix=suffix, backend=_common.backend_of(backend))


def decide(d_K, L_RV, budget_left, k, loose_mask, *, gate, block_cap, suffix, backend):
    """ASD on one checked sequence (loose_mask bool[K] or None: all allowed)."""
    K = d_K.shape[0]
    budget = jnp.asarray(budget_left, jnp.float32)
    stats = _common.row_stats(L_RV, _common.padded(d_K), backend, checked=True)
    ex_K = _common.exact_flags(d_K, stats.argmax, k)
    mis_K = _common.valid_mask(K, k) & ~ex_K
    # Logit regret of the mismatches only, so that padding (maybe nan) never
    # reaches the ledger.
    r_K = jnp.where(mis_K, stats.max[:K] - stats.logit_at[:K], 0.0)
    sel = pallas.regret_prefix(mis_K, r_K, budget, gate=gate, block_cap=block_cap, suffix=suffix, num_draft=k,
                               loose_mask=jnp.ones((K,), bool) if loose_mask is None else loose_mask,
                               backend=backend)
    n = sel.num_accepted
    return Verdict(n, stats.argmax[n], sel.num_loose), sel.budget_left


@dataclasses.dataclass(frozen=True, kw_only=True)
class Asd(_common.Rule, name="asd"):
    """ASD: mismatches paid from a per-request regret budget (the state: one ledger per row)."""
    budget: float = _common.option(8.0, "asd: request-level regret budget")
    gate: float = _common.option(0.25, "asd: per-mismatch regret gate g")
    block_cap: int = _common.option(2, "asd: loose mismatches per block m")
    suffix: str = _common.option("count", "asd: suffix weight", SUFFIXES)
    theta: float | None = _common.option(None, "entropy gate on loose acceptance (unset: off)")
    entropy: str = _common.option("normalized", "entropy kind of the gate", _common.ENTROPIES)

    def check(self, fn):
        check_options(fn, gate=self.gate, block_cap=self.block_cap, suffix=self.suffix)
        _common.check_number(fn, "budget", self.budget)
        if self.budget < 0:
            raise ValueError(f"{fn}: budget must be >= 0, got {self.budget}")
        _common.check_gate(fn, self.theta, self.entropy)

    def init_state(self, batch_size):
        return jnp.full((batch_size,), self.budget, jnp.float32)

    def _step(self, ledger_B, rnd):
        def row(d, L, budget_left, k, mask):
            return decide(d, L, budget_left, k, mask, gate=self.gate, block_cap=self.block_cap, suffix=self.suffix,
                          backend=rnd.backend)

        mask_BK = _common.entropy_gate_BK(self.theta, self.entropy, rnd)
        verdict, left_B = _common.vmap(row, rnd.backend)(rnd.d_BK, rnd.L_BRV, ledger_B, rnd.k_B, mask_BK)
        left_B = jnp.where(rnd.active_B, left_B, ledger_B)
        return verdict, left_B, ledger_B - left_B
