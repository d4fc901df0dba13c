"""Counters the generation loop keeps, and the statistics made from them.

The loop carries a `Counters` pytree (per-row and per-draft-position integers);
`statistics` turns the host copy into the numbers docs/rules.md defines (tau,
acceptance per position, loose share, ...), and `merge` combines the statistics
of several `generate` calls as if they were one call. The engine and the
experiment binaries use these two functions and nothing else.

Shapes (docs/rules.md, shape legend): B rows, K draft positions (K = 0 for target-only decoding, which
proposes nothing).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.verify import CSDMemory, RoundCounts


@struct.dataclass(kw_only=True)
class Counters:
    """What every round adds to; rows that are done add nothing."""

    rounds_B: jax.Array  # int32[B]: verification forwards in which the row was live
    round_tokens_B: jax.Array  # int32[B]: tokens emitted by rounds (the prefill's token excluded)
    accepted_K: jax.Array  # int32[K]: rounds (all rows) in which draft position i was accepted
    offered_K: jax.Array  # int32[K]: rounds (all rows) in which draft position i held a real draft
    num_loose_B: jax.Array  # int32[B]: mismatches a loose rule accepted
    examined_B: jax.Array  # int32[B]: those plus the mismatches that stopped a round
    spent_B: jax.Array  # float32[B]: ASD ledger charged

    @classmethod
    def zeros(cls, B: int, K: int) -> "Counters":
        zi = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
        return cls(rounds_B=zi(B), round_tokens_B=zi(B), accepted_K=zi(K), offered_K=zi(K), num_loose_B=zi(B),
                   examined_B=zi(B), spent_B=jnp.zeros((B,), jnp.float32))

    def update(self, *, live_B, emitted_B, n_B=None, num_draft_B=None, counts: RoundCounts | None = None):
        """One round: `emitted_B` tokens kept per row; for a speculative round also the
        accepted drafts `n_B`, the real drafts `num_draft_B` and the rule's `counts`."""
        out = self.replace(rounds_B=self.rounds_B + live_B, round_tokens_B=self.round_tokens_B + emitted_B)
        if n_B is None:
            return out
        i_K = jnp.arange(self.accepted_K.shape[0])
        return out.replace(
            accepted_K=self.accepted_K + jnp.sum(live_B[:, None] & (i_K[None] < n_B[:, None]), axis=0),
            offered_K=self.offered_K + jnp.sum(live_B[:, None] & (i_K[None] < num_draft_B[:, None]), axis=0),
            num_loose_B=self.num_loose_B + counts.num_loose_B,
            examined_B=self.examined_B + counts.examined_B,
            spent_B=self.spent_B + counts.spent_B)


def statistics(counters: Counters, rule_state: Any = ()) -> dict[str, Any]:
    """The statistics of one call (host values; lists per request or per draft position)."""
    c = jax.tree.map(np.asarray, counters)
    rounds_B = c.rounds_B
    # tau per request = tokens emitted by rounds / rounds; a request finished by its
    # prefill token has no round and a tau of 0 by this definition.
    tau_B = np.where(rounds_B > 0, c.round_tokens_B / np.maximum(rounds_B, 1), 0.0)
    out = {
        "tau": float(tau_B.mean()) if tau_B.size else 0.0,
        "tau_per_request": tau_B.tolist(),
        "rounds": int(rounds_B.max(initial=0)),
        "rounds_per_request": rounds_B.tolist(),
        "round_tokens_per_request": c.round_tokens_B.tolist(),
    }
    if c.accepted_K.shape[0] == 0:  # target-only decoding
        return out
    loose, examined = int(c.num_loose_B.sum()), int(c.examined_B.sum())
    out.update({
        "accepted_per_round": float(c.accepted_K.sum() / max(int(rounds_B.sum()), 1)),
        "accepted_per_position": np.where(c.offered_K > 0, c.accepted_K / np.maximum(c.offered_K, 1), 0.0).tolist(),
        "accepted_counts_per_position": c.accepted_K.tolist(),
        "offered_per_position": c.offered_K.tolist(),
        "loose": loose,
        "loose_per_request": c.num_loose_B.tolist(),
        "mismatches_examined": examined,
        "examined_per_request": c.examined_B.tolist(),
        "loose_share": loose / examined if examined else 0.0,
        "ledger_spent_per_request": c.spent_B.tolist(),
    })
    if isinstance(rule_state, CSDMemory):
        out["csd_memory_filled"] = int(rule_state.filled)
        out["csd_memory_capacity"] = rule_state.capacity
        out["csd_memory_dropped"] = int(rule_state.dropped)
    return out


def _counters_of(stats: dict[str, Any]) -> Counters:
    """The counters behind one call's statistics (the inverse of `statistics`)."""
    per_request = lambda key, dtype: np.asarray(stats.get(key, [0] * len(stats["rounds_per_request"])), dtype)  # noqa: E731
    per_position = lambda key: np.asarray(stats.get(key, []), np.int32)  # noqa: E731
    return Counters(rounds_B=per_request("rounds_per_request", np.int32),
                    round_tokens_B=per_request("round_tokens_per_request", np.int32),
                    accepted_K=per_position("accepted_counts_per_position"),
                    offered_K=per_position("offered_per_position"),
                    num_loose_B=per_request("loose_per_request", np.int32),
                    examined_B=per_request("examined_per_request", np.int32),
                    spent_B=per_request("ledger_spent_per_request", np.float32))


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The statistics of several calls (of one engine) as if they were one call: per-request
    values are concatenated, per-position counts added; the CSD memory's fill is the largest
    seen and its dropped increments add up."""
    if not parts:
        return statistics(Counters.zeros(0, 0))
    counters = [_counters_of(p) for p in parts]
    merged = Counters(**{
        name: (np.sum if name in ("accepted_K", "offered_K") else np.concatenate)(
            [getattr(c, name) for c in counters], axis=0)
        for name in ("rounds_B", "round_tokens_B", "accepted_K", "offered_K", "num_loose_B", "examined_B",
                     "spent_B")})
    out = statistics(merged)
    if "invalid_logit_tokens" in parts[0]:  # per request (the engine's NaN policy)
        out["invalid_logit_tokens"] = [x for p in parts for x in p["invalid_logit_tokens"]]
    if "csd_memory_filled" in parts[0]:
        out["csd_memory_filled"] = max(p["csd_memory_filled"] for p in parts)
        out["csd_memory_capacity"] = parts[0]["csd_memory_capacity"]
        out["csd_memory_dropped"] = int(sum(p["csd_memory_dropped"] for p in parts))
    if "widths" in parts[0]:  # the adaptive loop's rounds per verified width (docs/adaptive.md)
        widths = np.sum([p["widths"] for p in parts], axis=0)
        out["widths"] = widths.tolist()
        out["mean_width"] = float((widths * np.arange(widths.size)).sum() / max(int(widths.sum()), 1))
    return out
