"""The statistics of several `generate` calls, merged on the host as if they were one call.

The loop's counters (`loop.Counters`) and the statistics of one call made from them
(`loop.statistics`: tau, acceptance per position, loose share, ..., docs/rules.md) are the
loop's state and what it reports, so they live in `loop.py`; this module is what only the host
does with them afterwards: `merge` (benchmarks and sweeps over many calls).

Shapes (docs/rules.md, shape legend): B rows, K draft positions (K = 0 for target-only decoding, which
proposes nothing).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specjax.loop import Counters, statistics


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
