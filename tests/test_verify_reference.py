"""Plain NumPy reference of every rule, written loop by loop from docs/rules.md.

It shares no code with specjax.verify. Probabilities and entropies are taken
in float64 and rounded to float32 where docs/rules.md compares them (rule arithmetic
is float32); logit differences and regret sums are float32 as in the rules.
Random draws (u, Gumbel noise) are inputs, made by the tests with the key use
docs/rules.md fixes. `Cmp` records comparisons that land within float noise of their
threshold: only such "fragile" cases may disagree with the jnp rules.

The tests at the bottom pin the reference itself on hand-worked examples.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

F32 = np.float32


class Ref(NamedTuple):
    n: int
    next_token: int
    num_loose: int
    extra: object = None  # ASD: budget_left'; CSD: increments {(d, t): count}


class Cmp:
    """Threshold comparisons that remember near-ties (float noise can flip them)."""

    def __init__(self, rel=2e-5):
        self.rel, self.fragile = rel, False

    def _near(self, a, b):
        a, b = float(a), float(b)
        if math.isfinite(a) and math.isfinite(b) and a != b and abs(a - b) <= self.rel * max(1.0, abs(a), abs(b)):
            self.fragile = True

    def ge(self, a, b):
        self._near(a, b)
        return a >= b

    def gt(self, a, b):
        self._near(a, b)
        return a > b

    def lt(self, a, b):
        self._near(a, b)
        return a < b

    def le(self, a, b):
        self._near(a, b)
        return a <= b


def argmax(row):
    """Lowest index among the maxima."""
    return int(np.flatnonzero(row == np.max(row))[0])


def softmax64(row, temperature=1.0):
    x = np.asarray(row, np.float64) / temperature
    e = np.exp(x - x.max())  # exp(-inf) = 0
    return e / e.sum()


def plogp(p):
    """p log p with 0 log 0 = 0."""
    p = np.asarray(p, np.float64)
    return np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)


def entropy(row, kind):
    """docs/rules.md Entropy: "normalized" in [0, 1] or "top3" in nats, as float32."""
    p = softmax64(row)
    V = len(p)
    if kind == "normalized":
        return F32(0.0) if V == 1 else F32(min(1.0, max(0.0, -plogp(p).sum() / math.log(V))))
    top = np.sort(p)[::-1][: min(3, V)]
    return F32(max(0.0, -plogp(top).sum()))


def greedy_ref(d, L):
    K = len(d)
    t = [argmax(L[i]) for i in range(K + 1)]
    n = 0
    for i in range(K):
        if d[i] != t[i]:
            break
        n = i + 1
    return Ref(n, t[n], 0)


def fly_ref(d, L, *, theta, window, entropy_kind, rule, cmp, ex=None):
    """FLy at T = 0, or at T > 0 with `ex` the speculative-sampling accept flags."""
    K = len(d)
    t = [argmax(L[i]) for i in range(K + 1)]
    if ex is None:
        ex = [d[i] == t[i] for i in range(K)]
    theta32 = F32(theta)
    acc = []
    for j in range(K):
        if ex[j]:
            acc.append(True)
            continue
        h = entropy(L[j], entropy_kind)
        if rule == "paper":
            gate = theta <= 0 or cmp.ge(h, theta32)
            win = j + window <= K - 1 and all(ex[j + 1: j + window + 1])
        else:
            gate = not theta > 0.01 or cmp.ge(h, theta32)
            win = j <= K - window - 1 and all(ex[j + 1: j + window])
        acc.append(gate and win)
    n = 0
    while n < K and acc[n]:
        n += 1
    return Ref(n, t[n], sum(not ex[i] for i in range(n)))


def asd_ref(d, L, budget_left, *, gate, block_cap, suffix, cmp, allowed=None):
    K = len(d)
    t = [argmax(L[i]) for i in range(K + 1)]
    b, g = F32(budget_left), F32(gate)
    strict = gate <= 0 or block_cap <= 0
    R, c, n, charged = F32(0), 0, 0, F32(0)
    for i in range(K):
        if d[i] != t[i]:
            if strict or (allowed is not None and not allowed[i]):
                break
            r = F32(L[i][t[i]]) - F32(L[i][d[i]])
            q = F32(K - i) if suffix == "count" else F32(K - i) / F32(K)
            R_prev = R
            R = F32(R + r)
            c += 1
            if cmp.gt(F32(r / q), g) or c > block_cap or not (cmp.lt(R_prev, b) and cmp.le(R, b)):
                break
            charged = R
        n = i + 1
    return Ref(n, t[n], sum(d[i] != t[i] for i in range(n)), F32(b - charged))


def csd_ref(d, L, counts, *, min_count, tau, update, cmp, live=False, allowed=None):
    """CSD's scan. Reads the start-of-round `counts`, or with live=True the
    counts as this scan updates them (docs/rules.md claims both give the same n)."""
    K = len(d)
    t = [argmax(L[i]) for i in range(K + 1)]
    inc = {}
    log_tau = F32(np.log(F32(tau))) if tau > 0 else F32(-np.inf)
    n = K
    for i in range(K):
        if d[i] == t[i]:
            continue
        pair = (int(d[i]), int(t[i]))
        c = counts.get(pair, 0) + (inc.get(pair, 0) if live else 0)
        ok = c > min_count and cmp.ge(F32(L[i][d[i]]) - F32(L[i][t[i]]), log_tau)
        ok = ok and (allowed is None or allowed[i])
        if update:
            inc[pair] = inc.get(pair, 0) + 1
        if not ok:
            n = i
            break
    return Ref(n, t[n], sum(d[i] != t[i] for i in range(n)), inc)


def csd_batch_ref(rows, counts, capacity, *, min_count, tau, update, cmp, active=None):
    """rows: [(d, L)]; returns ([Ref], counts', dropped) with a table of `capacity` pairs."""
    refs = [csd_ref(d, L, counts, min_count=min_count, tau=tau, update=update, cmp=cmp) for d, L in rows]
    table, dropped = dict(counts), 0
    for b, (d, L) in enumerate(rows):  # row-major: row, then position
        if active is not None and not active[b]:
            continue
        t = [argmax(L[i]) for i in range(len(d))]
        for i in range(len(d)):
            pair = (int(d[i]), int(t[i]))
            if d[i] == t[i] or i > refs[b].n or not update:
                continue
            if pair in table:
                table[pair] += 1
            elif len(table) < capacity:
                table[pair] = 1
            else:
                dropped += 1
    return refs, table, dropped


def categorical_ref(p, gumbel, cmp):
    """argmax(log p + g): jax.random.categorical's Gumbel-max draw with the same noise."""
    with np.errstate(divide="ignore"):
        scores = np.log(p) + np.asarray(gumbel, np.float64)
    best = int(np.argmax(scores))  # first maximum
    others = np.delete(scores, best)
    if len(others) and np.isfinite(scores[best]) and scores[best] - others.max() < 1e-4:
        cmp.fragile = True
    return best


def sampling_ref(d, L, u, gumbel, *, q=None, temperature, cmp):
    """Speculative sampling; returns (Ref, accept flags) so FLy can reuse the flags."""
    K = len(d)
    p = [softmax64(L[i], temperature) for i in range(K + 1)]
    flags = []
    for i in range(K):
        qd = 1.0 if q is None else float(q[i][d[i]])
        ratio = 1.0 if qd == 0 else min(1.0, F32(p[i][d[i]]) / qd)
        flags.append(bool(cmp.lt(u[i], ratio)))
    n = 0
    while n < K and flags[n]:
        n += 1
    return Ref(n, residual_ref(d, p, n, q, gumbel, cmp), 0), flags


def residual_ref(d, p, n, q, gumbel, cmp):
    K, V = len(d), len(p[0])
    if n == K:
        q_n = np.zeros(V)
    elif q is None:
        q_n = np.eye(V)[d[n]]
    else:
        q_n = np.asarray(q[n], np.float64)
    r = np.maximum(0.0, p[n] - q_n)
    if 0 < r.sum() < 1e-5:  # float32 may see an exact zero here
        cmp.fragile = True
    r = r / r.sum() if r.sum() > 0 else p[n]
    return categorical_ref(r, gumbel, cmp)


def fly_sampling_ref(d, L, u, gumbel, *, q=None, temperature, theta, window, entropy_kind, rule, cmp):
    _, flags = sampling_ref(d, L, u, gumbel, q=q, temperature=temperature, cmp=cmp)
    base = fly_ref(d, L, theta=theta, window=window, entropy_kind=entropy_kind, rule=rule, cmp=cmp, ex=flags)
    p = [softmax64(L[i], temperature) for i in range(len(d) + 1)]
    n = base.n
    return Ref(n, residual_ref(d, p, n, q, gumbel, cmp), sum(not flags[i] for i in range(n)))


def typical_ref(d, L, gumbel, *, epsilon, delta, temperature, cmp):
    K = len(d)
    n = 0
    for i in range(K):
        p = softmax64(L[i], temperature)
        H = -plogp(p).sum()
        if not cmp.gt(F32(p[d[i]]), F32(min(epsilon, delta * math.exp(-H)))):
            break
        n = i + 1
    nxt = categorical_ref(softmax64(L[n], temperature), gumbel, cmp)
    return Ref(n, nxt, sum(d[i] != argmax(L[i]) for i in range(n)))


# --- the reference on hand-worked examples (independent of the jnp rules) ---


def _rows(targets, V=5):
    """Logits whose argmax per row is `targets[i]`: a peaked row at that token."""
    L = np.zeros((len(targets), V), np.float32)
    for i, tok in enumerate(targets):
        L[i, tok] = 4.0
    return L


def test_greedy_ref_example():
    L = _rows([1, 2, 3, 4])
    assert greedy_ref([1, 2, 0], L) == Ref(2, 3, 0)
    assert greedy_ref([1, 2, 3], L) == Ref(3, 4, 0)
    assert greedy_ref([0, 2, 3], L) == Ref(0, 1, 0)


def test_fly_ref_window_reads_raw_flags():
    # ex = [T, F, T, T, F, T, T, T], K = 8; flat rows so the gate passes.
    d = [0, 9, 0, 0, 9, 0, 0, 0]
    L = np.zeros((9, 10), np.float32)
    L[:, 0] = 0.01  # argmax 0, nearly uniform: high entropy
    c = Cmp()
    # paper, W = 2: j=1 needs ex[2..3] -> ok; j=4 needs ex[5..6] and 4+2 <= 7 -> ok.
    assert fly_ref(d, L, theta=0.3, window=2, entropy_kind="normalized", rule="paper", cmp=c) == Ref(8, 0, 2)
    # W = 3: j=1 needs ex[2..4], ex[4] is a mismatch -> blocked, even though 4 could pass itself.
    assert fly_ref(d, L, theta=0.3, window=3, entropy_kind="normalized", rule="paper", cmp=c) == Ref(1, 0, 0)
    # reference rule, W = 3: W-1 = 2 matches ex[2..3] and j <= 8-3-1 -> j=1 ok; j=4 ok (4 <= 4).
    assert fly_ref(d, L, theta=0.3, window=3, entropy_kind="normalized", rule="reference", cmp=c) == Ref(8, 0, 2)
    # theta above 1: greedy.
    assert fly_ref(d, L, theta=1.5, window=2, entropy_kind="normalized", rule="paper", cmp=c) == Ref(1, 0, 0)


def test_asd_ref_budget_and_cap():
    d = [1, 0, 1, 0]
    L = np.zeros((5, 3), np.float32)
    L[:, 0] = 1.0  # t = 0 everywhere; a draft of 1 has regret 1
    c = Cmp()
    # count suffix: r/q = 1/4 at i=0 passes g = 0.25, 1/2 at i=2 does not.
    assert asd_ref(d, L, 8.0, gate=0.25, block_cap=2, suffix="count", cmp=c) == Ref(2, 0, 1, F32(7.0))
    assert asd_ref(d, L, 8.0, gate=1.0, block_cap=2, suffix="count", cmp=c) == Ref(4, 0, 2, F32(6.0))
    assert asd_ref(d, L, 8.0, gate=1.0, block_cap=1, suffix="count", cmp=c) == Ref(2, 0, 1, F32(7.0))
    # a budget spent to exactly 0 is strict: R_prev = 1 is not < 1.
    assert asd_ref(d, L, 1.0, gate=1.0, block_cap=2, suffix="count", cmp=c) == Ref(2, 0, 1, F32(0.0))
    assert asd_ref(d, L, 0.0, gate=1.0, block_cap=2, suffix="count", cmp=c) == Ref(0, 0, 0, F32(0.0))
    # fraction suffix: q = (K-i)/K = 1 at i=0, so r/q = 1 > 0.25.
    assert asd_ref(d, L, 8.0, gate=0.25, block_cap=2, suffix="fraction", cmp=c) == Ref(0, 0, 0, F32(8.0))


def test_csd_ref_counts_reached_mismatches_only():
    d = [1, 0, 2, 0]
    L = np.zeros((5, 3), np.float32)
    L[:, 0] = 0.001  # t = 0, consistency gap tiny
    c = Cmp()
    ref = csd_ref(d, L, {(1, 0): 7}, min_count=6, tau=0.01, update=True, cmp=c)
    assert ref == Ref(2, 0, 1, {(1, 0): 1, (2, 0): 1})  # (2, 0) stops the scan; nothing after it
    assert csd_ref(d, L, {}, min_count=6, tau=0.01, update=True, cmp=c) == Ref(0, 0, 0, {(1, 0): 1})


def test_csd_ref_start_of_round_reads_equal_live_reads():
    # docs/rules.md: counts only grow and a repeated pair is reached again only if its
    # first occurrence passed, so the start-of-round table decides the same n.
    rng = np.random.default_rng(0)
    loose = 0
    for _ in range(500):
        K, V = 12, 3
        L = rng.integers(0, 3, (K + 1, V)).astype(np.float32)
        d = rng.integers(0, V, K)
        counts = {(a, b): int(rng.integers(0, 4)) for a in range(V) for b in range(V) if rng.random() < 0.7}
        kw = dict(min_count=int(rng.integers(-1, 3)), tau=0.5, update=True, cmp=Cmp())
        ref = csd_ref(d, L, counts, **kw)
        assert ref[:3] == csd_ref(d, L, counts, live=True, **kw)[:3]
        loose += ref.num_loose
    assert loose > 50  # the cases do exercise loose acceptance


def test_entropy_ref():
    assert entropy(np.zeros(7, np.float32), "normalized") == 1.0
    assert entropy(np.array([0.0, -np.inf, -np.inf], np.float32), "normalized") == 0.0
    assert entropy(np.zeros(1, np.float32), "normalized") == 0.0
    assert np.isclose(entropy(np.zeros(7, np.float32), "top3"), F32(3 / 7 * math.log(7)))
