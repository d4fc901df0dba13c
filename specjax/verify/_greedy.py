"""greedy (alias "exact"): accept the longest prefix that matches the target's argmax (docs/rules.md)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.verify import _common
from specjax.verify._common import Verdict


def greedy(draft_tokens, target_logits, *, num_draft=None, backend=None) -> Verdict:
    """Exact speculative decoding: token-identical to greedy decoding of the target.

    draft_tokens int[K], target_logits float[K+1, V]; next_token = t[n]. backend: see row_stats.
    """
    d_K, L_RV, k = _common.check_inputs("greedy", draft_tokens, target_logits, num_draft)
    return decide(d_K, L_RV, k, _common.backend_of(backend))


def decide(d_K, L_RV, k, backend) -> Verdict:
    """Greedy on one checked sequence (d_K int32[K], L_RV [K+1, V], k int32[] in [0, K])."""
    t_R = _common.row_stats(L_RV, _common.padded(d_K), backend, checked=True).argmax
    n = _common.accepted_count(_common.exact_flags(d_K, t_R, k))
    return Verdict(n, t_R[n], jnp.int32(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Greedy(_common.Rule, name="greedy"):
    """Exact verification ("greedy", also "exact"): output identical to the target's greedy decoding."""

    def _row(self, d_K, L_RV, key, q_KV, k, temperature, backend):
        return decide(d_K, L_RV, k, backend)
