"""Rule objects: every method behind one interface (`verify.Fly(...)`, ...), carried by a jitted while_loop."""

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


def make(method, options):
    """(rule object, starting state): a CSD memory option is the rule's starting state."""
    options = dict(options)
    memory = options.pop("csd_memory", None)
    rule = verify.rule(method, **options)
    return rule, (rule.init_state(B) if memory is None else memory)


def expected(rule, T, state, r, keys_B, q):
    """What the rule object must return in round r, from the per-sequence rules called directly."""
    o, d, L, k = rule.options(), D_RBK[r], L_RBKV[r], K_RB[r]
    rows = lambda f, *xs: jax.vmap(f)(d, L, k, *xs)
    if rule.name == "greedy":
        return rows(lambda d, L, k: verify.greedy(d, L, num_draft=k)), state
    if rule.name == "sampling":
        return rows(lambda d, L, k, key, q: verify.speculative_sampling(d, L, key, draft_probs=q, temperature=T,
                                                                        num_draft=k), keys_B, q), state
    if rule.name == "typical":
        return rows(lambda d, L, k, key: verify.typical(d, L, key, epsilon=o["epsilon"], delta=o["delta"],
                                                        temperature=T, num_draft=k), keys_B), state
    if rule.name == "fly":
        return rows(lambda d, L, k, key, q: verify.fly(d, L, theta=o["theta"], window=o["window"], rule=o["rule"],
                                                       entropy=o["entropy"], temperature=T, key=key, draft_probs=q,
                                                       num_draft=k), keys_B, q), state
    if rule.name == "asd":
        verdict, left = rows(lambda d, L, k, b: verify.asd(d, L, b, gate=o["gate"], block_cap=o["block_cap"],
                                                            suffix=o["suffix"], num_draft=k), state)
        return verdict, jnp.where(ACTIVE_RB[r], left, state)
    assert rule.name == "csd"
    return verify.csd_batch(d, L, state, min_count=o["min_count"], tau=o["tau"], num_draft=k, active=ACTIVE_RB[r])


def run_rounds(rule, T, start, with_q):
    """R rounds in one jitted while_loop: the rule object's results next to the expected ones."""
    @jax.jit
    def loop(state, key):
        def body(carry):
            r, state, want_state, key, ok, stats = carry
            key, kr = jax.random.split(key)
            keys_B = jax.random.split(kr, B) if T > 0 else None
            q = Q_RBKV[r] if with_q else None
            verdict, state, counts = rule(state, D_RBK[r], L_RBKV[r], num_draft_B=K_RB[r], key=kr,
                                          active_B=ACTIVE_RB[r], draft_probs_BKV=q, temperature=T)
            want, want_state = expected(rule, T, want_state, r, keys_B, q)
            a = ACTIVE_RB[r]
            for x, y in zip(verdict, want):  # inactive rows' verdicts are irrelevant
                ok &= jnp.all(jnp.where(a, x, 0) == jnp.where(a, y, 0))
            for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
                ok &= jnp.all(x == y)
            ok &= jnp.all(counts.num_loose_B == jnp.where(a, verdict.num_loose, 0))
            stopped = (verdict.num_accepted < K_RB[r]).astype(jnp.int32)
            ok &= jnp.all(counts.examined_B == jnp.where(a, verdict.num_loose + stopped, 0))
            stats = jax.tree.map(lambda s, x: s + x.sum(), stats, tuple(counts))
            return r + 1, state, want_state, key, ok, stats

        zero = (jnp.int32(0), jnp.int32(0), jnp.float32(0))
        carry = (jnp.int32(0), state, state, key, jnp.bool_(True), zero)
        return jax.lax.while_loop(lambda c: c[0] < R, body, carry)

    _, state, _, _, ok, stats = loop(start, jax.random.key(1))
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
def test_rule_objects_match_the_rules_inside_a_while_loop(method, temperature, options, with_q):
    rule, start = make(method, options)
    ok, state, (loose, examined, spent) = run_rounds(rule, temperature, start, with_q)
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
        rule, state = make(method, options)
        step = jax.jit(lambda state, d, L, k, active: rule(state, d, L, num_draft_B=k, active_B=active))
        _, none_active, counts = step(state, d, L, k, jnp.zeros(B, bool))
        assert all(int(jnp.abs(x).sum()) == 0 for x in counts)
        if method == "asd":
            np.testing.assert_array_equal(none_active, state)
            _, some, _ = step(state, d, L, k, active)
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
        rule, state = make(method, dict(theta=theta, **options[method]))
        verdict, _, _ = jax.jit(lambda s, d, L, k: rule(s, d, L, num_draft_B=k))(state, D_RBK[0], L_RBKV[0], K_RB[0])
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
    assert verify.Greedy().init_state(B) == ()
    ledger = verify.Asd(budget=2.5).init_state(B)
    np.testing.assert_array_equal(ledger, np.full(B, 2.5, np.float32))
    memory = verify.Csd(capacity=100).init_state(B)
    assert memory.capacity == 100 and memory.to_dict() == {}
    # Static and hashable: equal settings are one jit cache entry; "exact" is "greedy".
    a, b = verify.rule("exact"), verify.rule("greedy")
    assert a == b == verify.Greedy() and hash(a) == hash(b) and a.name == "greedy"
    assert verify.rule("fly", theta=0.3) == verify.Fly() == verify.Fly(theta=0.3, window=6)
    assert verify.Csd(capacity=32) != verify.Csd() and hash(verify.Csd(capacity=32)) == hash(verify.Csd(capacity=32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.theta = 3
    with pytest.raises(TypeError):
        verify.Fly(0.3)  # keyword-only
    run = jax.jit(lambda rule, s: rule(s, D_RBK[0], L_RBKV[0], num_draft_B=K_RB[0])[0], static_argnums=0)
    np.testing.assert_array_equal(run(a, ()).num_accepted, run(b, ()).num_accepted)


@pytest.mark.parametrize("method, options, match", [
    ("beam", {}, "unknown method 'beam'"),
    ("fly", dict(thetaa=0.3), "unknown rule option 'thetaa'"),
    ("greedy", dict(theta=0.3), "option 'theta' does not apply to method 'greedy' .it is for fly, asd, csd"),
    ("fly", dict(budget=1.0), "option 'budget' does not apply to method 'fly'"),
    ("fly", dict(entropy="foo"), "unknown entropy='foo'"),
    ("fly", dict(rule="bar"), "unknown rule='bar'"),
    ("asd", dict(suffix="x"), "unknown suffix='x'"),
    ("asd", dict(entropy="foo", theta=0.2), "unknown entropy='foo'"),
    ("asd", dict(budget=-1.0), "budget must be >= 0"),
    ("csd", dict(capacity="big"), "capacity must be an int >= 1"),
    ("csd", dict(capacity=0), "capacity must be an int >= 1"),
    ("fly", dict(theta=jnp.float32(0.3)), "must be a static, hashable value"),
])
def test_rules_reject_bad_options_at_construction(method, options, match):
    with pytest.raises(ValueError, match=match):
        verify.rule(method, **options)
    cls = verify.RULES.get(method)
    if cls is not None and set(options) <= {f.name for f in dataclasses.fields(cls)}:
        with pytest.raises(ValueError, match=match):  # the class itself checks its options
            cls(**options)


@pytest.mark.parametrize("rule, temperature, match", [
    (verify.Asd(), 0.7, "'asd' is a temperature-0 rule"),
    (verify.Csd(), 0.7, "'csd' is a temperature-0 rule"),
    (verify.Greedy(), 0.7, "'greedy' is a temperature-0 rule.*verify.Sampling"),
    (verify.Sampling(), -1.0, "temperature must be"),
    (verify.Fly(), float("inf"), "temperature must be a static, finite"),
    (verify.Fly(), 0.7, None),
])
def test_temperature_is_checked_per_rule(rule, temperature, match):
    if match is None:
        assert rule.check_temperature(temperature) == temperature
        return
    with pytest.raises(ValueError, match=match):
        rule.check_temperature(temperature)
    with pytest.raises(ValueError, match=match):
        rule((), D_RBK[0], L_RBKV[0], key=jax.random.key(0), temperature=temperature)


@pytest.mark.parametrize("method, temperature, want", [
    ("exact", 0.0, verify.Greedy()),
    ("exact", 0.7, verify.Sampling()),  # lossless at T > 0: speculative sampling
    ("sampling", 0.0, verify.Sampling()),
    ("fly", 1.0, verify.Fly()),
    ("typical", 0.5, verify.Typical()),
    ("asd", 0.0, verify.Asd()),
])
def test_at_temperature_gives_the_rule_that_verifies(method, temperature, want):
    assert verify.at_temperature(verify.rule(method), temperature) == want


@pytest.mark.parametrize("rule, temperature, match", [
    (verify.Asd(), 0.7, "'asd' is a temperature-0 rule"),
    (verify.Csd(), 1e-3, "'csd' is a temperature-0 rule"),
    (verify.Greedy(), float("nan"), "Greedy: temperature must be a static, finite"),
    (verify.Greedy(), float("inf"), "temperature must be a static, finite"),
    (verify.Fly(), -0.5, "temperature must be"),
    (verify.Sampling(), "1", "temperature must be"),
])
def test_at_temperature_rejects(rule, temperature, match):
    with pytest.raises(ValueError, match=match):
        verify.at_temperature(rule, temperature)


def test_call_rejects_bad_shapes():
    rule = verify.Sampling()
    d, L = D_RBK[0], L_RBKV[0]
    call = lambda d, L, **kw: rule((), d, L, **{"key": jax.random.key(0), "temperature": 1.0, **kw})  # noqa: E731
    with pytest.raises(ValueError, match=r"draft_tokens must be \[B, K\]"):
        call(d[0], L)
    with pytest.raises(ValueError, match=r"target_logits must be \[B, K\+1, V\]"):
        call(d, L[:, :-1])
    with pytest.raises(ValueError, match=r"target_logits must be \[B, K\+1, V\]"):
        call(d[:, :-1], L)
    with pytest.raises(ValueError, match="vocabulary of the target"):
        call(d, L, draft_probs_BKV=jnp.ones((B, K, V + 1)))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        call(d, L, key=None)
    with pytest.raises(ValueError, match=r"active must be a scalar or \[B\]"):
        call(d, L, active_B=jnp.ones(B + 1, bool))


@pytest.mark.parametrize("rule, T", [(verify.Greedy(), 0.0), (verify.Fly(), 0.0), (verify.Fly(), 0.7),
                                     (verify.Asd(theta=0.1), 0.0), (verify.Csd(), 0.0), (verify.Sampling(), 0.7),
                                     (verify.Typical(), 0.7)], ids=lambda x: getattr(x, "name", x))
def test_a_rule_object_checks_its_batch_once(rule, T, monkeypatch):
    """The logits' shape is checked once per trace, for the batch; the per-row logic does not check again
    (the per-sequence functions, called on their own, still do: test_verify_errors)."""
    from specjax.verify import _common

    calls = {"check_batch": 0, "check_inputs": 0}
    for name in calls:
        real = getattr(_common, name)
        monkeypatch.setattr(_common, name, lambda *a, _name=name, _real=real: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a))[1])
    state = MEMORY if rule.name == "csd" else rule.init_state(B)
    jax.make_jaxpr(lambda d, L: rule(state, d, L, num_draft_B=K_RB[0], key=jax.random.key(0), temperature=T))(
        D_RBK[0], L_RBKV[0])
    assert calls == {"check_batch": 1, "check_inputs": 0}
    with pytest.raises(ValueError, match=r"target_logits must be a float array \[B, K\+1, V\]"):
        rule(state, D_RBK[0], jnp.zeros(L_RBKV[0].shape, jnp.int32), key=jax.random.key(0), temperature=T)
    with pytest.raises(ValueError, match=r"num_draft=6 outside \[0, K = 5\]"):
        rule(state, D_RBK[0], L_RBKV[0], num_draft_B=K + 1, key=jax.random.key(0), temperature=T)
