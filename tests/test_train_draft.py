"""experiments/train_draft.py: a tiny draft distilled from random:tiny for a few steps."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import specjax
from experiments import _models
from experiments import train_draft as T
from specjax import drafters, models
from specjax.models import llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGES = ["hello there", "write a poem about the sea", "def add(a, b):", "what is 2 + 2?",
            "tell me a story", "list three colours", "explain recursion", "translate 'cat'",
            "summarize this text", "why is the sky blue?", "count to five", "name a fruit"]


@pytest.fixture(scope="module")
def target():
    return _models.random_tiny(0)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    seqs, plens = T.generate_data(target, MESSAGES, d, gen_tokens=24, batch=4)
    return seqs, plens, d


def _train(target, data, work, *, steps, stop_after=0, width=32):
    seqs, plens, _ = data
    tokens, mask = T.pack(seqs, plens, 48)
    cfg = T.draft_config(target.config, T.Arch(width, 1, head_dim=16, kv_heads=1))
    train, frozen = T.init_draft(target, cfg, 0)
    out = T.train(cfg, train, frozen, tokens, mask, tokens[:2], mask[:2], work, steps=steps, batch=4, lr=1e-2,
                  warmup=3, weight_decay=0.0, clip=1.0, seed=0, log_every=5, eval_every=10, ckpt_every=5, k=3,
                  stop_after=stop_after)
    return cfg, frozen, out


def _rows(work):
    return [json.loads(line) for line in open(work / "metrics.jsonl")]


def test_data_are_the_targets_greedy_continuations_and_cached(target, data):
    seqs, plens, d = data
    assert len(seqs) == len(MESSAGES) and sorted(os.listdir(d)) == [f"chunk_{i:05d}.npz" for i in range(3)]
    prompts = [list(map(int, s[:p])) for s, p in zip(seqs, plens)]
    ref = specjax.Engine(target, draft=None, max_new_tokens=24).generate(prompts).tokens
    assert [list(map(int, s[p:])) for s, p in zip(seqs, plens)] == ref
    again, _ = T.generate_data(target, MESSAGES, d, gen_tokens=24, batch=4)  # read back, not regenerated
    assert all(np.array_equal(a, b) for a, b in zip(seqs, again))


def test_pack_masks_only_the_continuation():
    tokens, mask = T.pack([np.arange(1, 11, dtype=np.int32)], [4], 6)  # prompt 1..4, continuation 5..10
    assert tokens.tolist() == [[4, 5, 6, 7, 8, 9, 10]]  # the prompt is cropped from the left
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1]]
    tokens, mask = T.pack([np.arange(1, 7, dtype=np.int32)], [4], 8)
    assert tokens.tolist() == [[1, 2, 3, 4, 5, 6, 0, 0, 0]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0]]  # predicts 5 and 6 only


def test_acceptance_counts_runs_of_agreement():
    tokens = np.array([[0, 1, 2, 3, 4, 5]])
    pred = np.array([[1, 2, 9, 4, 5]])  # agrees at 0, 1, 3, 4
    mask = np.ones((1, 5), np.float32)
    acc = T.acceptance(pred, tokens, mask, 2)
    assert acc["agree"] == pytest.approx(0.8)
    assert acc["tau_at_2"] == pytest.approx(1 + (2 + 1 + 0 + 2 + 1) / 5)


def test_loss_falls_resume_matches_and_export_runs_in_an_engine(target, data, tmp_path):
    # uninterrupted
    cfg, frozen, final = _train(target, data, tmp_path / "a", steps=20)
    losses = [r["loss"] for r in _rows(tmp_path / "a") if "loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0]
    # interrupted after 10 steps, then resumed from the step-10 checkpoint: the same parameters
    assert _train(target, data, tmp_path / "b", steps=20, stop_after=10)[2] is None
    assert sorted(os.listdir(tmp_path / "b" / "ckpt")) == ["10", "5"]
    _, _, resumed = _train(target, data, tmp_path / "b", steps=20)
    assert [r["step"] for r in _rows(tmp_path / "b") if "loss" in r] == [5, 10, 15, 20]
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # export: models.load reads the same function back, with the target's tokenizer
    params = jax.device_get({**frozen, **final})
    T.export(cfg, params, target.tokenizer, tmp_path / "draft")
    draft = models.load(tmp_path / "draft", cache=False)
    assert draft.config == cfg
    toks = np.asarray(data[0][0][None, :20], np.int32)
    np.testing.assert_allclose(draft.logits(toks), llama.forward(cfg, params, toks), rtol=1e-5, atol=1e-5)
    drafters.check_vocab(target, draft)
    assert draft.tokenizer.eos_token_id == target.tokenizer.eos_token_id
    # exact verification with the trained draft reproduces target-only greedy decoding
    prompts = [list(map(int, s[:p])) for s, p in zip(data[0][:3], data[1][:3])]
    ref = specjax.Engine(target, draft=None, max_new_tokens=16).generate(prompts).tokens
    out = specjax.Engine(target, draft=draft, method="exact", k=3, max_new_tokens=16).generate(prompts)
    assert out.tokens == ref


def test_full_width_draft_keeps_the_targets_head_frozen(target, data, tmp_path):
    cfg, frozen, final = _train(target, data, tmp_path, steps=5, width=0)
    assert cfg.hidden_size == target.config.hidden_size and cfg.num_layers == 1
    np.testing.assert_array_equal(frozen["embed"], np.asarray(target.params["embed"]))
    assert set(final) == {"layers"}  # only the layers train
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)[:1]))),
                         final["layers"], jax.device_get(target.params["layers"]))
    assert max(jax.tree.leaves(moved)) > 0


def test_draft_config_rejects_bad_widths(target):
    from absl import app

    with pytest.raises(app.UsageError, match="not a multiple of --head_dim"):
        T.draft_config(target.config, T.Arch(40, 1, head_dim=16))
    with pytest.raises(app.UsageError, match="wider than the target"):
        T.draft_config(target.config, T.Arch(128, 1, head_dim=16))


@pytest.mark.heavy
def test_binary_end_to_end(tmp_path):
    out = tmp_path / "d"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train_draft.py"), "--target=random:tiny",
           f"--out={out}", "--width=32", "--head_dim=16", "--layers=1", "--steps=10", "--num_data_prompts=8",
           "--package_prompts=4", "--gen_tokens=16", "--gen_batch=8", "--seq_len=48", "--val_sequences=2",
           "--eval_every=5", "--ckpt_every=5", "--timing_rounds=2", "--log_every=5"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 10/10: loss" in res.stderr and "step 10: agree" in res.stderr and "step cost" in res.stderr
    work = tmp_path / "d.work"
    assert (work / "loss_curve.png").stat().st_size > 1000
    summary = json.loads((work / "summary.json").read_text())
    assert summary["step_cost"]["draft_bytes"] < summary["step_cost"]["target_bytes"]
    assert models.load(out, cache=False).config.hidden_size == 32


def _train_feature(target, data, work, *, steps, stop_after=0, soft=0.0, chained=False):
    from experiments import _feature_distill as F
    from specjax.models import feature_draft

    seqs, plens, _ = data
    tokens, _ = T.pack(seqs, plens, 48)
    lengths = [min(len(s), 49) for s in seqs]
    feats, tops = F.target_features(target, tokens)
    mask = F.valid_mask(lengths, tokens.shape[1])
    ids = F.draft_vocab(tops, mask, target.config.eos_token_ids, 96)
    labels = F.labels_in_vocab(tops, ids)
    cfg = feature_draft.layer_config(target.config)
    params = jax.device_get(feature_draft.init_params(target.config, target.params, ids, 0))
    frozen = {"embed": np.asarray(target.params["embed"])}
    if soft:
        frozen.update(teacher_head=np.array(params["head"]), teacher_norm=np.array(params["norm"]))
    data = (tokens, feats, labels, mask)
    val = tuple(a[:2] for a in data)
    out = F.train(cfg, params, frozen, data, val, work, make_optimizer=T.make_optimizer, steps=steps, batch=4,
                  lr=1e-2, warmup=3, weight_decay=0.0, clip=1.0, seed=0, log_every=5, eval_every=10, ckpt_every=5,
                  k=3, stop_after=stop_after, soft=soft, chained=chained)
    return feature_draft.FeatureDraft(cfg, out, ids, "tiny-feature") if out is not None else None


def test_feature_draft_loss_falls_resumes_and_runs_in_an_engine(target, data, tmp_path):
    from specjax.models import feature_draft

    final = _train_feature(target, data, tmp_path / "a", steps=20)
    rows = _rows(tmp_path / "a")
    losses = [r["loss"] for r in rows if "loss" in r]
    agree = [r["eval"]["agree"] for r in rows if "eval" in r]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0] and agree[-1] > agree[0]
    assert not any("ce_chained" in r for r in rows)  # the second pass only with chained=True
    assert _train_feature(target, data, tmp_path / "b", steps=20, stop_after=10) is None
    resumed = _train_feature(target, data, tmp_path / "b", steps=20)
    for a, b in zip(jax.tree.leaves(final.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    feature_draft.save(final, tmp_path / "fd")
    draft = _models.resolve_draft(str(tmp_path / "fd"), "random:tiny")  # what --draft DIR gives the binaries
    assert isinstance(draft, feature_draft.FeatureDraft)
    prompts = [list(map(int, s[:p])) for s, p in zip(data[0][:3], data[1][:3])]
    ref = specjax.Engine(target, draft=None, max_new_tokens=16).generate(prompts).tokens
    assert specjax.Engine(target, draft=draft, method="exact", k=3, max_new_tokens=16).generate(prompts).tokens == ref


def test_step_cost_of_a_model_draft_and_of_a_feature_draft(target):
    """Both trainers' step costs (one interleaved timing loop): bytes of each side's parameters and a
    positive median time per step."""
    from experiments import _feature_distill as F
    from specjax.models import feature_draft

    cfg = T.draft_config(target.config, T.Arch(32, 1, head_dim=16, kv_heads=1))
    train, frozen = T.init_draft(target, cfg, 0)
    ids = np.arange(96, dtype=np.int32)
    fd = feature_draft.FeatureDraft(feature_draft.layer_config(target.config),
                                    feature_draft.init_params(target.config, target.params, ids, 0), ids, "fd")
    for cost in (T.step_cost(target, cfg, {**frozen, **train}, 3, context=16), F.step_cost(target, fd, 3, context=16)):
        assert cost["rounds"] == 3 and cost["context"] == 16 and 0 < cost["draft_bytes"] < cost["target_bytes"]
        assert cost["target_step_ms"] > 0 and cost["draft_step_ms"] > 0
        assert cost["time_ratio"] == pytest.approx(cost["draft_step_ms"] / cost["target_step_ms"])


def test_soft_labels_are_the_targets_own_distribution_and_training_on_them_learns(target, data, tmp_path):
    from experiments import _feature_distill as F
    from specjax.models import feature_draft

    seqs, plens, _ = data
    tokens, _ = T.pack(seqs, plens, 48)
    feats, tops = F.target_features(target, tokens)
    ids = F.draft_vocab(tops, F.valid_mask([min(len(s), 49) for s in seqs], 49), (), 96)
    labels = F.labels_in_vocab(tops, ids)
    params = feature_draft.init_params(target.config, target.params, ids, 0)
    cfg = feature_draft.layer_config(target.config)
    # the teacher's logits at position j + 1 (from its feature) pick the label of position j
    teacher = feature_draft.logits(cfg, {"norm": params["norm"], "head": params["head"]}, feats[:, 1:-1])
    inside = labels >= 0
    assert inside.mean() > 0.5
    np.testing.assert_array_equal(np.asarray(teacher.argmax(-1))[inside], labels[inside])
    _train_feature(target, data, tmp_path, steps=20, soft=0.25)
    rows = _rows(tmp_path)
    losses = [r["loss"] for r in rows if "loss" in r]
    agree = [r["eval"]["agree"] for r in rows if "eval" in r]
    assert losses[-1] < 0.8 * losses[0] and agree[-1] > agree[0]


def test_chained_loss_trains_the_step_that_reads_its_own_prediction(target, data, tmp_path):
    _train_feature(target, data, tmp_path, steps=20, chained=True)
    chained = _rows(tmp_path)
    losses = [r["ce_chained"] for r in chained if "ce_chained" in r]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0]
    agree = [r["eval"]["agree_chained"] for r in chained if "eval" in r]
    assert agree[-1] > agree[0] + 0.1  # recorded at every evaluation, and it learns


def test_feature_draft_vocabulary_keeps_every_eos():
    from experiments import _feature_distill as FDist

    tops = np.asarray([[0, 1, 1, 1, 2, 2, 3, 0]], np.int32)  # labels (positions 1..6): 1 1 1 2 2 3
    mask = np.ones((1, 6), np.float32)
    assert FDist.draft_vocab(tops, mask, (), 3).tolist() == [1, 2, 3]
    # the most frequent tokens make way for every EOS id, however rare (here: never chosen)
    assert FDist.draft_vocab(tops, mask, (7, 8), 3).tolist() == [1, 7, 8]
    assert FDist.draft_vocab(tops, mask, (2, 9), 3).tolist() == [1, 2, 9]
    with pytest.raises(ValueError, match="cannot hold the 3 EOS ids"):
        FDist.draft_vocab(tops, mask, (7, 8, 9), 2)


def test_chat_requests_are_distinct_deterministic_and_not_evaluation_questions():
    from experiments import _chat_prompts as CP
    from experiments import data

    a, b = CP.chat_requests(500, seed=0), CP.chat_requests(500, seed=0)
    assert a == b and len(a) == 500 and len(set(a)) == 500
    assert CP.chat_requests(500, seed=1) != a
    assert all("{" not in r and "}" not in r for r in a)  # every template filled
    # the three kinds are all there, in about the stated shares
    coding = sum(("Python" in r or "JavaScript" in r) and "function" in r or "algorithm" in r for r in a)
    assert 20 < coding < 90
    try:
        held_out = {q.strip() for q in data.mtbench_questions()}
    except FileNotFoundError:  # MT-Bench not installed: nothing to compare with
        held_out = set()
    assert not held_out & {r.strip() for r in CP.chat_requests(8000, seed=0)}
