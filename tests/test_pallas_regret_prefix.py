"""Cumulative-regret prefix selection: kernel (interpret) == jnp reference == docs/rules.md loop in NumPy."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specjax import pallas as sp

f32 = np.float32


def spec_asd(mis, r, budget, gate, cap, suffix, k, allowed=None):
    """the ASD loop of docs/rules.md, one row, float32 arithmetic (n, spent, num_loose); `allowed`
    is the optional loose_mask veto."""
    K = k
    strict = gate <= 0 or cap <= 0
    R, c, n, loose = f32(0), 0, 0, 0
    for i in range(k):
        if mis[i]:
            if strict or (allowed is not None and not allowed[i]):
                break
            R_prev = R
            R = f32(R + f32(r[i]))
            c += 1
            if isinstance(suffix, str):
                q = f32(K - i) if suffix == "count" else f32(K - i) / f32(K)
            else:
                q = f32(suffix[i])
            if f32(r[i]) / q > f32(gate) or c > cap or not (R_prev < f32(budget) and R <= f32(budget)):
                R = R_prev  # the failing mismatch is not charged
                break
            loose += 1
        n = i + 1
    return n, R, loose


def check(mis, r, budget, *, gate, cap, suffix, k, loose_mask=None):
    B = mis.shape[0]
    kw = dict(gate=gate, block_cap=cap, suffix=suffix, num_draft=k, loose_mask=loose_mask)
    got = sp.regret_prefix(mis, r, budget, impl="kernel", interpret=True, **kw)
    ref = sp.regret_prefix_reference(mis, r, budget, **kw)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    g = np.broadcast_to(np.asarray(gate, np.float32), (B,))
    m = np.broadcast_to(np.asarray(cap, np.float32), (B,))
    bud = np.broadcast_to(np.asarray(budget, np.float32), (B,))
    kk = np.broadcast_to(np.asarray(k if k is not None else mis.shape[1]), (B,))
    want = [spec_asd(mis[b], r[b], bud[b], g[b], m[b],
                     suffix if isinstance(suffix, str) else np.asarray(suffix)[b], int(kk[b]),
                     None if loose_mask is None else loose_mask[b])
            for b in range(B)]
    np.testing.assert_array_equal(np.asarray(got.num_accepted), [w[0] for w in want])
    np.testing.assert_array_equal(np.asarray(got.spent), np.array([w[1] for w in want], f32))
    np.testing.assert_array_equal(np.asarray(got.num_loose), [w[2] for w in want])
    np.testing.assert_array_equal(np.asarray(got.budget_left), bud - np.asarray(got.spent))
    return got


@pytest.mark.parametrize("B,K", [(1, 1), (16, 8), (37, 15), (200, 33)])
@pytest.mark.parametrize("suffix", ["count", "fraction"])
def test_kernel_reference_spec_random(B, K, suffix):
    rng = np.random.default_rng(B * 100 + K)
    mis = rng.random((B, K)) < 0.35
    # quarter-valued regrets and budgets hit the affordability boundaries exactly
    r = np.where(rng.random((B, K)) < 0.5, rng.integers(0, 8, (B, K)) * 0.25,
                 rng.exponential(0.6, (B, K))).astype(f32)
    budget = (rng.integers(0, 12, B) * 0.25).astype(f32)
    k = rng.integers(0, K + 1, B).astype(np.int32)
    k[0] = K
    for gate, cap in [(0.25, 2), (1.0, 3), (5.0, 100), (0.0, 2), (0.5, 0)]:
        check(mis, r, budget, gate=gate, cap=cap, suffix=suffix, k=k)


def test_loose_mask_veto():
    rng = np.random.default_rng(3)
    B, K = 30, 7
    mis = rng.random((B, K)) < 0.5
    r = (rng.integers(0, 4, (B, K)) * 0.25).astype(f32)
    allowed = rng.random((B, K)) < 0.6
    got = check(mis, r, np.full(B, 2.0, f32), gate=1.0, cap=3, suffix="count", k=None,
                loose_mask=allowed)
    # an all-False mask is strict
    strict = check(mis, r, np.full(B, 2.0, f32), gate=1.0, cap=3, suffix="count", k=None,
                   loose_mask=np.zeros((B, K), bool))
    np.testing.assert_array_equal(strict.num_loose, 0)
    assert (np.asarray(got.num_accepted) >= np.asarray(strict.num_accepted)).all()


def test_per_row_gate_cap_and_weights():
    rng = np.random.default_rng(1)
    B, K = 40, 6
    mis = rng.random((B, K)) < 0.5
    r = (rng.integers(0, 6, (B, K)) * 0.25).astype(f32)
    budget = np.full(B, 1.5, f32)
    gate = rng.choice([-1.0, 0.0, 0.1, 0.5, 2.0], B).astype(f32)
    cap = rng.integers(-1, 4, B).astype(np.int32)
    q = rng.uniform(0.5, 3.0, (B, K)).astype(f32)
    check(mis, r, budget, gate=gate, cap=cap, suffix=q, k=None)


def test_edge_cases():
    ones = np.ones((1, 4), bool)
    half = np.full((1, 4), 0.5, f32)
    loose = dict(gate=10.0, cap=10, suffix="count", k=None)
    # budget 0 is strict: the first mismatch stops, like greedy
    got = check(ones, half, np.zeros(1, f32), **loose)
    assert int(got.num_accepted[0]) == 0 and float(got.spent[0]) == 0
    mis = np.array([[False, False, True, False]])
    got = check(mis, half, np.zeros(1, f32), **loose)
    assert int(got.num_accepted[0]) == 2
    # budget exactly spent: 0.5 + 0.5 <= 1.0 accepted, then R_prev == budget stops
    got = check(ones, half, np.ones(1, f32), **loose)
    assert int(got.num_accepted[0]) == 2 and float(got.spent[0]) == 1.0
    assert float(got.budget_left[0]) == 0.0
    # ... and a ledger at exactly zero stays strict
    got = check(ones, half, np.zeros(1, f32), **loose)
    assert int(got.num_accepted[0]) == 0
    # zero regrets with a zero budget: R_prev < budget fails (0 < 0), still strict
    got = check(ones, np.zeros((1, 4), f32), np.zeros(1, f32), **loose)
    assert int(got.num_accepted[0]) == 0
    # block cap: the third mismatch is refused
    got = check(ones, np.zeros((1, 4), f32), np.full(1, 5.0, f32), gate=1.0, cap=2,
                suffix="count", k=None)
    assert int(got.num_accepted[0]) == 2 and int(got.num_loose[0]) == 2
    # padding past num_draft is never accepted, num_draft 0 accepts nothing
    got = check(np.zeros((3, 4), bool), np.zeros((3, 4), f32), np.ones(3, f32),
                gate=1.0, cap=2, suffix="count", k=np.array([0, 2, 4], np.int32))
    np.testing.assert_array_equal(got.num_accepted, [0, 2, 4])
    # gate test reads r / q with q = K - i of the effective K = num_draft
    mis = np.array([[True, False, False, False]])
    r = np.array([[1.0, 0, 0, 0]], f32)
    got = check(mis, r, np.full(1, 5.0, f32), gate=0.5, cap=2, suffix="count", k=np.array([2]))
    assert int(got.num_accepted[0]) == 2   # 1 / 2 = 0.5 is not > 0.5
    got = check(mis, r, np.full(1, 5.0, f32), gate=0.5, cap=2, suffix="count", k=np.array([1]))
    assert int(got.num_accepted[0]) == 0   # 1 / 1 > 0.5


def test_leading_dims_and_scalars():
    rng = np.random.default_rng(2)
    mis = rng.random((2, 3, 5)) < 0.4
    r = rng.exponential(0.3, (2, 3, 5)).astype(f32)
    got = sp.regret_prefix(mis, r, 1.0, impl="kernel", interpret=True, num_draft=4)
    ref = sp.regret_prefix_reference(mis.reshape(6, 5), r.reshape(6, 5), np.ones(6, f32),
                                     num_draft=np.full(6, 4, np.int32))
    assert got.num_accepted.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(got.num_accepted).ravel(), ref.num_accepted)
    np.testing.assert_array_equal(np.asarray(got.spent).ravel(), ref.spent)


def test_dispatch_default_is_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("SPECJAX_PALLAS", raising=False)
    mis = np.array([[True, False]])
    out = sp.regret_prefix(mis, np.array([[0.1, 0.0]], f32), np.ones(1, f32))
    assert int(out.num_accepted[0]) == 2


def test_errors():
    mis, r, b = np.zeros((2, 4), bool), np.zeros((2, 4), f32), np.ones(2, f32)
    with pytest.raises(ValueError, match="regret shape"):
        sp.regret_prefix(mis, np.zeros((2, 3), f32), b)
    with pytest.raises(ValueError, match="K .* must be >= 1"):
        sp.regret_prefix(np.zeros((2, 0), bool), np.zeros((2, 0), f32), b)
    with pytest.raises(ValueError, match="budget_left"):
        sp.regret_prefix(mis, r, np.ones(3, f32))
    with pytest.raises(ValueError, match="suffix"):
        sp.regret_prefix(mis, r, b, suffix="linear")
    with pytest.raises(ValueError, match="suffix weights"):
        sp.regret_prefix(mis, r, b, suffix=np.ones((2, 3), f32))
    with pytest.raises(ValueError, match="num_draft must be an integer"):
        sp.regret_prefix(mis, r, b, num_draft=np.ones(2, f32))
    with pytest.raises(ValueError, match="regret must be floating"):
        sp.regret_prefix(mis, np.zeros((2, 4), np.int32), b)
    with pytest.raises(ValueError, match="loose_mask"):
        sp.regret_prefix(mis, r, b, loose_mask=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="mismatch must be bool"):
        sp.regret_prefix(r, r, b)


_quarter = st.integers(0, 12).map(lambda v: v * 0.25)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), gate=st.sampled_from([-1.0, 0.0, 0.2, 0.5, 3.0]),
       cap=st.integers(-1, 4), suffix=st.sampled_from(["count", "fraction"]))
def test_hypothesis_kernel_reference_spec(data, gate, cap, suffix):
    B, K = 8, 6  # one shape: one kernel compile
    mis = np.array(data.draw(st.lists(st.booleans(), min_size=B * K, max_size=B * K))).reshape(B, K)
    r = np.array(data.draw(st.lists(_quarter, min_size=B * K, max_size=B * K)), f32).reshape(B, K)
    budget = np.array(data.draw(st.lists(_quarter, min_size=B, max_size=B)), f32)
    k = np.array(data.draw(st.lists(st.integers(0, K), min_size=B, max_size=B)), np.int32)
    check(mis, r, budget, gate=gate, cap=cap, suffix=suffix, k=k)


def test_kernel_on_tpu_interpreter():
    """The regret kernel on the TPU interpreter (NaN-initialised buffers, race detection)."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    params = pltpu.InterpretParams(out_of_bounds_reads="uninitialized",
                                   uninitialized_memory="nan", detect_races=True)
    rp = sys.modules["specjax.pallas.regret_prefix"]
    rng = np.random.default_rng(4)
    B, K = 37, 9
    mis = rng.random((B, K)) < 0.4
    r = rng.exponential(0.5, (B, K)).astype(f32)
    k = rng.integers(0, K + 1, B).astype(np.int32)
    _, args = rp._prepare(mis, r, np.ones(B, f32), 0.25, 2, "fraction", k, None)
    got = rp._regret_prefix_kernel(*args, interpret=params, variant="mosaic")
    for a, b in zip(got, rp._regret_prefix_scan(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
