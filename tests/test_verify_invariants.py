"""Invariants docs/rules.md states between rules, and the transformations they must commute with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_verify_reference as ref
from specjax import verify
from specjax.verify import _common
from test_verify_rules import N, Cases


def cases(K=8, V=7, dtype=jnp.float32, seed=0, match=0.6, ninf=0.1, style="mixed"):
    return Cases(K, V, jnp.dtype(dtype), seed, match, ninf, style)


def keys_N(seed=0):
    return jax.random.split(jax.random.key(seed), N)


def same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def batched(rule):
    """jit(vmap) of rule(d, L, k, *params) over cases c and per-case (or shared) params."""
    fn = jax.jit(jax.vmap(rule))
    return lambda c, *params: fn(c.d_NK, c.L, c.k_N, *(np.broadcast_to(p, (N,)) for p in params))


GREEDY = batched(lambda d, L, k: verify.greedy(d, L, num_draft=k))


def per_case(rule, c, *args_N):
    """jit of rule(d, L, k, *args) run case by case (vmapped PRNG compiles slowly on CPU)."""
    fn = jax.jit(rule)
    outs = [fn(c.d_NK[b], c.L[b], c.k_N[b], *(a[b] for a in args_N)) for b in range(N)]
    return jax.tree.map(lambda *x: np.stack(x), *outs)


@pytest.mark.parametrize("rule", ["paper", "reference"])
def test_fly_theta_above_one_is_greedy(rule):
    fly = batched(lambda d, L, k, theta, window: verify.fly(d, L, theta=theta, window=window, rule=rule, num_draft=k))
    for seed, style in [(0, "flat"), (1, "mixed"), (2, "quantized")]:
        c = cases(seed=seed, style=style)
        same(fly(c, 1.01, 1), GREEDY(c))
        same(fly(c, 7.0, 3), GREEDY(c))
    assert np.asarray(fly(c, 0.0, 1).num_loose).any()  # not greedy at all thetas


def test_fly_theta_one_is_not_greedy_on_uniform_rows():
    # docs/rules.md: a uniform row has h = 1, so theta = 1 still lets its mismatch through.
    L = jnp.zeros((4, 5))
    d = jnp.array([1, 0, 0])  # t = 0 everywhere
    assert int(verify.fly(d, L, theta=1.0, window=2).num_accepted) == 3
    assert int(verify.fly(d, L, theta=1.0001, window=2).num_accepted) == 0
    np.testing.assert_array_equal(verify.row_stats(L, jnp.zeros(4, jnp.int32)).entropy_normalized, 1.0)


def test_fly_sampling_theta_above_one_is_speculative_sampling():
    c = cases(seed=3, match=0.5)
    q = c.draft_probs(0.9)  # half the cases are point masses
    ss = per_case(lambda d, L, k, key, q: verify.speculative_sampling(d, L, key, draft_probs=q, temperature=0.9,
                                                                      num_draft=k), c, keys_N(), q)
    for rule in ["paper", "reference"]:
        fly = per_case(lambda d, L, k, key, q: verify.fly(d, L, theta=1.5, window=1, rule=rule, temperature=0.9,
                                                          key=key, draft_probs=q, num_draft=k), c, keys_N(), q)
        same(fly, ss)
    assert (ss.num_accepted > 0).any() and (ss.num_accepted < c.k_N).any()


def test_point_mass_draft_probs_equal_none():
    c = cases(seed=4, match=0.5)
    one_hot = np.eye(c.V, dtype=np.float32)[c.d_NK]
    for rule in [lambda d, L, k, key, q: verify.speculative_sampling(d, L, key, draft_probs=q, num_draft=k),
                 lambda d, L, k, key, q: verify.fly(d, L, theta=0.2, window=1, temperature=1.0, key=key,
                                                    draft_probs=q, num_draft=k)]:
        with_q = per_case(rule, c, keys_N(), one_hot)
        without = per_case(lambda d, L, k, key: rule(d, L, k, key, None), c, keys_N())
        same(with_q, without)


ASD = batched(lambda d, L, k, budget, gate, cap: verify.asd(d, L, budget, gate=gate, block_cap=cap, num_draft=k))


@pytest.mark.parametrize("budget, gate, cap", [(0.0, 0.25, 2), (8.0, 0.0, 2), (8.0, 0.25, 0), (0.0, 0.0, 0)])
def test_asd_strict_settings_are_greedy(budget, gate, cap):
    for seed in range(3):
        c = cases(seed=seed, style="quantized")
        verdict, left = ASD(c, np.float32(budget), np.float32(gate), np.int32(cap))
        same(verdict, GREEDY(c))
        np.testing.assert_array_equal(left, budget)
        # while a loose setting does accept mismatches on these very cases
        assert np.asarray(ASD(c, np.float32(100), np.float32(10), np.int32(8))[0].num_loose).any()


def test_asd_ledger_is_charged_only_for_accepted_mismatches_and_stays_nonnegative():
    rng = np.random.default_rng(0)
    step = jax.jit(lambda d, L, b, k: verify.asd(d, L, b, gate=1.0, block_cap=3, num_draft=k))
    left, K, V = np.float32(3.0), 8, 5
    for _ in range(60):  # one request's rounds: the ledger is never reset
        L = (rng.integers(0, 8, (K + 1, V)) / 4).astype(np.float32)
        d = np.where(rng.random(K) < 0.6, L.argmax(-1)[:K], rng.integers(0, V, K)).astype(np.int32)
        k = int(rng.integers(1, K + 1))
        verdict, new_left = step(d, L, left, k)
        n = int(verdict.num_accepted)
        regret = [L[i].max() - L[i][d[i]] for i in range(n) if d[i] != L[i].argmax()]
        assert new_left >= 0
        np.testing.assert_allclose(left - new_left, np.float32(sum(regret)), atol=1e-6)
        left = new_left
    assert left < 1.0  # the budget did get spent


def test_csd_with_empty_memory_is_greedy_and_learns_the_stopping_mismatch():
    c = cases(seed=5, match=0.7)
    empty = verify.csd_memory(64)
    verdict, memory_N = jax.jit(jax.vmap(lambda d, L, k: verify.csd(d, L, empty, num_draft=k)))(c.d_NK, c.L, c.k_N)
    same(verdict, GREEDY(c))
    for b in range(N):
        d, L = c.sliced(b)
        n = int(verdict.num_accepted[b])
        memory = jax.tree.map(lambda x: x[b], memory_N)
        want = {} if n == len(d) else {(int(d[n]), ref.argmax(L[n])): 1}
        assert memory.to_dict() == want


def test_csd_batch_equals_rows_one_at_a_time_with_increments_summed():
    c = cases(seed=6, match=0.5, style="quantized", V=3)
    counts = {(a, b): 7 for a in range(3) for b in range(3) if a != b}
    memory = verify.csd_memory(64, np.array(list(counts)), np.array(list(counts.values())))
    verdict, after = jax.jit(lambda d, L, k: verify.csd_batch(d, L, memory, min_count=6, tau=0.3, num_draft=k))(
        c.d_NK, c.L, c.k_N)
    total = dict(counts)
    row = jax.jit(lambda d, L, k: verify.csd(d, L, memory, min_count=6, tau=0.3, num_draft=k))
    for b in range(N):
        v, row_memory = row(c.d_NK[b], c.L[b], c.k_N[b])
        same(v, jax.tree.map(lambda x: x[b], verdict))
        for pair, count in row_memory.to_dict().items():
            total[pair] = total.get(pair, 0) + count - counts.get(pair, 0)
    assert after.to_dict() == total
    assert np.asarray(verdict.num_loose).sum() > 0 and sum(total.values()) > sum(counts.values())


def test_typical_and_sampling_at_temperature_zero_are_greedy():
    c = cases(seed=7)
    for rule in [verify.typical, verify.speculative_sampling]:
        got = jax.vmap(lambda d, L, key, k: rule(d, L, key, temperature=0.0, num_draft=k))(c.d_NK, c.L, keys_N(),
                                                                                            c.k_N)
        same(got, GREEDY(c))


# --- every rule commutes with padding past num_draft, jit and vmap ---

KEY = jax.random.key(11)
RULES = {
    "greedy": lambda d, L, k: verify.greedy(d, L, num_draft=k),
    "fly": lambda d, L, k: verify.fly(d, L, theta=0.1, window=1, num_draft=k),
    "fly_reference_top3": lambda d, L, k: verify.fly(d, L, theta=0.2, window=2, entropy="top3", rule="reference",
                                                      num_draft=k),
    "fly_sampling": lambda d, L, k: verify.fly(d, L, theta=0.1, window=1, temperature=0.8, key=KEY, num_draft=k),
    "asd": lambda d, L, k: verify.asd(d, L, 5.0, gate=1.0, suffix="fraction", num_draft=k),
    "csd": lambda d, L, k: verify.csd(d, L, verify.csd_memory(8, [[1, 0], [2, 0]], [9, 9]), tau=0.0, num_draft=k),
    "speculative_sampling": lambda d, L, k: verify.speculative_sampling(d, L, KEY, temperature=1.3, num_draft=k),
    "typical": lambda d, L, k: verify.typical(d, L, KEY, epsilon=0.3, num_draft=k),
}


def _round_inputs(seed, K=6, V=4):
    rng = np.random.default_rng(seed)
    L = (rng.integers(0, 6, (K + 1, V)) / 2).astype(np.float32)
    L[rng.random((K + 1, V)) < 0.1] = -np.inf
    L[:, 0] = np.maximum(L[:, 0], 0)  # keep a finite logit per row
    d = np.where(rng.random(K) < 0.6, L.argmax(-1)[:K], rng.integers(0, V, K)).astype(np.int32)
    return d, L


@pytest.mark.parametrize("name", list(RULES))
def test_num_draft_jit_eager_and_vmap(name):
    """num_draft = k is the rule on d[:k], L[:k+1] (junk padding); jit = eager; vmap = rows."""
    one = jax.jit(RULES[name])
    rows = [_round_inputs(seed) for seed in range(3)]
    for d, L in rows:
        for k in [1, 4]:
            junk_d, junk_L = d.copy(), L.copy()
            junk_d[k:] = 3
            junk_L[k + 1:] = np.nan
            got = one(junk_d, jnp.asarray(junk_L, jnp.bfloat16), jnp.int32(k))
            same(got, one(d[:k], jnp.asarray(L[:k + 1], jnp.bfloat16), None))
    d_B, L_B, k_B = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), np.array([6, 2, 4], np.int32)
    batch = jax.jit(jax.vmap(RULES[name]))(d_B, L_B, k_B)
    for b in range(3):
        same(jax.tree.map(lambda x: x[b], batch), one(d_B[b], L_B[b], k_B[b]))
    same(one(d_B[1], L_B[1], k_B[1]), RULES[name](d_B[1], L_B[1], k_B[1]))  # eager


# --- row_stats ---


def test_row_stats_handles_neg_inf_ties_and_bfloat16():
    L = np.array([[1.0, 3.0, 3.0, -np.inf], [-np.inf, -np.inf, 2.0, -np.inf], [0.5, 0.5, 0.5, 0.5]], np.float32)
    s = verify.row_stats(jnp.asarray(L), jnp.array([3, 2, 1]))
    assert not any(np.isnan(np.asarray(x)).any() for x in s)
    np.testing.assert_array_equal(s.argmax, [1, 2, 0])  # lowest index on ties
    np.testing.assert_array_equal(s.logit_at, [-np.inf, 2.0, 0.5])
    np.testing.assert_array_equal(s.entropy_normalized[1:], [0.0, 1.0])
    for r in range(3):
        np.testing.assert_allclose(s.entropy_normalized[r], ref.entropy(L[r], "normalized"), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(s.entropy_top3[r], ref.entropy(L[r], "top3"), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(s.lse[r], np.log(np.exp(L[r].astype(np.float64)).sum()), rtol=1e-6)
    s16 = verify.row_stats(jnp.asarray(L, jnp.bfloat16), jnp.array([3, 2, 1]))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in s16)
    same(s16, s)  # these values are exact in bfloat16
    one = verify.row_stats(jnp.array([[2.0]]), jnp.array([0]))  # V = 1
    assert float(one.entropy_normalized[0]) == 0.0 and float(one.entropy_top3[0]) == 0.0


def test_padding_helpers():
    assert int(_common.accepted_count(jnp.array([True, True, False, True]))) == 2
    assert int(_common.count_before(jnp.array([True, False, True, True]), jnp.int32(3))) == 2
