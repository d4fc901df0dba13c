"""The statistics of one call (`loop.statistics`), and of several calls merged (`metrics.merge`)."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax import loop, metrics, verify
from specjax.models import Config, random_model

TINY = Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, rope_theta=10000.0, eos_token_ids=(63,))
PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6], [9, 10, 11, 12, 13, 9, 10, 11]]


def test_merge_of_two_calls():
    merged = metrics.merge([
        {"tau_per_request": [2.0], "rounds_per_request": [3], "round_tokens_per_request": [6], "rounds": 3,
         "accepted_counts_per_position": [3, 0], "offered_per_position": [3, 3], "loose": 1,
         "mismatches_examined": 4, "examined_per_request": [4], "loose_per_request": [1],
         "ledger_spent_per_request": [0.0]},
        {"tau_per_request": [1.0], "rounds_per_request": [1], "round_tokens_per_request": [1], "rounds": 1,
         "accepted_counts_per_position": [0, 0], "offered_per_position": [1, 1], "loose": 0,
         "mismatches_examined": 0, "examined_per_request": [0], "loose_per_request": [0],
         "ledger_spent_per_request": [0.0]}])
    assert merged["tau"] == 1.5 and merged["accepted_per_position"] == [0.75, 0.0]
    assert merged["accepted_per_round"] == 0.75 and merged["loose_share"] == 0.25
    assert merged["rounds"] == 3 and merged["tau_per_request"] == [2.0, 1.0]


@pytest.mark.parametrize("draft, method", [(None, "greedy"), ("pld", "greedy"), ("pld", verify.Asd(budget=2.0))])
def test_merged_calls_equal_one_call(draft, method):
    """Rows are independent under these rules, so the statistics of three one-prompt calls,
    merged, are those of one call on the three prompts (at a fixed K: the adaptive loop's width is
    one per batch, chosen from the whole batch's acceptance)."""
    target = random_model(TINY, seed=0)
    engine = specjax.Engine(target, draft=draft, method=method, k=3, max_new_tokens=10, adaptive=False)
    together = engine.generate(PROMPTS)
    apart = [engine.generate([p]) for p in PROMPTS]
    assert [o.tokens[0] for o in apart] == together.tokens
    merged = metrics.merge([o.stats for o in apart])
    assert merged.keys() == together.stats.keys()
    for key, value in together.stats.items():
        np.testing.assert_allclose(merged[key], value, err_msg=key)


def test_target_only_statistics_have_no_acceptance():
    counters = loop.Counters.zeros(2, 0).update(live_B=np.array([True, False]), emitted_B=np.array([1, 0]))
    stats = loop.statistics(counters)
    assert stats == {"tau": 0.5, "tau_per_request": [1.0, 0.0], "rounds": 1, "rounds_per_request": [1, 0],
                     "round_tokens_per_request": [1, 0]}
    assert metrics.merge([]) == {"tau": 0.0, "tau_per_request": [], "rounds": 0, "rounds_per_request": [],
                                 "round_tokens_per_request": []}


def test_csd_memory_statistics():
    memory = verify.csd_memory(8, [[1, 2], [3, 4]], [2, 5])
    counters = loop.Counters.zeros(1, 2)
    stats = loop.statistics(counters, memory)
    assert (stats["csd_memory_filled"], stats["csd_memory_capacity"], stats["csd_memory_dropped"]) == (2, 8, 0)
    merged = metrics.merge([stats, {**stats, "csd_memory_filled": 3, "csd_memory_dropped": 1}])
    assert (merged["csd_memory_filled"], merged["csd_memory_dropped"]) == (3, 1)
