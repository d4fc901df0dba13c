"""The adaptive loop: each round verifies the width its expected tokens pay for (docs/adaptive.md).

Tiny random models and fixed cost tables (no timing), so every check is deterministic."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import costs, loop
from specjax.costs import CostTable
from specjax.models import Config, random_model

TINY = Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=300.0)
# repetitive prompts (prompt lookup matches), ragged lengths
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]
NEW, K = 24, 8
# a verify of width w costs 1 + 0.25 (w - 1) steps, a draft step 0.2: the policy's choices vary
MIDDLE = CostTable.from_ratios(K, {K + 1: 3.0}, draft_ratio=0.2, source="test")
CHEAP = CostTable.from_ratios(K, {K + 1: 1.0}, source="test: a wide verify costs one step")
DEAR = CostTable.from_ratios(K, {2: 4.0, K + 1: 30.0}, draft_ratio=2.0, source="test: verifying does not pay")


@pytest.fixture(scope="module")
def target():
    return random_model(TINY, seed=11)


@pytest.fixture(scope="module")
def draft(target):
    noise = random_model(TINY, seed=12)
    return target.with_params(jax.tree.map(lambda a, b: a + 0.3 * b, target.params, noise.params), name="noisy")


@pytest.fixture(scope="module")
def baseline(target):
    return specjax.Engine(target, max_new_tokens=NEW).generate(PROMPTS).tokens


@pytest.mark.parametrize("kind", [pytest.param("pld", marks=pytest.mark.heavy), "model",
                                  pytest.param("pld+model", marks=pytest.mark.heavy)])  # CI: the model draft
def test_exact_is_target_only_on_a_ragged_batch(target, draft, baseline, kind):
    spec = {"pld": "pld", "model": draft, "pld+model": ("pld", draft)}[kind]
    out = specjax.Engine(target, draft=spec, method="exact", k=K, max_new_tokens=NEW, costs=MIDDLE).generate(PROMPTS)
    assert out.tokens == baseline
    widths = out.stats["widths"]
    assert len(widths) == K + 2 and widths[0] == 0
    assert sum(widths) == out.stats["rounds"]  # one width per round of the loop
    assert sum(1 for n in widths if n) >= 2  # the policy did choose (more than one width in use)
    assert math.isclose(out.stats["mean_width"], sum(w * n for w, n in enumerate(widths)) / sum(widths))
    assert set(np.nonzero(widths)[0]) <= set(loop.adaptive_widths(K))


def test_widths_follow_the_cost_table(target, baseline):
    # the target as its own draft: every draft is accepted
    cheap = specjax.Engine(target, draft=target, method="exact", k=K, max_new_tokens=NEW, costs=CHEAP)
    out = cheap.generate(PROMPTS)
    assert out.tokens == baseline
    assert out.stats["widths"][K + 1] >= 0.8 * out.stats["rounds"]  # wide verifies are cheap: widths grow
    dear = specjax.Engine(target, draft=target, method="exact", k=K, max_new_tokens=NEW, costs=DEAR)
    out = dear.generate(PROMPTS)
    assert out.tokens == baseline
    assert out.stats["widths"][1] >= 0.8 * out.stats["rounds"]  # a plain step is the better deal
    assert out.stats["tau"] < 1.5


@pytest.mark.heavy  # about 20 s on CI
def test_loose_rule_with_flat_costs_is_the_fixed_k_loop(target, draft):
    # flat costs: the policy never cuts a proposal, so a loose rule sees what the fixed-K loop shows it
    for spec in ("pld", draft):
        settings = dict(draft=spec, method="fly", theta=0.6, window=2, k=4, max_new_tokens=NEW)
        fixed = specjax.Engine(target, adaptive=False, **settings).generate(PROMPTS)
        flat = specjax.Engine(target, costs=CostTable.from_ratios(4, {5: 1.0}), **settings).generate(PROMPTS)
        assert flat.tokens == fixed.tokens
        assert flat.stats["loose"] == fixed.stats["loose"] > 0
        assert "widths" not in fixed.stats


def test_acceptance_is_learned_and_forgotten():
    adapt = loop.Adapt.zeros(2, 4)
    live_B, level_B = jnp.array([True, True]), jnp.array([0, 1])
    for _ in range(40):  # level 0 accepts everything, level 1 nothing
        adapt = loop.learn(adapt, level_B, jnp.array([4, 4]), jnp.array([4, 0]), live_B)
    p = np.asarray(loop.acceptance(adapt))
    n = sum(loop.DECAY ** i for i in range(40))  # the decayed count of 40 rounds
    w, prior = loop.PRIOR_WEIGHT, loop.PRIOR_ACCEPT
    pooled = (n + w * prior) / (2 * n + w)  # position 0 of both levels, shrunk towards the prior
    np.testing.assert_allclose(p[:, 0], [(n + w * pooled) / (n + w), w * pooled / (n + w)], rtol=1e-5)
    assert (p[0] > 0.9).all() and p[1, 0] < 0.1
    # never reached behind a rejection: a later position inherits the estimate before it, not the
    # optimistic prior, so a lookup that is rarely right does not look like a long run
    np.testing.assert_array_equal(p[1, 1:], np.full(3, p[1, 0]))
    kept = adapt
    for _ in range(60):  # nothing proposed: nothing learned, nothing forgotten
        adapt = loop.learn(adapt, level_B, jnp.array([0, 0]), jnp.array([0, 0]), live_B)
    np.testing.assert_array_equal(loop.acceptance(adapt), loop.acceptance(kept))
    for _ in range(60):  # proposed, not verified (width 1): level 1 drifts back to its prior, the pooled
        adapt = loop.learn(adapt, level_B, jnp.array([0, 0]), jnp.array([0, 0]), live_B, jnp.array([0, 3]))
    p = np.asarray(loop.acceptance(adapt))
    assert p[1, 0] > 0.5 * loop.PRIOR_ACCEPT and p[1, 0] > 10 * np.asarray(loop.acceptance(kept))[1, 0]
    np.testing.assert_array_equal(adapt.hits_LK[0], kept.hits_LK[0])  # level 0 proposed nothing: its counts
    np.testing.assert_array_equal(adapt.trials_LK[0], kept.trials_LK[0])  # stay as they were


def test_unreached_positions_inherit_the_last_reached_estimate():
    adapt = loop.Adapt.zeros(1, 5)
    for _ in range(40):  # positions 0 and 1 always kept, position 2 always rejected
        adapt = loop.learn(adapt, jnp.array([0]), jnp.array([5]), jnp.array([2]), jnp.array([True]))
    p = np.asarray(loop.acceptance(adapt))[0]
    assert (p[:2] > 0.9).all() and p[2] < 0.15
    np.testing.assert_array_equal(p[3:], [p[2], p[2]])
    # with no counts at all, every position is the optimistic prior
    np.testing.assert_allclose(loop.acceptance(loop.Adapt.zeros(2, 3)), np.full((2, 3), loop.PRIOR_ACCEPT))


def test_a_level_without_counts_starts_from_what_the_others_showed():
    adapt = loop.Adapt.zeros(3, 4)
    for _ in range(30):  # level 0 keeps every draft; levels 1 and 2 never propose
        adapt = loop.learn(adapt, jnp.array([0]), jnp.array([4]), jnp.array([4]), jnp.array([True]))
    p = np.asarray(loop.acceptance(adapt))
    hits, trials = float(adapt.hits_LK[0, 0]), float(adapt.trials_LK[0, 0])
    pooled = (hits + loop.PRIOR_WEIGHT * loop.PRIOR_ACCEPT) / (trials + loop.PRIOR_WEIGHT)
    np.testing.assert_allclose(p[1:], np.full((2, 4), pooled), rtol=1e-6)
    assert pooled > 0.9 and (p[0] > pooled).all()


def test_adaptation_carries_from_one_call_to_the_next(target, baseline):
    # the target as its own draft (every draft kept): a cold start learns that over its first rounds,
    # a start from an earlier call's counts verifies wide at once
    engine = specjax.Engine(target, draft=target, method="exact", k=K, max_new_tokens=NEW, costs=MIDDLE)
    cold = engine.generate(PROMPTS[:1])
    assert isinstance(cold.adaptation, loop.Adapt) and np.asarray(cold.adaptation.trials_LK).sum() > 0
    warm = engine.generate(PROMPTS[:1], adaptation=engine.generate(PROMPTS).adaptation)  # any batch size
    assert warm.tokens == cold.tokens == baseline[:1]
    assert warm.stats["rounds"] < cold.stats["rounds"]
    assert warm.stats["mean_width"] > cold.stats["mean_width"]
    assert sum(warm.stats["widths"]) == warm.stats["rounds"]  # the widths are counted per call
    again = engine.generate(PROMPTS[:1], adaptation=cold.adaptation)
    assert again.tokens == cold.tokens and again.stats["rounds"] <= cold.stats["rounds"]


def test_bad_adaptation_is_named(target):
    adaptive = specjax.Engine(target, draft="pld", method="exact", k=K, max_new_tokens=NEW, costs=MIDDLE)
    other_k = specjax.Engine(target, draft="pld", method="exact", k=4, max_new_tokens=NEW,
                             costs=CostTable.from_ratios(4, {5: 2.0}))
    with pytest.raises(ValueError, match=r"adaptation must be an Adapt of 4 drafter levels x K = 4"):
        other_k.generate(PROMPTS[:1], adaptation=loop.Adapt.zeros(adaptive.drafter.levels, K))
    with pytest.raises(ValueError, match="adaptation must be an Adapt"):
        adaptive.generate(PROMPTS[:1], adaptation={"hits": [0.0]})
    fixed = specjax.Engine(target, draft="pld", method="exact", k=K, max_new_tokens=NEW, adaptive=False)
    with pytest.raises(ValueError, match="adaptation was given, but this engine does not adapt"):
        fixed.generate(PROMPTS[:1], adaptation=loop.Adapt.zeros(adaptive.drafter.levels, K))
    assert fixed.generate(PROMPTS[:1], adaptation=()).adaptation == ()  # an earlier output's (): nothing to carry


def test_prompt_lookup_levels_are_the_length_of_the_match():
    pld = specjax.drafters.PromptLookup(k=3)  # n-grams of 4 down to 1
    assert pld.levels == 4
    seq_BS = jnp.array([[1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 0, 0],  # ends on 1 2 3 4: a 4-gram match
                        [7, 8, 5, 6, 2, 5, 0, 0, 0, 0, 0, 0],  # ends on 2 5: only "5" seen before
                        [1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]])  # ends on 3: never seen
    lengths_B = jnp.array([9, 5, 2])  # the pending token's position
    drafts_BK, num_draft_B, _, _, level_B = pld.propose_levels((), (), seq_BS, lengths_B, None, 0.0)
    np.testing.assert_array_equal(num_draft_B, [3, 3, 0])
    np.testing.assert_array_equal(drafts_BK[:2], [[5, 9, 1], [6, 2, 5]])
    np.testing.assert_array_equal(level_B, [0, 3, 0])  # level 0: the longest n-gram (and no match)
    np.testing.assert_array_equal(pld.lookup(seq_BS, lengths_B)[0], drafts_BK)


def test_expected_tokens_and_choice():
    p_BK = jnp.array([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    e = np.asarray(loop.expected_tokens(p_BK, jnp.array([3, 1]), (1, 2, 3, 4)))
    np.testing.assert_allclose(e, [[1, 1.5, 1.75, 1.875], [1, 2, 2, 2]])
    live = jnp.array([True, False])
    allowed = jnp.ones(4, bool)
    assert int(loop.choose_width(jnp.asarray(e), live, jnp.array([1.0, 1.4, 1.8, 2.2]), allowed)) == 1
    assert int(loop.choose_width(jnp.asarray(e), live, jnp.array([1.0, 1.6, 1.8, 2.2]), allowed)) == 0
    assert int(loop.choose_width(jnp.asarray(e), live, jnp.ones(4), allowed)) == 3
    assert int(loop.choose_width(jnp.asarray(e), live, jnp.ones(4), jnp.arange(4) <= 2)) == 2


def test_compiled_widths():
    assert loop.adaptive_widths(8) == (1, 2, 3, 5, 9)
    assert loop.adaptive_widths(15) == (1, 2, 3, 5, 9, 16)
    assert loop.adaptive_widths(6) == (1, 2, 3, 5, 7)
    assert loop.adaptive_widths(1) == (1, 2)


@pytest.mark.parametrize("table, match", [
    (CostTable.from_ratios(4, {5: 2.0}), r"verify_s has 5 entries, but k=8 needs .* \(9 entries\)"),
    ("fast", "costs must be a specjax.costs.CostTable"),
])
def test_bad_costs_for_the_engine(target, table, match):
    with pytest.raises(ValueError, match=match):
        specjax.Engine(target, draft="pld", k=8, costs=table)


@pytest.mark.parametrize("kwargs, match", [
    (dict(verify_s=(0.01, -0.02)), r"verify_s\[1\] \(width 2\) must be a finite number of seconds > 0"),
    (dict(verify_s=(0.01, float("nan"))), r"verify_s\[1\] \(width 2\) must be a finite"),
    (dict(verify_s=(0.01, 0.02), draft_step_s=float("inf")), "draft_step_s must be a finite"),
    (dict(verify_s=(0.01, 0.02), draft_step_s=-1), "draft_step_s must be a finite"),
    (dict(verify_s=()), "non-empty sequence"),
    (dict(verify_s=(0.0, 0.01)), r"verify_s\[0\] \(width 1\) must be a finite number of seconds > 0"),
])
def test_bad_cost_tables(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostTable(**kwargs)


def test_from_ratios_interpolates():
    t = CostTable.from_ratios(4, {3: 2.0}, step_s=0.01, draft_ratio=0.5)
    np.testing.assert_allclose(t.verify_s, [0.01, 0.015, 0.02, 0.025, 0.03])  # linear, extended past 3
    assert t.draft_step_s == pytest.approx(0.005)
    assert t.in_steps()[0][2] == pytest.approx(2.0)
    assert CostTable.from_ratios(2, {}).verify_s == (1.0, 1.0, 1.0)


def test_measured_table_is_kept(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_MEMORY", {})
    engine = specjax.Engine(target, draft="pld", k=4, max_new_tokens=4)
    table = engine.cost_table(2)
    assert len(table.verify_s) == 5 and table.draft_step_s == 0.0
    assert all(b >= a for a, b in zip(table.verify_s, table.verify_s[1:]))
    files = sorted((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1  # the rounds at widths 1, 2, 3, 5 (prompt lookup: no draft step)
    # another process (an empty memory) reads the figures back instead of measuring
    monkeypatch.setattr(costs, "_MEMORY", {})
    monkeypatch.setattr(costs, "_round_seconds", lambda *a: pytest.fail("measured again"))
    assert specjax.Engine(target, draft="pld", k=4, max_new_tokens=4).cost_table(2) == table
    # a damaged figure is measured again, with a warning
    files[0].write_text(files[0].read_text().replace("seconds", "secs"))
    monkeypatch.setattr(costs, "_MEMORY", {})
    monkeypatch.setattr(costs, "_round_seconds", lambda *a: (1.0, 2.0, 3.0, 4.0))
    with pytest.warns(UserWarning, match="damaged cost measurement"):
        specjax.Engine(target, draft="pld", k=4, max_new_tokens=4).cost_table(2)
    # changed code (another loop, rule or drafter) is another key: an old figure is not served
    key = costs.cache_key(engine, 2, "rounds")
    assert costs.cache_key(engine, 2, "rounds") == key and len(costs.code_digest()) == 16
    monkeypatch.setattr(costs, "code_digest", lambda: "edited")
    assert costs.cache_key(engine, 2, "rounds") != key


def test_adaptive_is_off_without_a_draft_and_with_adaptive_false(target):
    assert specjax.Engine(target).cost_table() is None
    assert specjax.Engine(target, draft="pld", adaptive=False).cost_table() is None
    with pytest.raises(ValueError, match="adaptive must be True or False"):
        specjax.Engine(target, draft="pld", adaptive="yes")


def test_merged_statistics_add_the_widths(target):
    from specjax import metrics

    engine = specjax.Engine(target, draft="pld", method="exact", k=K, max_new_tokens=NEW, costs=MIDDLE)
    parts = [engine.generate([p]).stats for p in PROMPTS]
    merged = metrics.merge(parts)
    assert merged["widths"] == np.sum([p["widths"] for p in parts], axis=0).tolist()
    assert sum(merged["widths"]) == sum(p["rounds"] for p in parts)
