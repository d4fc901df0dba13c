"""Property tests: every jnp rule agrees with the NumPy reference on random cases.

Each hypothesis example draws a shape bucket and a case style, then a seeded
NumPy generator makes N cases of that shape; the jnp rule runs on all of them
at once (jit of vmap, compiled once per bucket) with num_draft traced and junk
(NaN included) in the padding past it, while the reference runs on the
unpadded d[:k], L[:k+1]. So each example also checks the num_draft contract,
vmap, and bfloat16 input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import test_verify_reference as ref
from specjax import verify

N = 16  # cases per example
# (K, V, logits dtype): few buckets, since jit compiles once per bucket.
SHAPES = [(1, 1, "float32"), (1, 7, "bfloat16"), (4, 2, "float32"), (4, 1000, "bfloat16"), (8, 1, "bfloat16"),
          (8, 3, "bfloat16"), (8, 7, "float32"), (32, 7, "bfloat16"), (32, 1000, "float32")]
# Rules whose compile is heavier (hash-table loops, vmapped PRNG) use a subset.
CSD_SHAPES = [SHAPES[i] for i in (0, 3, 4, 6, 8)]
SAMPLING_SHAPES = [SHAPES[i] for i in (0, 2, 6, 8)]
WINDOWS = [0, 1, 2, 3, 6]
THETAS = [-0.1, 0.0, 0.005, 0.01, 0.05, 0.2, 0.3, 0.6, 0.95, 1.0, 1.5]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Cases:
    """N random cases of one shape: jnp inputs (padded) and reference inputs (sliced)."""

    def __init__(self, K, V, dtype, seed, match, ninf, style):
        self.desc = (f"Cases(K={K}, V={V}, dtype={jnp.dtype(dtype).name}, seed={seed}, match={match}, "
                     f"ninf={ninf}, style={style!r})")
        rng = np.random.default_rng(seed)
        self.K, self.V, self.rng = K, V, rng
        L = np.stack([[self._row(rng, V, style, ninf) for _ in range(K + 1)] for _ in range(N)])
        L = np.array(jnp.asarray(L, dtype).astype(jnp.float32))  # the values the rule sees
        self.k_N = rng.integers(1, K + 1, N).astype(np.int32)
        d = np.empty((N, K), np.int32)
        for b in range(N):
            for i in range(K):
                top = np.flatnonzero(L[b, i] == L[b, i].max())
                if rng.random() < match:  # the argmax, or another tied maximum now and then
                    d[b, i] = top[0] if rng.random() < 0.8 else rng.choice(top)
                else:
                    d[b, i] = rng.integers(V)
            k = self.k_N[b]
            d[b, k:] = rng.integers(0, V, K - k)
            L[b, k + 1:] = np.where(rng.random((K - k, V)) < 0.2, np.nan, rng.normal(0, 5, (K - k, V)))
        self.d_NK, self.L32 = d, L
        self.L = jnp.asarray(L, dtype)

    def __repr__(self):
        return self.desc

    @staticmethod
    def _row(rng, V, style, ninf):
        if style == "mixed":
            style = rng.choice(["normal", "peaked", "flat", "quantized"])
        if style == "normal":
            row = rng.normal(0, rng.choice([0.3, 3.0]), V)
        elif style == "peaked":
            row = rng.normal(0, 0.5, V)
            row[rng.integers(V)] += 8.0
        elif style == "flat":
            row = np.zeros(V) if rng.random() < 0.5 else rng.normal(0, 0.01, V)
        else:  # quantized: exact ties, exact regret sums
            row = rng.integers(-8, 9, V) / 4.0
        row[rng.random(V) < ninf] = -np.inf
        if np.isneginf(row).all():
            row[rng.integers(V)] = 0.0
        return row

    def sliced(self, b):
        k = self.k_N[b]
        return self.d_NK[b, :k], self.L32[b, :k + 1]

    def draft_probs(self, temperature):
        """A drafter's q (softmax of perturbed target rows) and drafts sampled from it.

        Every other case is a point mass on its draft (prompt lookup, greedy
        drafts), the same as draft_probs=None (test_verify_invariants).
        """
        noise = self.rng.normal(0, 1.0, self.L32.shape[:2] + (self.V,))[:, :-1]
        x = (np.nan_to_num(self.L32[:, :-1], nan=0.0, neginf=-30.0) + noise) / temperature
        q = np.exp(x - x.max(-1, keepdims=True))
        q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
        for b in range(N):
            for i in range(self.k_N[b]):
                p = q[b, i].astype(np.float64)
                self.d_NK[b, i] = self.rng.choice(self.V, p=p / p.sum())
        q[::2] = np.eye(self.V, dtype=np.float32)[self.d_NK[::2]]
        return q


@st.composite
def cases(draw, shapes=SHAPES):
    K, V, dtype = draw(st.sampled_from(shapes))
    return Cases(K, V, dtype=jnp.dtype(dtype), seed=draw(st.integers(0, 2**32 - 1)),
                 match=draw(st.sampled_from([0.1, 0.5, 0.9, 1.0])), ninf=draw(st.sampled_from([0.0, 0.0, 0.3])),
                 style=draw(st.sampled_from(["normal", "peaked", "flat", "quantized", "mixed"])))


def per_case(fn, *args_N):
    """fn (jitted for one case) over the N cases; the stacked outputs.

    Used where a vmapped compile is much slower than a plain one (PRNG, hash
    table loops); vmap equals per-row is checked in test_verify_invariants.
    """
    outs = [fn(*(None if a is None else a[b] for a in args_N)) for b in range(N)]
    return jax.tree.map(lambda *x: np.stack(x), *outs)


def agree(got, want, cmps, what):
    """Rows must match the reference unless its comparisons sat on a float near-tie."""
    got = [np.asarray(x) for x in got]
    for b, (w, c) in enumerate(zip(want, cmps)):
        g = tuple(int(x[b]) for x in got)
        assert g == tuple(w[:3]) or c.fragile, f"{what}, case {b}: jnp {g} != reference {tuple(w[:3])}"


@jax.jit
@jax.vmap
def noise_fn(key):
    """u and Gumbel noise as docs/rules.md's key use draws them, for the largest bucket.

    Threefry draws are prefix-consistent (test_threefry_draws_are_prefix_consistent),
    so slicing them gives the draws of every smaller K and V with one compile.
    """
    ku, kr = jax.random.split(key)
    K, V = max(s[0] for s in SHAPES), max(s[1] for s in SHAPES)
    return jax.random.uniform(ku, (K,), jnp.float32), jax.random.gumbel(kr, (V,), jnp.float32)


def keys_and_noise(c, seed):
    keys = jax.random.split(jax.random.key(seed), N)
    u, g = (np.asarray(x) for x in noise_fn(keys))
    return keys, [u[b, :c.k_N[b]] for b in range(N)], g[:, :c.V]


def test_threefry_draws_are_prefix_consistent():
    key = jax.random.key(7)
    for K in (1, 5, 32):
        assert np.array_equal(jax.random.uniform(key, (K,)), jax.random.uniform(key, (40,))[:K])
        assert np.array_equal(jax.random.gumbel(key, (K,)), jax.random.gumbel(key, (1000,))[:K])


# --- greedy ---


@functools.lru_cache(maxsize=None)
def greedy_fn():
    return jax.jit(jax.vmap(lambda d, L, k: verify.greedy(d, L, num_draft=k)))


@SETTINGS
@given(cases())
def test_greedy_matches_reference(c):
    got = greedy_fn()(c.d_NK, c.L, c.k_N)
    agree(got, [ref.greedy_ref(*c.sliced(b)) for b in range(N)], [ref.Cmp()] * N, "greedy")


# --- fly at T = 0 ---


@functools.lru_cache(maxsize=None)
def fly_fn(entropy, rule):
    def one(d, L, k, theta, window):
        return verify.fly(d, L, theta=theta, window=window, entropy=entropy, rule=rule, num_draft=k)

    return jax.jit(jax.vmap(one))


fly_options = st.tuples(st.sampled_from(["normalized", "top3"]), st.sampled_from(["paper", "reference"]))


def fly_params(c, rule):
    """Per-case theta and window (traced, so one compile serves all of them)."""
    windows = [w for w in WINDOWS if w >= 1 or rule == "paper"]
    return c.rng.choice(THETAS, N).astype(np.float32), c.rng.choice(windows, N).astype(np.int32)


@SETTINGS
@given(cases(), fly_options)
def test_fly_matches_reference(c, options):
    entropy, rule = options
    theta_N, window_N = fly_params(c, rule)
    got = fly_fn(entropy, rule)(c.d_NK, c.L, c.k_N, theta_N, window_N)
    cmps = [ref.Cmp() for _ in range(N)]
    want = [ref.fly_ref(*c.sliced(b), theta=float(theta_N[b]), window=int(window_N[b]), entropy_kind=entropy,
                        rule=rule, cmp=cmps[b]) for b in range(N)]
    agree(got, want, cmps, f"fly {options}")


# --- asd ---


@functools.lru_cache(maxsize=None)
def asd_fn(suffix):
    def one(d, L, k, budget, gate, cap):
        return verify.asd(d, L, budget, gate=gate, block_cap=cap, suffix=suffix, num_draft=k)

    return jax.jit(jax.vmap(one))


@SETTINGS
@given(cases(), st.sampled_from(["count", "fraction"]))
def test_asd_matches_reference(c, suffix):
    budget_N = c.rng.choice([0.0, 0.5, 1.0, 2.0, 8.0, 100.0], N).astype(np.float32)
    gate_N = c.rng.choice([0.0, 0.05, 0.25, 1.0, 10.0], N).astype(np.float32)
    cap_N = c.rng.choice([0, 1, 2, 100], N).astype(np.int32)
    (n, nxt, loose), left = asd_fn(suffix)(c.d_NK, c.L, c.k_N, budget_N, gate_N, cap_N)
    cmps = [ref.Cmp() for _ in range(N)]
    want = [ref.asd_ref(*c.sliced(b), budget_N[b], gate=gate_N[b], block_cap=cap_N[b], suffix=suffix, cmp=cmps[b])
            for b in range(N)]
    agree((n, nxt, loose), want, cmps, f"asd {suffix}")
    left = np.asarray(left)
    assert (left >= 0).all(), "the ledger went below zero"
    for b, w in enumerate(want):
        if not cmps[b].fragile:  # the loop's float32 sum in the loop's order: bit for bit
            assert left[b] == w.extra, f"asd ledger, case {b}: {left[b]!r} != reference {w.extra!r}"


# --- csd (one sequence) ---


def random_counts(c):
    """A table that knows some of the mismatches in these cases, with counts around min_count."""
    counts = {}
    for b in range(N):
        d, L = c.sliced(b)
        for i in range(len(d)):
            if c.rng.random() < 0.6:
                counts[(int(d[i]), ref.argmax(L[i]))] = int(c.rng.integers(1, 10))
    return counts


def build_memory(counts, capacity):
    # Padded to a fixed P with zero counts (which add nothing): one compile.
    pairs = np.zeros((N * 32, 2), np.int32)
    values = np.zeros(N * 32, np.int32)
    pairs[:len(counts)], values[:len(counts)] = list(counts) or np.zeros((0, 2)), list(counts.values())
    return verify.csd_memory(capacity, pairs, values)


@jax.jit
def csd_fn(d, L, k, memory, min_count, tau):
    return verify.csd(d, L, memory, min_count=min_count, tau=tau, num_draft=k)


@SETTINGS
@given(cases(CSD_SHAPES))
def test_csd_matches_reference(c):
    counts = random_counts(c)
    memory = build_memory(counts, 512)
    min_count_N = c.rng.choice([-1, 0, 3, 6], N).astype(np.int32)
    tau_N = c.rng.choice([0.0, 1e-4, 0.01, 0.5, 1.0], N).astype(np.float32)
    got, memory_N = per_case(lambda *a: csd_fn(*a[:3], memory, *a[3:]), c.d_NK, c.L, c.k_N, min_count_N, tau_N)
    cmps = [ref.Cmp() for _ in range(N)]
    want = [ref.csd_ref(*c.sliced(b), counts, min_count=int(min_count_N[b]), tau=float(tau_N[b]), update=True,
                        cmp=cmps[b]) for b in range(N)]
    agree(got, want, cmps, "csd")
    for b, w in enumerate(want):  # each row's memory: the table plus its own increments
        if not cmps[b].fragile:
            row_memory = jax.tree.map(lambda x: x[b], memory_N)
            expected = dict(counts)
            for pair, inc in w.extra.items():
                expected[pair] = expected.get(pair, 0) + inc
            assert row_memory.to_dict() == {p: v for p, v in expected.items() if v > 0}, f"csd memory, case {b}"


# --- csd_batch: one shared table, row-major drops when full ---


@jax.jit
def csd_batch_fn(d, L, memory, k, active, min_count, tau):
    return verify.csd_batch(d, L, memory, min_count=min_count, tau=tau, num_draft=k, active=active)


@SETTINGS
@given(cases(CSD_SHAPES), st.sampled_from([(-1, 0.0), (0, 0.01), (3, 0.5)]), st.integers(0, 24))
def test_csd_batch_matches_reference(c, options, prefill):
    # A table of 24 pairs: small buckets leave room, large ones fill it and drop.
    min_count, tau = options
    capacity = 24
    counts = dict(list(random_counts(c).items())[:prefill])
    active = c.rng.random(N) < 0.8
    (n, nxt, loose), memory = csd_batch_fn(c.d_NK, c.L, build_memory(counts, capacity), c.k_N, active,
                                           np.int32(min_count), np.float32(tau))
    cmp = ref.Cmp()
    rows = [c.sliced(b) for b in range(N)]
    want, table, dropped = ref.csd_batch_ref(rows, counts, capacity, min_count=min_count, tau=tau, update=True,
                                             cmp=cmp, active=active)
    agree((n, nxt, loose), want, [cmp] * N, f"csd_batch {options}")
    if not cmp.fragile:
        assert memory.to_dict() == {p: v for p, v in table.items() if v > 0}
        assert int(memory.dropped) == dropped and int(memory.filled) == len(memory.to_dict()) <= capacity


# --- T > 0: speculative sampling, fly, typical ---


@jax.jit
def sampling_fn(d, L, k, key, q):
    return verify.speculative_sampling(d, L, key, draft_probs=q, temperature=0.7, num_draft=k)


@SETTINGS
@given(cases(SAMPLING_SHAPES), st.integers(0, 2**31 - 1))
def test_speculative_sampling_matches_reference(c, seed):
    temperature = 0.7
    q = c.draft_probs(temperature)
    keys, u, g = keys_and_noise(c, seed)
    got = per_case(sampling_fn, c.d_NK, c.L, c.k_N, keys, q)
    cmps = [ref.Cmp() for _ in range(N)]
    want = [ref.sampling_ref(*c.sliced(b), u[b], g[b], q=q[b], temperature=temperature, cmp=cmps[b])[0]
            for b in range(N)]
    agree(got, want, cmps, f"speculative_sampling T={temperature}")


@functools.lru_cache(maxsize=None)
def fly_sampling_fn(entropy, rule, temperature):
    def one(d, L, k, theta, window, key, q):
        return verify.fly(d, L, theta=theta, window=window, entropy=entropy, rule=rule, temperature=temperature,
                          key=key, draft_probs=q, num_draft=k)

    return jax.jit(one)


@SETTINGS
@given(cases(SAMPLING_SHAPES), st.sampled_from([("normalized", "paper"), ("top3", "reference")]),
       st.integers(0, 2**31 - 1))
def test_fly_sampling_matches_reference(c, options, seed):
    # The gate and window logic is the T = 0 rule's (tested above on every option).
    entropy, rule = options
    temperature = 0.8
    q = c.draft_probs(temperature)
    keys, u, g = keys_and_noise(c, seed)
    theta_N, window_N = fly_params(c, rule)
    got = per_case(fly_sampling_fn(entropy, rule, temperature), c.d_NK, c.L, c.k_N, theta_N, window_N, keys, q)
    cmps = [ref.Cmp() for _ in range(N)]
    want = [ref.fly_sampling_ref(*c.sliced(b), u[b], g[b], q=q[b], temperature=temperature,
                                 theta=float(theta_N[b]), window=int(window_N[b]), entropy_kind=entropy, rule=rule,
                                 cmp=cmps[b]) for b in range(N)]
    agree(got, want, cmps, f"fly T>0 {options}")


@jax.jit
def typical_fn(d, L, k, key, epsilon, delta):
    return verify.typical(d, L, key, epsilon=epsilon, delta=delta, temperature=0.5, num_draft=k)


@SETTINGS
@given(cases(SAMPLING_SHAPES), st.integers(0, 2**31 - 1))
def test_typical_matches_reference(c, seed):
    temperature = 0.5
    keys, _, g = keys_and_noise(c, seed)
    eps_N = c.rng.choice([0.01, 0.09, 0.3], N).astype(np.float32)
    delta_N = c.rng.choice([0.1, 0.3, 0.9], N).astype(np.float32)
    got = per_case(typical_fn, c.d_NK, c.L, c.k_N, keys, eps_N, delta_N)
    cmps = [ref.Cmp() for _ in range(N)]
    want = [ref.typical_ref(*c.sliced(b), g[b], epsilon=float(eps_N[b]), delta=float(delta_N[b]),
                            temperature=temperature, cmp=cmps[b]) for b in range(N)]
    agree(got, want, cmps, f"typical T={temperature}")
