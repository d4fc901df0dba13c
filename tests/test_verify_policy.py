"""The policy layer: every method behind one interface, carried by a jitted while_loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_verify_reference as ref
from specjax import verify

R, B, K, V = 3, 4, 5, 6  # rounds, rows, drafts, vocabulary
rng = np.random.default_rng(0)
L_RBKV = jnp.asarray((rng.integers(0, 8, (R, B, K + 1, V)) / 4).astype(np.float32), jnp.bfloat16)
_t = np.asarray(L_RBKV.astype(jnp.float32)).argmax(-1)[..., :K]
D_RBK = jnp.asarray(np.where(rng.random((R, B, K)) < 0.7, _t, rng.integers(0, V, (R, B, K))), jnp.int32)
K_RB = jnp.asarray(rng.integers(1, K + 1, (R, B)), jnp.int32)
ACTIVE_RB = jnp.asarray(rng.random((R, B)) < 0.75).at[0].set(True)
Q_RBKV = jax.nn.softmax(jnp.asarray(rng.normal(size=(R, B, K, V)), jnp.float32), -1)
MEMORY = verify.csd_memory(32, [[a, b] for a in range(V) for b in range(V) if a != b], [7] * (V * V - V))


def expected(policy, state, r, keys_B, q):
    """What the policy must return in round r, from the public rules called directly."""
    o, T, d, L, k = policy.opts, policy.temperature, D_RBK[r], L_RBKV[r], K_RB[r]
    rows = lambda f, *xs: jax.vmap(f)(d, L, k, *xs)
    if policy.method == "greedy":
        return rows(lambda d, L, k: verify.greedy(d, L, num_draft=k)), state
    if policy.method == "sampling":
        return rows(lambda d, L, k, key, q: verify.speculative_sampling(d, L, key, draft_probs=q, temperature=T,
                                                                        num_draft=k), keys_B, q), state
    if policy.method == "typical":
        return rows(lambda d, L, k, key: verify.typical(d, L, key, epsilon=o["epsilon"], delta=o["delta"],
                                                        temperature=T, num_draft=k), keys_B), state
    if policy.method == "fly":
        return rows(lambda d, L, k, key, q: verify.fly(d, L, theta=o["theta"], window=o["window"], rule=o["rule"],
                                                       entropy=o["entropy"], temperature=T, key=key, draft_probs=q,
                                                       num_draft=k), keys_B, q), state
    if policy.method == "asd":
        verdict, left = rows(lambda d, L, k, b: verify.asd(d, L, b, gate=o["gate"], block_cap=o["block_cap"],
                                                            suffix=o["suffix"], num_draft=k), state)
        return verdict, jnp.where(ACTIVE_RB[r], left, state)
    assert policy.method == "csd"
    return verify.csd_batch(d, L, state, min_count=o["min_count"], tau=o["tau"], num_draft=k, active=ACTIVE_RB[r])


def run_rounds(policy, with_q):
    """R rounds in one jitted while_loop: the policy's results next to the expected ones."""
    @jax.jit
    def loop(state, key):
        def body(carry):
            r, state, want_state, key, ok, stats = carry
            key, kr = jax.random.split(key)
            keys_B = jax.random.split(kr, B) if policy.temperature > 0 else None
            q = Q_RBKV[r] if with_q else None
            verdict, state, info = policy.verify(state, D_RBK[r], L_RBKV[r], K_RB[r], kr, ACTIVE_RB[r],
                                                 draft_probs_BKV=q)
            want, want_state = expected(policy, want_state, r, keys_B, q)
            a = ACTIVE_RB[r]
            for x, y in zip(verdict, want):  # inactive rows' verdicts are irrelevant
                ok &= jnp.all(jnp.where(a, x, 0) == jnp.where(a, y, 0))
            for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
                ok &= jnp.all(x == y)
            ok &= jnp.all(info["num_loose"] == jnp.where(a, verdict.num_loose, 0))
            stopped = (verdict.num_accepted < K_RB[r]).astype(jnp.int32)
            ok &= jnp.all(info["examined"] == jnp.where(a, verdict.num_loose + stopped, 0))
            stats = jax.tree.map(lambda s, x: s + x.sum(), stats, (info["num_loose"], info["examined"], info["spent"]))
            return r + 1, state, want_state, key, ok, stats

        zero = (jnp.int32(0), jnp.int32(0), jnp.float32(0))
        carry = (jnp.int32(0), state, state, key, jnp.bool_(True), zero)
        return jax.lax.while_loop(lambda c: c[0] < R, body, carry)

    _, state, _, _, ok, stats = loop(policy.init_state(B), jax.random.key(1))
    return bool(ok), state, stats


METHODS = [
    ("greedy", 0.0, {}, False),
    ("exact", 0.0, {}, False),
    ("sampling", 0.8, {}, True),
    ("sampling", 0.0, {}, False),
    ("typical", 0.7, {"epsilon": 0.2}, False),
    ("fly", 0.0, {"theta": 0.0, "window": 1}, False),
    ("fly", 0.9, {"theta": 0.1, "window": 2, "rule": "reference", "entropy": "top3"}, True),
    ("asd", 0.0, {"budget": 3.0, "gate": 1.0}, False),
    ("csd", 0.0, {"csd_memory": MEMORY, "tau": 0.5}, False),
]


@pytest.mark.parametrize("method, temperature, options, with_q", METHODS, ids=[f"{m}-{t}" for m, t, _, _ in METHODS])
def test_policy_matches_the_rules_inside_a_while_loop(method, temperature, options, with_q):
    policy = verify.make_policy(method, k=K, temperature=temperature, **options)
    ok, state, (loose, examined, spent) = run_rounds(policy, with_q)
    assert ok
    assert examined >= loose
    if method in ("fly", "asd", "csd"):
        assert loose > 0, "these settings should accept some mismatches"
    if method == "asd":
        left = np.asarray(state)
        assert (left >= 0).all() and np.isclose(spent, (3.0 - left).sum())
    else:
        assert spent == 0


def test_inactive_rows_charge_no_ledger_and_teach_no_memory():
    active = jnp.array([False, True, False, True])
    d, L, k = D_RBK[0], L_RBKV[0], K_RB[0]
    for method, options in [("asd", {"gate": 10.0, "budget": 100.0}), ("csd", {"csd_memory": MEMORY, "tau": 0.0})]:
        policy = verify.make_policy(method, k=K, **options)
        state, step = policy.init_state(B), jax.jit(policy.verify)
        _, none_active, info = step(state, d, L, k, None, jnp.zeros(B, bool))
        assert all(int(jnp.abs(x).sum()) == 0 for x in info.values())
        if method == "asd":
            np.testing.assert_array_equal(none_active, state)
            _, some, _ = step(state, d, L, k, None, active)
            np.testing.assert_array_equal(some[~active], state[~active])
            assert (np.asarray(some)[np.asarray(active)] < 100.0).any()
        else:
            assert none_active.to_dict() == MEMORY.to_dict()


@pytest.mark.parametrize("method", ["asd", "csd"])
def test_fly_entropy_gate_composes_with_asd_and_csd(method):
    # Composition: a mismatch may be loosely accepted only where FLy's gate h >= theta holds.
    d32 = np.asarray(L_RBKV.astype(jnp.float32))
    options = {"asd": {"gate": 10.0, "block_cap": 5, "budget": 50.0}, "csd": {"csd_memory": MEMORY, "tau": 0.0}}
    loose = {}
    for theta in [None, 0.9, 2.0]:
        policy = verify.make_policy(method, k=K, theta=theta, **options[method])
        state = policy.init_state(B)
        verdict, _, _ = jax.jit(policy.verify)(state, D_RBK[0], L_RBKV[0], K_RB[0], None, None)
        for b in range(B):
            k = int(K_RB[0, b])
            d, L = np.asarray(D_RBK[0, b])[:k], d32[0, b, :k + 1]
            allowed = [theta is None or ref.entropy(L[i], "normalized") >= np.float32(theta) for i in range(k)]
            if method == "asd":
                want = ref.asd_ref(d, L, 50.0, gate=10.0, block_cap=5, suffix="count", cmp=ref.Cmp(), allowed=allowed)
            else:
                want = ref.csd_ref(d, L, MEMORY.to_dict(), min_count=6, tau=0.0, update=True, cmp=ref.Cmp(),
                                   allowed=allowed)
            assert tuple(int(x[b]) for x in verdict) == tuple(want[:3]), (theta, b)
        loose[theta] = int(verdict.num_loose.sum())
    # the gate bites partly at 0.9 and fully above every normalized entropy
    assert loose[None] > loose[0.9] > loose[2.0] == 0


def test_init_state_and_static_settings():
    assert verify.make_policy("greedy", k=K).init_state(B) == ()
    ledger = verify.make_policy("asd", k=K, budget=2.5).init_state(B)
    np.testing.assert_array_equal(ledger, np.full(B, 2.5, np.float32))
    memory = verify.make_policy("csd", k=K, csd_memory=100).init_state(B)
    assert memory.capacity == 100 and memory.to_dict() == {}
    assert verify.make_policy("csd", k=K, csd_memory=MEMORY).init_state(B) is MEMORY
    # Static and hashable: equal settings are one jit cache entry; "exact" is "greedy".
    a, b = verify.make_policy("exact", k=K), verify.make_policy("greedy", k=K)
    assert a == b and hash(a) == hash(b) and a.method == "greedy"
    assert verify.make_policy("fly", k=K, theta=0.3) == verify.make_policy("fly", k=K)
    assert verify.make_policy("csd", k=K, csd_memory=MEMORY) != verify.make_policy("csd", k=K,
                                                                                   csd_memory=verify.csd_memory(32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.k = 3
    run = jax.jit(lambda p, s: p.verify(s, D_RBK[0], L_RBKV[0], K_RB[0], None, None)[0], static_argnums=0)
    np.testing.assert_array_equal(run(a, ()).num_accepted, run(b, ()).num_accepted)


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="beam"), "unknown method 'beam'"),
    (dict(method="fly", thetaa=0.3), "unknown rule option 'thetaa'"),
    (dict(method="greedy", theta=0.3), "option 'theta' does not apply to method 'greedy' .it is for fly, asd, csd"),
    (dict(method="fly", budget=1.0), "option 'budget' does not apply to method 'fly'"),
    (dict(method="fly", entropy="foo"), "unknown entropy='foo'"),
    (dict(method="fly", rule="bar"), "unknown rule='bar'"),
    (dict(method="asd", suffix="x"), "unknown suffix='x'"),
    (dict(method="asd", entropy="foo", theta=0.2), "unknown entropy='foo'"),
    (dict(method="asd", budget=-1.0), "budget must be >= 0"),
    (dict(method="asd", temperature=0.7), "'asd' is a temperature-0 rule"),
    (dict(method="csd", temperature=0.7), "'csd' is a temperature-0 rule"),
    (dict(method="csd", csd_memory="big"), "csd_memory must be a capacity"),
    (dict(method="fly", theta=jnp.float32(0.3)), "must be a static, hashable value"),
    (dict(method="greedy", k=0), "k must be an int >= 1"),
    (dict(method="sampling", temperature=-1.0), "temperature must be"),
])
def test_make_policy_rejects_bad_settings(kwargs, match):
    kwargs = {"k": K, **kwargs}
    with pytest.raises(ValueError, match=match):
        verify.make_policy(kwargs.pop("method"), **kwargs)


def test_verify_rejects_bad_shapes():
    policy = verify.make_policy("sampling", k=K, temperature=1.0)
    d, L = D_RBK[0], L_RBKV[0]
    with pytest.raises(ValueError, match=r"draft_tokens must be \[B, k\]"):
        policy.verify((), d[:, :-1], L, None, jax.random.key(0), None)
    with pytest.raises(ValueError, match=r"target_logits must be \[B, k\+1, V\]"):
        policy.verify((), d, L[:, :-1], None, jax.random.key(0), None)
    with pytest.raises(ValueError, match="vocabulary of the target"):
        policy.verify((), d, L, None, jax.random.key(0), None, draft_probs_BKV=jnp.ones((B, K, V + 1)))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        policy.verify((), d, L, None, None, None)
    with pytest.raises(ValueError, match=r"active must be a scalar or \[B\]"):
        policy.verify((), d, L, None, jax.random.key(0), jnp.ones(B + 1, bool))
