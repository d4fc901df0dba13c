"""Nothing silently wrong: non-finite options, tiny temperatures, invalid logits, wrong ids and
requests that cannot fit are refused or handled as documented, eagerly and under jit alike."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import verify
from specjax.verify import _common
from specjax.models import Config, random_model

CFG = Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, max_position_embeddings=64)
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def model():
    return random_model(CFG)


def _round(V=64, K=4, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    L = rng.normal(0, scale, (K + 1, V)).astype(np.float32)
    d = L[:K].argmax(-1).astype(np.int32)
    d[2] = (d[2] + 1) % V  # one mismatch
    return jnp.asarray(d), jnp.asarray(L)


# --- non-finite numbers are errors everywhere an option is a number -------------------------------

NUMERIC_OPTIONS = {"fly": ["theta"], "asd": ["gate", "block_cap", "budget", "theta"],
                   "csd": ["min_count", "tau", "theta"], "typical": ["epsilon", "delta"]}


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_options_are_refused_by_name(model, bad):
    for method, names in NUMERIC_OPTIONS.items():
        T = 1.0 if method == "typical" else 0.0
        for name in names:
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                verify.rule(method, **{name: bad})
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                specjax.Engine(model, "pld", method=method, k=4, temperature=T, **{name: bad})
    for temperature in (bad, np.float32(bad)):
        with pytest.raises(ValueError, match="temperature must be a static, finite"):
            specjax.Engine(model, temperature=temperature)
        with pytest.raises(ValueError, match="temperature must be a static, finite"):
            verify.speculative_sampling(*_round(), jax.random.key(0), temperature=temperature)
    with pytest.raises(ValueError, match="top_p"):
        specjax.Engine(model, temperature=1.0, top_p=bad)
    d, L = _round()
    with pytest.raises(ValueError, match="theta must be a finite number"):
        verify.fly(d, L, theta=bad)
    with pytest.raises(ValueError, match="gate must be a finite number"):
        verify.asd(d, L, 4.0, gate=bad)
    with pytest.raises(ValueError, match="budget_left must be a finite number"):
        verify.asd(d, L, bad)
    with pytest.raises(ValueError, match="epsilon must be a finite number"):
        verify.typical(d, L, jax.random.key(0), epsilon=bad)


@pytest.mark.parametrize("method,options,message", [
    ("csd", dict(min_count=-2), "min_count must be >= -1"),
    ("csd", dict(min_count=2.5), "min_count must be a whole number"),
    ("csd", dict(tau=-0.1), "tau must be >= 0"),
    ("asd", dict(gate=-0.5), "gate must be >= 0"),
    ("asd", dict(block_cap=1.5), "block_cap must be a whole number"),
    ("asd", dict(block_cap=-1), "block_cap must be >= 0"),
    ("asd", dict(budget=-1.0), "budget must be >= 0"),
    ("typical", dict(epsilon=-0.1), "epsilon must be >= 0"),
    ("typical", dict(delta=-1.0), "delta must be >= 0"),
])
def test_nonsense_rule_options_are_refused_by_name(model, method, options, message):
    T = 1.0 if method == "typical" else 0.0
    with pytest.raises(ValueError, match=message):
        specjax.Engine(model, "pld", method=method, k=4, temperature=T, **options)
    with pytest.raises(ValueError, match=message):  # the rule object itself, at construction
        verify.rule(method, **options)


def test_engine_arguments_that_would_be_misread(model):
    with pytest.raises(ValueError, match="eos_ids must be a sequence of token ids, got '12'"):
        specjax.Engine(model, eos_ids="12")
    with pytest.raises(ValueError, match="eos_ids must hold token ids"):
        specjax.Engine(model, eos_ids=[1.5])
    for seed in (1.5, -1, True, 2 ** 32):
        with pytest.raises(ValueError, match="seed must be an int"):
            specjax.Engine(model, seed=seed)


# --- tiny temperatures are greedy, eagerly and under jit -----------------------------------------


@pytest.mark.parametrize("T", [1e-10, 1e-45])
def test_tiny_temperature_is_greedy_eager_and_jitted(T):
    d, L = _round(scale=30.0)  # large logits: L / T overflows float32
    want = verify.greedy(d, L)
    key = jax.random.key(1)
    rules = {
        "sampling": lambda d, L, key: verify.speculative_sampling(d, L, key, temperature=T),
        "typical": lambda d, L, key: verify.typical(d, L, key, temperature=T),
        "fly": lambda d, L, key: verify.fly(d, L, theta=2.0, temperature=T, key=key),  # gate closed: exact
    }
    for name, rule in rules.items():  # eagerly for speculative sampling (the reported case), jitted for all
        for how, fn in (("eager", rule), ("jit", jax.jit(rule))) if name == "sampling" else (("jit", jax.jit(rule)),):
            got = fn(d, L, key)
            assert (int(got.num_accepted), int(got.next_token)) == (int(want.num_accepted), int(want.next_token)), \
                (name, how, T)
    L_BV = L[:4]
    for how, fn in (("eager", _common.sample), ("jit", jax.jit(_common.sample, static_argnums=(2, 3)))):
        np.testing.assert_array_equal(fn(key, L_BV, T, 1.0), _common.greedy(L_BV), err_msg=how)
        np.testing.assert_array_equal(fn(key, L_BV, T, 0.9), _common.greedy(L_BV), err_msg=how)


def test_tiny_temperature_engine_gives_the_greedy_tokens(model):
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2, 3]]
    want = specjax.Engine(model, max_new_tokens=8, eos_ids=()).generate(prompts).tokens
    spec = specjax.Engine(model, "pld", k=3, max_new_tokens=8, eos_ids=(), temperature=1e-10)  # sampler + rule
    assert spec.generate(prompts).tokens == want


def test_ordinary_temperatures_keep_their_distribution():
    """The max-shifted tempering is the same distribution: p = softmax(L / T)."""
    d, L = _round()
    stats = jax.jit(lambda d, L: verify.row_stats(_common.tempered(L, 0.7), d))(jnp.concatenate([d, d[:1]]), L)
    x = np.asarray(L, np.float64) / 0.7
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    p_d = np.exp(x[np.arange(5), np.concatenate([d, d[:1]])] - lse)
    np.testing.assert_allclose(np.exp(np.asarray(stats.logit_at - stats.lse)), p_d, rtol=1e-5)


# --- NaN or all -inf logits: token -1 and a flag, never a silent token 0 ---------------------------


def test_invalid_logit_rows_name_no_token():
    d, L = _round()
    for bad_row in (jnp.full((64,), NAN).at[3].set(5.0), jnp.full((64,), -INF), jnp.zeros(64).at[7].set(INF)):
        L1 = L.at[1].set(bad_row)
        for name, v in [("greedy", verify.greedy(d, L1)),
                        ("fly", verify.fly(d, L1, theta=0.0, window=0)),
                        ("asd", verify.asd(d, L1, 100.0, gate=100.0, block_cap=4)[0]),
                        ("csd", verify.csd(d, L1, verify.csd_memory(8), min_count=-1, tau=0.0)[0]),
                        ("sampling", verify.speculative_sampling(d, L1, jax.random.key(0), temperature=1.0)),
                        ("typical", verify.typical(d, L1, jax.random.key(0), temperature=1.0))]:
            assert int(v.num_accepted) <= 1, name  # never accepted at the invalid position
            if int(v.num_accepted) == 1:
                assert int(v.next_token) == -1, name
        logits_BV = jnp.stack([L[0], bad_row])
        for T in (0.0, 1.0):
            tokens = _common.sample(jax.random.key(0), logits_BV, T)
            assert int(tokens[0]) == int(jnp.argmax(L[0])) or T > 0
            assert int(tokens[1]) == -1, (T, bad_row)


def test_engine_counts_and_warns_about_invalid_logits(model):
    broken = model.with_params(jax.tree.map(lambda x: x, model.params))
    broken.params["final_norm"]["scale"] = jnp.full_like(broken.params["final_norm"]["scale"], NAN)
    with pytest.warns(RuntimeWarning, match="logits were invalid"):
        out = specjax.Engine(broken, max_new_tokens=3, eos_ids=()).generate([[1, 2, 3]])
    assert out.tokens == [[-1, -1, -1]] and out.stats["invalid_logit_tokens"] == [3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert specjax.Engine(model, max_new_tokens=3).generate([[1, 2, 3]]).stats["invalid_logit_tokens"] == [0]


# --- wrong input that used to pass -----------------------------------------------------------------


def test_model_logits_validates_ids_like_the_engine(model):
    for tokens, message in (([[1, 64]], "token id 64 at \\(0, 1\\) is outside the vocabulary \\[0, 64\\)"),
                            ([[-1, 2]], "token id -1"),
                            (np.array([[1.7, 2.0]]), "token ids must be integers, got float64")):
        with pytest.raises(ValueError, match=message):
            model.logits(tokens)
    assert np.isfinite(np.asarray(model.logits([[0, 63]]))).all()
    jitted = jax.jit(lambda t: model.logits(t))(jnp.array([[1, 2]]))  # traced ids: dtype only
    assert jitted.shape == (1, 2, 64)


def test_positions_past_the_trained_context_warn_with_the_numbers(model):
    with pytest.warns(UserWarning, match="70 positions, more than the model's max_position_embeddings 64"):
        model.logits([[1] * 70])
    with pytest.warns(UserWarning, match="= 74 positions, more than the model's max_position_embeddings 64"):
        specjax.Engine(model, max_new_tokens=4).lower([[1] * 70])


def test_a_cache_that_cannot_fit_is_refused_before_compiling(model):
    engine = specjax.Engine(model, max_new_tokens=10 ** 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # past max_position_embeddings as well
        with pytest.raises(ValueError, match=r"needs caches .* GiB, more than the .* GiB free .* at most about "
                                             r"max_new_tokens=\d+ fits"):
            engine.lower([[1, 2, 3]])


def test_rule_state_of_another_capacity(model):
    """A CSD memory is starting state: one of another capacity is a valid start (it is its own
    shape), and the memory that comes back keeps that capacity; ASD's ledgers must match the batch."""
    engine = specjax.Engine(model, "pld", method="csd", k=2, max_new_tokens=2, csd_memory=16)
    out = engine.generate([[1, 2, 3]], rule_state=verify.csd_memory(8))
    assert out.rule_state.capacity == 8 and out.stats["csd_memory_capacity"] == 8
    with pytest.raises(ValueError, match="outside the target.s vocabulary"):  # but not one of another tokenizer
        engine.generate([[1, 2, 3]], rule_state=verify.csd_memory(8, [[1, 10 ** 6]], [3]))
    with pytest.raises(ValueError, match="ASD's per-request ledgers"):
        specjax.Engine(model, "pld", method="asd", k=2, max_new_tokens=2).generate(
            [[1, 2, 3]], rule_state=jnp.zeros((3,), jnp.float32))
