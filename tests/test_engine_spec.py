"""Speculative generation: every drafter and lossless rule returns the target's greedy tokens."""

import dataclasses

import jax
import numpy as np
import pytest

import specjax
from specjax import drafters, loop
from specjax.models import Config, random_model

TINY = Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=300.0)
# Repetitive prompts so that prompt lookup finds matches; ragged lengths.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]
NEW = 24


@pytest.fixture(scope="module")
def target():
    return random_model(TINY, seed=11)


@pytest.fixture(scope="module")
def draft():
    # a draft that often agrees with the target: the target's weights plus noise
    t = random_model(TINY, seed=11)
    noise = random_model(TINY, seed=12)
    params = jax.tree.map(lambda a, b: a + 0.3 * b, t.params, noise.params)
    return t.with_params(params, name="noisy-draft")


@pytest.fixture(scope="module")
def baseline(target):
    return specjax.Engine(target, max_new_tokens=NEW).generate(PROMPTS).tokens


def drafts(draft):
    return {"model": draft, "pld": "pld", "self:1": "self:1", "multilevel": ("pld", draft)}


@pytest.mark.parametrize("which", ["model", "pld", "self:1", "multilevel"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_verification_is_exact_for_every_drafter(target, draft, baseline, which, k):
    out = specjax.Engine(target, draft=drafts(draft)[which], k=k, max_new_tokens=NEW).generate(PROMPTS)
    assert out.tokens == baseline
    assert 1.0 <= out.stats["tau"] <= k + 1


@pytest.mark.parametrize("method, options", [
    ("asd", dict(budget=0.0)), ("asd", dict(gate=0.0)), ("asd", dict(block_cap=0)),
    ("fly", dict(theta=1.5)), ("fly", dict(theta=1.5, rule="reference", entropy="normalized")),
    ("csd", dict(csd_memory=64, update=False)), ("typical", {}), ("exact", {}),
])
@pytest.mark.parametrize("which", ["model", "pld"])
def test_rules_that_reduce_to_greedy_are_exact(target, draft, baseline, method, options, which):
    out = specjax.Engine(target, draft=drafts(draft)[which], method=method, k=4, max_new_tokens=NEW,
                         **options).generate(PROMPTS)
    assert out.tokens == baseline
    assert out.stats["loose"] == 0


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.heavy), pytest.param(2, marks=pytest.mark.heavy)])
def test_exact_over_seeds_and_batch_shapes(seed):
    target = random_model(TINY, seed=100 + seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TINY.vocab_size, rng.integers(1, 12)).tolist() for _ in range(1 + seed * 2)]
    base = specjax.Engine(target, max_new_tokens=16).generate(prompts).tokens
    for draft in ("pld", "self:2", random_model(TINY, seed=200 + seed)):
        assert specjax.Engine(target, draft=draft, k=5, max_new_tokens=16).generate(prompts).tokens == base


def test_batch_equals_one_at_a_time(target, draft):
    engine = specjax.Engine(target, draft=draft, method="fly", k=4, max_new_tokens=NEW, theta=0.0)
    batched = engine.generate(PROMPTS).tokens
    assert batched == [engine.generate([p]).tokens[0] for p in PROMPTS]


def test_eos_and_max_new_tokens_are_never_passed(target, draft, baseline):
    eos = baseline[2][5]
    target_eos = dataclasses.replace(target, config=dataclasses.replace(TINY, eos_token_ids=(eos,)))
    for max_new in (1, 7, NEW):
        out = specjax.Engine(target_eos, draft=draft, k=8, max_new_tokens=max_new).generate(PROMPTS)
        for full, got in zip(baseline, out.tokens):
            cut = full[:max_new]
            expected = cut[: cut.index(eos) + 1] if eos in cut else cut
            assert got == expected


def test_loose_rules_accept_mismatches_and_count_them(target):
    bad_draft = random_model(TINY, seed=99)  # rarely agrees with the target
    # fixed K: every round verifies (the adaptive loop would rightly take plain steps with this
    # draft, and the exact rule, which keeps less, fewer verified rounds than FLy)
    out = specjax.Engine(target, draft=bad_draft, method="fly", k=6, max_new_tokens=NEW, theta=0.0,
                         window=0, adaptive=False).generate(PROMPTS)
    assert out.stats["loose"] > 0 and 0 < out.stats["loose_share"] <= 1
    assert out.stats["mismatches_examined"] >= out.stats["loose"]
    exact = specjax.Engine(target, draft=bad_draft, k=6, max_new_tokens=NEW, adaptive=False).generate(PROMPTS)
    assert out.stats["tau"] > exact.stats["tau"]


def test_asd_ledger_and_csd_memory_in_stats(target, draft):
    asd = specjax.Engine(target, draft=draft, method="asd", k=4, max_new_tokens=NEW, budget=3.0,
                         gate=10.0, block_cap=4).generate(PROMPTS)
    spent = np.asarray(asd.stats["ledger_spent_per_request"])
    assert (spent >= 0).all() and (spent <= 3.0 + 1e-6).all()
    assert (spent > 0).any() == (asd.stats["loose"] > 0)
    # fixed K: every round verifies, so the rule meets mismatches to remember (the adaptive loop
    # may find that this random draft does not pay and take plain steps, where no rule runs)
    csd = specjax.Engine(target, draft=draft, method="csd", k=4, max_new_tokens=NEW, min_count=0,
                         csd_memory=128, adaptive=False).generate(PROMPTS)
    assert 0 < csd.stats["csd_memory_filled"] <= 128 and csd.stats["csd_memory_capacity"] == 128


def test_csd_memory_carries_on_across_calls(target, draft):
    """out.rule_state is the memory with this call's lessons; passing it on continues from it,
    exactly as an engine built with that memory, without compiling again."""
    # fixed K: the rule sees every proposal, whatever a cost table measured on a busy machine says
    engine = specjax.Engine(target, draft=draft, method="csd", k=4, max_new_tokens=NEW, min_count=0,
                            csd_memory=128, adaptive=False)
    first = engine.generate(PROMPTS[:2])
    learned = first.rule_state
    assert isinstance(learned, specjax.verify.CSDMemory) and int(learned.filled) == first.stats["csd_memory_filled"] > 0
    compiled = loop.Program.run._cache_size()
    fresh = engine.generate(PROMPTS[2:])  # no rule_state: starts from the construction memory again
    carried = engine.generate(PROMPTS[2:], rule_state=learned)
    assert loop.Program.run._cache_size() == compiled + 1  # one more batch shape, not one more per memory
    again = engine.generate(PROMPTS[2:], rule_state=fresh.rule_state)
    assert loop.Program.run._cache_size() == compiled + 1
    rebuilt = specjax.Engine(target, draft=draft, method="csd", k=4, max_new_tokens=NEW, min_count=0,
                             csd_memory=learned, adaptive=False).generate(PROMPTS[2:])
    assert carried.tokens == rebuilt.tokens and carried.stats == rebuilt.stats
    assert carried.rule_state.to_dict() == rebuilt.rule_state.to_dict()
    # what the first call learned is still there, plus what this call added
    assert set(learned.to_dict()) <= set(carried.rule_state.to_dict())
    assert carried.stats["csd_memory_filled"] >= fresh.stats["csd_memory_filled"]
    assert again.stats["csd_memory_filled"] >= fresh.stats["csd_memory_filled"]


def test_rule_objects_and_method_names_are_one_engine(target, draft):
    """Engine(method=verify.Csd(...)) with a memory as rule_state is Engine(method="csd", csd_memory=...):
    the memory is starting state, of whatever capacity it was built with."""
    memory = specjax.Engine(target, draft=draft, method="csd", k=4, max_new_tokens=NEW, min_count=0,
                            csd_memory=128).generate(PROMPTS[:2]).rule_state
    by_name = specjax.Engine(target, draft=draft, method="csd", k=4, max_new_tokens=NEW, min_count=0,
                             csd_memory=memory).generate(PROMPTS[2:])
    by_object = specjax.Engine(target, draft=draft, method=specjax.verify.Csd(min_count=0), k=4,
                               max_new_tokens=NEW).generate(PROMPTS[2:], rule_state=memory)
    assert by_object.tokens == by_name.tokens and by_object.stats == by_name.stats
    fly = specjax.Engine(target, draft=draft, method=specjax.verify.Fly(theta=0.1, window=2), k=4,
                         max_new_tokens=NEW).generate(PROMPTS)
    assert fly.tokens == specjax.Engine(target, draft=draft, method="fly", theta=0.1, window=2, k=4,
                                        max_new_tokens=NEW).generate(PROMPTS).tokens
    with pytest.raises(ValueError, match="rule object .* already holds its options"):
        specjax.Engine(target, draft=draft, method=specjax.verify.Fly(), theta=0.2)


def test_a_rule_state_of_another_kind_is_refused(target, draft):
    csd = specjax.Engine(target, draft=draft, method="csd", k=4, max_new_tokens=4, csd_memory=16)
    asd = specjax.Engine(target, draft=draft, method="asd", k=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="rule_state does not match method 'asd'"):
        asd.generate(PROMPTS, rule_state=csd.rule.init_state(3))
    with pytest.raises(ValueError, match="batch of another size"):
        asd.generate(PROMPTS, rule_state=asd.rule.init_state(2))
    with pytest.raises(ValueError, match="target-only decoding"):
        specjax.Engine(target, max_new_tokens=4).generate(PROMPTS, rule_state=asd.rule.init_state(3))
    ledgers = asd.generate(PROMPTS).rule_state  # ASD's state: what is left of each request's budget
    assert ledgers.shape == (3,) and (np.asarray(ledgers) >= 0).all()


def test_prompt_bucket_compiles_once_for_prompts_of_many_lengths(target, draft):
    """prompt_bucket=64: the three prompts (10, 2 and 20 tokens) share one program, and the
    wider padding changes no token."""
    wide = specjax.Engine(target, draft=draft, method="fly", k=4, max_new_tokens=NEW, prompt_bucket=64)
    narrow = specjax.Engine(target, draft=draft, method="fly", k=4, max_new_tokens=NEW)

    def programs_compiled(engine):  # jit's cache is shared by every engine of the process: count new entries
        before = loop.Program.run._cache_size()
        tokens = [engine.generate([p]).tokens for p in PROMPTS]
        return loop.Program.run._cache_size() - before, tokens

    (n_wide, wide_tokens), (n_narrow, narrow_tokens) = programs_compiled(wide), programs_compiled(narrow)
    assert wide_tokens == narrow_tokens
    assert n_wide == 1 and n_narrow == 2  # 16-token buckets: widths 16 and 32
    with pytest.raises(ValueError, match="prompt_bucket must be a positive integer"):
        specjax.Engine(target, max_new_tokens=4, prompt_bucket=0)


def test_sampling_at_temperature_is_seeded(target, draft):
    run = lambda seed, method="exact": specjax.Engine(  # noqa: E731
        target, draft=draft, method=method, k=4, max_new_tokens=NEW, temperature=0.8, seed=seed).generate(PROMPTS)
    a, b, c = run(3), run(3), run(4)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert run(3, "fly").stats["tau"] >= 1.0


def test_speculative_sampling_matches_target_distribution():
    """First sampled token after the prefill+1 round: speculative vs target-only frequencies."""
    cfg = dataclasses.replace(TINY, vocab_size=5)
    target, draft = random_model(cfg, seed=1), random_model(cfg, seed=2)
    prompt = [[1, 2, 3]]
    counts = {"spec": np.zeros((5, 5)), "base": np.zeros((5, 5))}
    for seed in range(300):
        base = specjax.Engine(target, max_new_tokens=2, temperature=1.0, seed=seed).generate(prompt).tokens[0]
        spec = specjax.Engine(target, draft=draft, k=2, max_new_tokens=2, temperature=1.0,
                              seed=seed).generate(prompt).tokens[0]
        counts["base"][base[0], base[1]] += 1
        counts["spec"][spec[0], spec[1]] += 1
    # the second token's conditional distribution must agree (the first comes from the same prefill)
    probs = np.asarray(jax.nn.softmax(target.logits(np.array([[1, 2, 3, t] for t in range(5)]))[:, -1]))
    expected = counts["spec"].sum(1, keepdims=True) * probs
    mask = expected > 5
    chi2 = ((counts["spec"] - expected) ** 2 / np.where(mask, expected, 1))[mask].sum()
    assert chi2 < 60, chi2  # ~20 degrees of freedom; a wrong distribution gives hundreds


def test_prompt_lookup_finds_the_longest_earliest_ngram():
    pld = drafters.PromptLookup(k=3)
    seq = np.zeros((1, 32), np.int32)
    tokens = [9, 1, 2, 3, 7, 7, 1, 2, 3, 8, 4, 2, 3]  # suffix "2 3": earliest match at 1..2 (with "1 2 3" too)
    seq[0, : len(tokens)] = tokens
    drafts_, num, found = jax.device_get(pld.lookup(seq, np.array([len(tokens) - 1])))
    assert found[0] and drafts_[0].tolist() == [7, 7, 1] and num[0] == 3
    latest = drafters.PromptLookup(k=3, match="latest")
    drafts_, num, found = jax.device_get(latest.lookup(seq, np.array([len(tokens) - 1])))
    assert drafts_[0].tolist() == [8, 4, 2] and num[0] == 3
    # the continuation stops at the pending token: num_draft < K
    seq2 = np.zeros((1, 16), np.int32)
    seq2[0, :5] = [4, 5, 6, 4, 5]
    drafts_, num, _ = jax.device_get(drafters.PromptLookup(k=5).lookup(seq2, np.array([4])))
    assert drafts_[0, :3].tolist() == [6, 4, 5] and num[0] == 3
    # no match: nothing proposed, the round is a plain decoding step
    seq3 = np.zeros((1, 8), np.int32)
    seq3[0, :3] = [1, 2, 3]
    drafts_, num, found = jax.device_get(pld.lookup(seq3, np.array([2])))
    assert not found[0] and num[0] == 0


def test_one_program_launch_count_does_not_grow(target, draft, tmp_path):
    """Device launches of `generate`, counted from a jax.profiler trace, do not depend on
    max_new_tokens: the rounds run inside one compiled program."""
    launches = []
    for new in (4, 40):
        engine = specjax.Engine(target, draft=draft, method="fly", k=4, max_new_tokens=new, eos_ids=())
        engine.generate(PROMPTS)  # compile outside the trace
        launches.append(_count_launches(lambda: engine.generate(PROMPTS), tmp_path / str(new)))
    assert launches[0] == launches[1] == 1
    text = specjax.Engine(target, draft=draft, k=4, max_new_tokens=8).lower(PROMPTS).as_text()
    assert "callback" not in text.lower() and text.count("stablehlo.while") >= 2


def _count_launches(fn, trace_dir):
    import glob
    import gzip
    import json

    with jax.profiler.trace(str(trace_dir)):
        fn()
    (path,) = glob.glob(str(trace_dir / "**" / "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))["traceEvents"]
    return sum(1 for e in events if str(e.get("name", "")).endswith("ExecuteHelperOnSingleDevice"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft="nope"), "unknown draft 'nope'"),
    (dict(draft="self:0"), "N must be an integer"),
    (dict(draft="pld", k=0), "k must be an integer >= 1"),
    (dict(draft="pld", method="bogus"), "unknown method 'bogus'"),
    (dict(draft=None, method="fly"), "needs a draft"),
    (dict(draft="pld", method="asd", temperature=0.5), "temperature-0 rule"),
    (dict(draft="pld", method="fly", bogus=1), "unknown rule option 'bogus'"),
    (dict(draft="pld", method="fly", budget=1.0), "does not apply to method 'fly'"),
    (dict(draft="pld", top_p=0.9, temperature=1.0), "top_p < 1"),
])
def test_bad_arguments_fail_before_compiling(target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        specjax.Engine(target, max_new_tokens=8, **kwargs)


def test_draft_vocabulary_mismatch(target):
    other = random_model(dataclasses.replace(TINY, vocab_size=62), seed=0)
    # another vocabulary is bridged only between two byte-level tokenizers: random models have none,
    # and the error names both models before anything compiles
    with pytest.raises(ValueError, match=r"cannot translate between the vocabularies of \S+ \(target\) "
                                         r"and random-0 \(draft\).*tokenizer is missing"):
        specjax.Engine(target, draft=other)


def test_k_too_large_for_the_cache(target):
    with pytest.raises(ValueError, match=r"k 40 \+ 1 = .* > max_len 64"):
        specjax.Engine(target, draft="pld", k=40, max_new_tokens=20, max_len=64).generate([[1, 2, 3, 4, 5]])


def test_every_drafter_implements_the_drafter_protocol(target, draft):
    """The loop calls the `drafters.Drafter` methods and never asks which kind a drafter is: every
    kind has init, propose, observe, k, name and uses_features; only a feature drafter reads the
    target's features, and the others hand their state back from observe unchanged."""
    import inspect

    from specjax.models import feature_draft as FD

    ids = np.arange(TINY.vocab_size, dtype=np.int32)
    feature = FD.FeatureDraft(FD.layer_config(target.config), FD.init_params(target.config, target.params, ids),
                              ids, "fd")
    specs = [*drafts(draft).values(), feature, ("pld", feature)]
    kinds = set()
    for spec in specs:
        drafter, _ = drafters.from_spec(spec, target, 3)
        kinds.add(type(drafter).__name__)
        assert isinstance(drafter, drafters.Drafter), type(drafter)
        for method in ("init", "propose"):
            assert "backend" in inspect.signature(getattr(drafter, method)).parameters, (type(drafter), method)
        if not drafter.uses_features:
            state = object()
            assert drafter.observe(state, None, None) is state
    assert kinds == {"ModelDrafter", "PromptLookup", "MultiLevel", "FeatureDrafter", "LookupFirst"}
    assert not isinstance(object(), drafters.Drafter)  # the check can fail
