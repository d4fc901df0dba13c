"""A draft model of another vocabulary in the compiled loop (specjax.cross_draft): a tiny pair of random
models with two different byte-level BPE tokenizers; exact verification against target-only decoding."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from tokenizers import Tokenizer as Backend, models as tk_models, pre_tokenizers, trainers

import specjax
from specjax import cross_draft, drafters, vocab_bridge as vb
from specjax.costs import CostTable
from specjax.models import Config, Model, random_model
from specjax.models.tokenizer import Tokenizer
from test_vocab_bridge import TRAIN, _tiny

TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "for i in range(10):\n    print(i)"]


def _model(tok, seed, layers=2):
    cfg = Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                 num_kv_heads=2, head_dim=8, rope_theta=500.0)
    m = random_model(cfg, seed=seed)
    return Model(cfg, m.params, tok, f"tiny-{tok.vocab_size}", m.dtype)


@pytest.fixture(scope="module")
def pair():
    t_tok = _tiny(520, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim|>"], digits=False, corpus=TRAIN * 3)
    d_tok = _tiny(330, ["<|im_start|>", "<|im_end|>", "<draft_only>"], digits=True, corpus=TRAIN, lacking=b"\x04")
    return _model(t_tok, 1), _model(d_tok, 2, layers=1)


@pytest.fixture(scope="module")
def prompts(pair):
    target, _ = pair
    return [target.tokenizer.encode(t) for t in TEXTS]  # ragged: 11..14 tokens


def _bytes(tok, ids):
    tb = vb.token_bytes(tok)
    return b"".join(tb[int(i)] or b"" for i in ids)


def test_exact_equals_target_only_on_a_ragged_batch(pair, prompts):
    target, draft = pair
    base = specjax.Engine(target, max_new_tokens=14, eos_ids=()).generate(prompts).tokens
    for spec in (draft, ("pld", draft)):
        engine = specjax.Engine(target, draft=spec, method="exact", k=3, max_new_tokens=14, eos_ids=())
        assert isinstance(engine.drafter, cross_draft.CrossVocabDrafter)
        out = engine.generate(prompts)
        assert out.tokens == base, engine.drafter.name
        assert out.stats["rounds"] > 0


# fly (the loose rule at T = 0) and exact at T > 0 (lossless speculative sampling with point-mass drafts) in CI;
# the other rules read the drafter's output the same way (ids, num_draft, probs None): heavy, for CI's time
@pytest.mark.parametrize("method,temperature", [
    ("fly", 0.0), ("exact", 1.0), pytest.param("asd", 0.0, marks=pytest.mark.heavy),
    pytest.param("csd", 0.0, marks=pytest.mark.heavy), pytest.param("typical", 1.0, marks=pytest.mark.heavy)])
def test_every_rule_runs(pair, prompts, method, temperature):
    target, draft = pair
    out = specjax.Engine(target, draft=draft, method=method, k=3, max_new_tokens=10, eos_ids=(),
                         temperature=temperature).generate(prompts)
    assert [len(t) for t in out.tokens] == [10, 10, 10]
    assert all(0 <= t < target.config.vocab_size for row in out.tokens for t in row)


def test_a_loose_rule_keeps_translated_drafts_that_exact_rejects(pair, prompts):
    """The rule's options reach the cross-vocabulary loop: FLy with no window and no entropy floor passes
    every mismatch of the random draft, so it keeps more tokens a round than exact and changes the
    output; the loose count says why."""
    target, draft = pair
    base = specjax.Engine(target, max_new_tokens=12, eos_ids=()).generate(prompts).tokens
    kw = dict(draft=draft, k=3, max_new_tokens=12, eos_ids=(), adaptive=False)
    exact = specjax.Engine(target, method="exact", **kw).generate(prompts)
    loose = specjax.Engine(target, method="fly", theta=0.0, window=0, **kw).generate(prompts)
    assert exact.tokens == base and exact.stats["loose"] == 0
    assert loose.stats["loose"] > 0 and loose.stats["tau"] > exact.stats["tau"]
    assert loose.tokens != base


def test_the_draft_context_follows_the_committed_text_and_proposals_continue_it(pair, prompts):
    """Driving the drafter by hand: after every round the draft's ids spell exactly the target's committed
    bytes, and the proposal spells the draft model's own greedy continuation of them (a prefix of it),
    also after rounds that accepted the last proposal (whose cached ids the feed does not recompute)."""
    target, draft = pair
    K = 3
    drafter, params = drafters.from_spec(draft, target, K)
    B, T, S = len(prompts), max(len(p) for p in prompts), 64
    seq = np.zeros((B, S), np.int32)
    for b, p in enumerate(prompts):
        seq[b, :len(p)] = p
    lens = np.asarray([len(p) for p in prompts], np.int32)
    state = jax.jit(lambda pr, ln: drafter.init(params, pr, ln, S))(jnp.asarray(seq[:, :T]), jnp.asarray(lens))
    propose = jax.jit(lambda st, s, L: drafter.propose(params, st, s, L, jax.random.PRNGKey(0), 0.0))
    _, bridge = cross_draft.split_params(params)
    agreed = jax.jit(lambda st, s, L: drafter.agreed(drafter.sync(bridge, st, s, L + 1)[0], st.d_len_B,
                                                     st.dseq_BSd.shape[1]))
    rng = np.random.default_rng(0)
    filler = target.tokenizer.encode(" return x + y  # done\n" * 3)
    L = lens.copy()  # pending token at L: the prompt's tokens then one more each round
    reused = 0
    for round_ in range(7):
        for b in range(B):
            if round_ and (round_ + b) % 2:  # the last proposal accepted whole: its cached ids are reused
                step = int(num_B[b]) + 1
                seq[b, L[b] + 1: L[b] + step] = np.asarray(ids_BK[b, :step - 1])
            else:
                step = int(rng.integers(1, K + 2)) if round_ else 0  # 1 .. K + 1 tokens committed per round
                seq[b, L[b] + 1: L[b] + 1 + step] = filler[round_ * 2: round_ * 2 + step]
            L[b] += step
            seq[b, L[b]] = filler[(round_ + b) % len(filler)]  # the pending token
        reused += int(np.sum(agreed(state, jnp.asarray(seq), jnp.asarray(L))))
        ids_BK, num_B, probs, state = propose(state, jnp.asarray(seq), jnp.asarray(L))
        assert probs is None
        for b in range(B):
            t_sync, d_len = int(state.t_sync_B[b]), int(state.d_len_B[b])
            assert t_sync == L[b] + 1
            dctx = np.asarray(state.dseq_BSd[b, :d_len])
            assert _bytes(draft.tokenizer, dctx) == _bytes(target.tokenizer, seq[b, :L[b] + 1])
            n = int(num_B[b])
            assert 1 <= n <= K
            cont = []  # the draft model's greedy continuation, recomputed without a cache
            for _ in range(drafter.kd):
                buf = np.zeros((1, 96), np.int32)  # one width: one compilation (causal: padding unseen)
                buf[0, :d_len + len(cont)] = list(dctx) + cont
                logits = np.asarray(draft.logits(buf))[0, d_len + len(cont) - 1]
                cont.append(int(np.argmax(logits)))
            assert _bytes(draft.tokenizer, cont).startswith(_bytes(target.tokenizer, ids_BK[b, :n]))
    assert reused > 0  # the rounds that accepted a proposal fed only what the cache lacked


def test_a_tokenizer_that_cannot_be_mapped_is_refused_naming_both(pair):
    target, draft = pair
    backend = Backend(tk_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    plain = Tokenizer(backend, vocab_size=backend.get_vocab_size(), bos_token_id=None, eos_token_id=None)
    not_bytes = Model(draft.config, draft.params, plain, "word-draft", draft.dtype)
    for spec in (not_bytes, ("pld", not_bytes)):
        with pytest.raises(ValueError, match=r"tiny-\d+ \(target\) and word-draft \(draft\).*byte-level"):
            specjax.Engine(target, draft=spec, k=3)
    missing = Model(draft.config, draft.params, None, "no-tokenizer", draft.dtype)
    with pytest.raises(ValueError, match="no-tokenizer.*is missing"):
        specjax.Engine(target, draft=missing, k=3)


def test_same_vocabulary_drafts_stay_model_drafters(pair):
    target, _ = pair
    same = _model(target.tokenizer, 5, layers=1)
    assert isinstance(drafters.from_spec(same, target, 3)[0], drafters.ModelDrafter)
    assert isinstance(drafters.from_spec(("pld", same), target, 3)[0], drafters.MultiLevel)


@pytest.mark.heavy  # about 15 s on CI
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_on_a_mesh_the_same_tokens(pair, prompts):
    target, draft = pair
    four = prompts + prompts[:1]
    base = specjax.Engine(target, max_new_tokens=8, eos_ids=()).generate(four).tokens
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    engine = specjax.Engine(target, draft=draft, method="exact", k=3, max_new_tokens=8, eos_ids=(), mesh=mesh)
    assert engine.generate(four).tokens == base
    own = [draft.tokenizer.encode("<|im_start|>user\n" + t) for t in TEXTS + TEXTS[:1]]
    assert engine.generate(four, draft_prompts=own).tokens == base  # the draft's prompts split over "data" too


@pytest.mark.qwen
@pytest.mark.heavy
def test_smollm2_drafts_for_qwen_exactly():
    from specjax import models

    try:
        qwen = models.load("qwen2.5-coder-0.5b-instruct")
        smol = models.load("smollm2-135m-instruct")
    except Exception as e:  # not installed: this test is opt-in
        pytest.skip(f"needs the Qwen2.5-Coder-0.5B and SmolLM2 models ({e})")
    prompts = [qwen.tokenizer.chat_prompt_ids(q) for q in
               ("Write a Python function that returns the n-th Fibonacci number.", "What is a hash map?")]
    base = specjax.Engine(qwen, max_new_tokens=24).generate(prompts).tokens
    out = specjax.Engine(qwen, draft=smol, method="exact", k=8, max_new_tokens=24).generate(prompts)
    assert out.tokens == base
    assert out.stats["tau"] > 1.2  # the translated drafts are accepted, not only correct


def test_abstract_vocabularies_lower_a_program_and_count_the_tables():
    """Ahead-of-time planning: two vocabularies known by their sizes only (no tokenizer files) give
    tables of ShapeDtypeStructs; the program lowers, and aot.bridge_bytes counts the tables."""
    from specjax import aot, models

    cfg_t = Config(vocab_size=600, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                   num_kv_heads=2, head_dim=8)
    cfg_d = Config(vocab_size=400, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=8)
    target = models.abstract(cfg_t).with_params(models.abstract(cfg_t).params, tokenizer=vb.AbstractVocab(600, 20))
    draft = models.abstract(cfg_d).with_params(models.abstract(cfg_d).params, tokenizer=vb.AbstractVocab(400, 12))
    engine = specjax.Engine(target, draft=draft, method="fly", k=4, max_new_tokens=8)
    assert isinstance(engine.drafter, cross_draft.CrossVocabDrafter)
    # per side: bytes V x width (uint8), byte counts and special map (int32 V each), the merges (int32: byte
    # tokens 256, row starts V + 1, right/rank/result of at most V - 256 merges); + the character classes of
    # the pre-tokenizer pieces (uint8 per code point of the BMP)
    merges = sum(4 * (256 + (V + 1) + 3 * (V - 256)) for V in (600, 400))
    assert aot.bridge_bytes(engine) == 600 * 20 + 400 * 12 + 2 * 4 * (600 + 400) + merges + 65536
    assert "while" in engine.lower([[1, 2, 3], [4, 5]]).as_text()
    with pytest.raises(ValueError, match="two AbstractVocab"):
        vb.abstract_bridge(vb.AbstractVocab(600), None)


def test_a_draft_prompt_in_the_drafts_own_rendering_replaces_the_translation(pair, prompts):
    """init(draft_prompt_BT=...): the draft reads the conversation as its own chat template renders it;
    the target's prompt counts as translated, and the rounds append the target's new tokens."""
    target, draft = pair
    drafter, params = drafters.from_spec(draft, target, 2)
    own = [draft.tokenizer.encode("<|im_start|>user\n" + t) for t in TEXTS]  # another rendering, draft ids
    B, S = len(prompts), 64
    T, Td = max(map(len, prompts)), max(map(len, own))
    seq, dp = np.zeros((B, S), np.int32), np.zeros((B, Td), np.int32)
    for b in range(B):
        seq[b, :len(prompts[b])], dp[b, :len(own[b])] = prompts[b], own[b]
    lens, dlens = np.asarray([len(p) for p in prompts], np.int32), np.asarray([len(o) for o in own], np.int32)
    new = target.tokenizer.encode(" x = 1")
    L = lens + len(new) - 1  # the target emitted `new`; its last token is pending
    for b in range(B):
        seq[b, lens[b]: lens[b] + len(new)] = new

    @jax.jit
    def run(prompt_BT, prompt_len_B, dp_BT, dlen_B, seq_BS, L_B):
        state = drafter.init(params, prompt_BT, prompt_len_B, S, draft_prompt_BT=dp_BT, draft_prompt_len_B=dlen_B)
        return drafter.propose(params, state, seq_BS, L_B, jax.random.PRNGKey(0), 0.0)[3]

    state = run(seq[:, :T], lens, dp, dlens, seq, L)
    for b in range(B):
        assert int(state.t_sync_B[b]) == L[b] + 1
        got = _bytes(draft.tokenizer, np.asarray(state.dseq_BSd[b, :int(state.d_len_B[b])]))
        assert got == _bytes(draft.tokenizer, own[b]) + _bytes(target.tokenizer, new)


def test_generate_takes_the_drafts_own_prompts_and_exact_stays_target_only(pair, prompts):
    """Engine.generate(prompts, draft_prompts=...): the draft reads its own rendering of each row (here another
    markup, and random ids) and exact verification still emits target-only's tokens; bad draft prompts are
    refused with one error naming the problem, before anything compiles."""
    target, draft = pair
    base = specjax.Engine(target, max_new_tokens=12, eos_ids=()).generate(prompts).tokens
    # flat costs: a verify costs one step at any width, so the loop verifies whatever is proposed
    engine = specjax.Engine(target, draft=draft, method="exact", k=3, max_new_tokens=12, eos_ids=(), max_len=64,
                            costs=CostTable.from_ratios(3, {4: 1.0}, source="test: flat"))
    own = [draft.tokenizer.encode("<|im_start|>user\n" + t) for t in TEXTS]
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, draft.tokenizer.vocab_size, size=n).tolist() for n in (3, 40, 9)]  # ragged, longer
    full = [[5] * engine.drafter.draft_len(64)] * 3  # fills the draft's cache: no row can propose
    outs = {}
    for name, dp in (("translated", None), ("own", own), ("noise", noise), ("full", full)):
        outs[name] = engine.generate(prompts, draft_prompts=dp)
        assert outs[name].tokens == base, name
    # the draft's prompt reaches the draft (random models accept nothing, so its length shows it): with a
    # full cache every round is a plain step of width 1, otherwise every round verifies a proposal
    assert outs["full"].stats["widths"][1] == outs["full"].stats["rounds"] > 0
    assert all(outs[name].stats["widths"][1] == 0 for name in ("translated", "own", "noise"))
    Vd = draft.tokenizer.vocab_size
    for bad, match in (([own[0]], r"one draft prompt per prompt \(3\), got 1"),
                       ("abc", "one draft prompt per prompt"),
                       ([own[0], own[1], [1, Vd]], rf"draft prompt 2 has token ids outside the draft's vocabulary \[0, {Vd}\)"),
                       ([own[0], [], own[2]], "draft prompt 1 must be a non-empty flat list"),
                       ([own[0], own[1], [[1, 2]]], "draft prompt 2 must be a non-empty flat list"),
                       ([own[0], own[1], [1] * 10_000], r"draft prompt 2 has 10000 ids, more than the draft's cache")):
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, draft_prompts=bad)
    with pytest.raises(ValueError, match="draft_prompts is for a draft of another vocabulary.*no draft"):
        specjax.Engine(target, max_new_tokens=4).generate(prompts, draft_prompts=own)
    same = _model(target.tokenizer, 3, layers=1)
    with pytest.raises(ValueError, match="shares the target's vocabulary"):
        specjax.Engine(target, draft=same, k=2, max_new_tokens=4).generate(prompts, draft_prompts=own)


def test_the_memory_check_counts_the_drafts_cache_as_allocated(pair, prompts, monkeypatch):
    """The cross draft's cache is draft_len(max_len) = 1.25 x max_len positions: its state_bytes equals what
    init really allocates, and the Engine's memory check refuses a budget that a count at max_len would pass."""
    from specjax import engine as engine_mod
    from specjax.sharding import memory_report

    target, draft = pair
    max_len = 64
    engine = specjax.Engine(target, draft=draft, method="exact", k=3, max_new_tokens=8, max_len=max_len, eos_ids=())
    drafter, B = engine.drafter, len(prompts)
    assert drafter.draft_len(max_len) == 80
    sds = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)  # noqa: E731
    state = jax.eval_shape(lambda p: drafter.init(p, jnp.zeros((B, 16), jnp.int32), jnp.full((B,), 5, jnp.int32),
                                                  max_len), jax.tree.map(sds, engine.params.draft))
    allocated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert drafter.state_bytes(B, max_len) == allocated
    assert 80 in state.cache.k.shape and state.dseq_BSd.shape == (B, 80)
    # what the check counted before: both configs' caches at max_len (the draft's 20 % short)
    at_max_len = engine_mod._bytes_per_position((target.config, draft.config), target.dtype, B) * max_len
    now = engine_mod._bytes_per_position((target.config,), target.dtype, B) * max_len + allocated
    assert now > at_max_len
    free = int((at_max_len + now) / 2 / 0.9)  # the old count fits this budget, the real one does not
    monkeypatch.setattr(engine_mod, "available_bytes", lambda: (free, "test memory"))
    with pytest.raises(ValueError, match="more than the .* free in test memory"):
        engine.generate(prompts)
    monkeypatch.setattr(engine_mod, "available_bytes", lambda: (int(now / 0.9) + 1, "test memory"))
    engine.lower(prompts)  # exactly enough: the check passes
    # the memory report (AOT planning) counts the same cache
    cache = jax.eval_shape(lambda: state.cache)
    assert memory_report(engine, B, max_len)["draft_cache"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def test_calibration_runs_the_exact_rounds_of_a_draft_of_another_vocabulary(pair, prompts):
    """experiments/_rounds.RoundDriver (CSD/ASD calibration with a draft that cannot be teacher-forced on
    the target's ids): the rounds it reconstructs along the target's greedy sequence are the Engine's
    exact rounds, one for one; the drafted positions hold translated drafts, the rest -1 with no regret."""
    from experiments import _rounds as R

    target, draft = pair
    K, new = 3, 12
    base = specjax.Engine(target, max_new_tokens=new, eos_ids=()).generate(prompts).tokens
    spec = specjax.Engine(target, draft=draft, method="exact", k=K, max_new_tokens=new, eos_ids=(),
                          adaptive=False).generate(prompts)
    driver = R.RoundDriver(target, draft, K, bucket=32)
    compared = 0
    for p, toks, engine_rounds in zip(prompts, base, spec.stats["rounds_per_request"]):
        seq = list(p) + list(toks)
        t_Q, d_Q, regret_Q = R.argmax_and_regret(target, draft, seq, 32, driver=driver, start=len(p))
        end = R.consistent_end(t_Q, seq, len(p))
        assert np.all(d_Q[:len(p)] == -1) and np.all(regret_Q[d_Q < 0] == 0)
        assert np.all((d_Q >= -1) & (d_Q < target.config.vocab_size)) and np.all(regret_Q >= 0)
        drafted = np.flatnonzero(d_Q >= 0)
        assert len(drafted) > 0
        if end == len(seq) - 1:  # the teacher-forced target agrees with the decode (no near tie)
            rounds = R.exact_rounds(t_Q, d_Q, len(p), end, K)
            assert len(rounds) == engine_rounds
            assert new - 1 <= sum(r.b + 1 for r in rounds) <= new  # after the prefill's token (the last may overshoot)
            compared += 1
    assert compared >= 2
