"""The same tokens on meshes (2, 4), (1, 8) and (8, 1) as on one device (8 fake CPU devices).

A sharded contraction (the MLP's down projection, the attention output over heads)
adds its partial sums in another order, so a logit may move by an ulp or so. Where
a token differs, the test shows that the target's top-2 logit gap there, after the
common prefix, is below 1e-4: a near tie. Any other difference is a bug.
"""

import re

import jax
import numpy as np
import pytest

from _distributed import load_distributed  # noqa: E402

import specjax
from specjax import sharding

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

# Every (mesh, method, drafter) combination runs on both models. In CI the tiny model runs one
# Latin square (each method on every mesh, every method with prompt lookup and with a draft
# model) and SmolLM2 one case per mesh (each method once, both drafters); the rest runs under
# the `matrix` marker (`-m matrix`: about 12 more minutes on 2 cores).
SQUARE = {(2, 4): ("pld", "model", "pld"), (1, 8): ("model", "pld", "model"), (8, 1): ("pld", "model", "pld")}
METHODS = ("greedy", "fly", "asd")
DRAFTERS = ("pld", "model")
TINY_CASES = [pytest.param(mesh, m, d, id=f"mesh{mesh[0]}x{mesh[1]}-{m}-{d}",
                           marks=[pytest.mark.matrix] if d != SQUARE[mesh][i] else [])
              for mesh in SQUARE for i, m in enumerate(METHODS) for d in DRAFTERS]
SMOL_CI = {((2, 4), "fly", "pld"), ((1, 8), "asd", "model"), ((8, 1), "greedy", "model")}
SMOL_CASES = [pytest.param(mesh, m, d, id=f"mesh{mesh[0]}x{mesh[1]}-{m}-{d}",
                           marks=[] if (mesh, m, d) in SMOL_CI else [pytest.mark.matrix])
              for mesh in SQUARE for m in METHODS for d in DRAFTERS]
GAP = 1e-4


def first_difference(a, b):
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_or_near_tie(target, prompts, expected, got, what):
    """Rows must match; a row that differs must first differ where the target's top-2 gap < GAP."""
    assert len(expected) == len(got)
    ties = []
    for b, (prompt, e, g) in enumerate(zip(prompts, expected, got)):
        if e == g:
            continue
        j = first_difference(e, g)
        assert j < min(len(e), len(g)), f"{what}: row {b} has {len(g)} tokens, expected {len(e)}"
        logits_V = np.asarray(target.logits(np.asarray([list(prompt) + e[:j]], np.int32)))[0, -1]
        top2 = np.sort(logits_V)[-2:]
        gap = float(top2[1] - top2[0])
        assert gap < GAP, (f"{what}: row {b} differs at new token {j} ({e[j]} on one device, {g[j]} on the mesh) "
                           f"where the target's top-2 logit gap is {gap:.3g} >= {GAP}: not a rounding tie")
        ties.append((b, j, gap))
    if ties:
        print(f"{what}: near ties {ties}")


# --- tiny random model ----------------------------------------------------------

_dist = load_distributed()
TINY_PROMPTS = _dist.TINY_PROMPTS  # 8 prompts: (8, 1) needs a batch of 8


@pytest.fixture(scope="module")
def tiny():
    return _dist.tiny_models(3)


_single = {}


def run_tiny(tiny, method, drafter, mesh_shape=None):
    target, draft_model = tiny
    draft = draft_model if drafter == "model" else drafter
    mesh = None if mesh_shape is None else jax.make_mesh(mesh_shape, ("data", "model"))
    # fixed K: compared round by round with one device
    engine = specjax.Engine(target, draft=draft, method=method, k=2, max_new_tokens=8, eos_ids=(), mesh=mesh,
                            adaptive=False)
    return engine.generate(TINY_PROMPTS), engine


def case_id(case):
    (data, model), method, drafter = case
    return f"mesh{data}x{model}-{method}-{drafter}"


def assert_partitioned(engine, prompts, attention):
    """The compiled program (cached by generate) takes the weights split over "model"."""
    compiled = engine.lower(prompts).compile()
    shardings = compiled.input_shardings[1]["params"].target  # the target's parameters (keyword arguments)
    names = ["w_gate", "w_up", "w_down"] + (["wq", "wk", "wv", "wo"] if attention else [])
    for name in names:
        for s in jax.tree.leaves(shardings["layers"][name]):  # a BlockQuant has several arrays
            assert not s.is_fully_replicated and "model" in jax.tree.leaves(tuple(s.spec)), name
    for s in jax.tree.leaves(shardings["embed"]):  # a float [D, V] table, or a BlockQuant's arrays
        assert jax.tree.leaves(tuple(s.spec)) == ["model"] and s.spec[-1] == "model"
    # the embedding / LM head table is never gathered whole: each device dots its own columns
    table = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.params.target["embed"]))
    gathered = [int(np.prod([int(d) for d in dims.split(",") if d]))
                for dims in re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", compiled.as_text())]
    assert all(n < table // 4 for n in gathered), (table, sorted(gathered)[-3:])
    stats = compiled.memory_analysis()
    if stats is not None:  # what one device receives: its shards of the weights, plus the small inputs
        planned = sum(sharding.max_bytes_per_device(p) for p in (engine.params.target, engine.params.draft) if jax.tree.leaves(p))
        assert planned <= stats.argument_size_in_bytes <= planned + 64 * 1024
        full = sum(x.nbytes for p in (engine.params.target, engine.params.draft) for x in jax.tree.leaves(p))
        assert stats.argument_size_in_bytes < 0.8 * full


@pytest.mark.parametrize("mesh_shape,method,drafter", TINY_CASES)
def test_tiny_model_tokens_equal_one_device(tiny, method, drafter, mesh_shape):
    if (method, drafter) not in _single:
        _single[(method, drafter)] = run_tiny(tiny, method, drafter)[0]
    one = _single[(method, drafter)]
    out, engine = run_tiny(tiny, method, drafter, mesh_shape)
    assert_same_or_near_tie(tiny[0], TINY_PROMPTS, one.tokens, out.tokens, f"tiny {method}/{drafter} {mesh_shape}")
    if out.tokens == one.tokens:  # same decisions, so the same round statistics
        assert out.stats["rounds_per_request"] == one.stats["rounds_per_request"]
        assert out.stats.get("loose") == one.stats.get("loose")
    model_axis = mesh_shape[1]
    # 8 heads / 4 kv heads: attention is sharded on model axes 2 and 4, and on 8 with each kv head
    # repeated twice (wide tensor parallelism: one per device, tests/test_sharding_wide.py)
    assert engine.layout.target.attention_sharded
    assert engine.target.config.num_kv_heads == max(4, model_axis)
    assert engine.layout.vocab_sharded == (model_axis > 1)
    if model_axis > 1:
        assert_partitioned(engine, TINY_PROMPTS, attention=True)
        # the verify rules reduce the vocabulary-sharded logits per shard
        assert engine.layout.vocab_sharding is not None and engine.layout.vocab_sharding.vocab_axis == "model"


def test_padded_heads_on_a_model_axis_they_do_not_divide(tiny):
    """(1, 8): the target's 8 / 4 heads and the draft's 4 / 2 become 16 / 8 zero-padded heads, sharded."""
    mesh = sharding.MeshConfig(jax.make_mesh((1, 8), ("data", "model")), attention="pad")
    target, draft = tiny
    engine = specjax.Engine(target, draft=draft, method="asd", k=2, max_new_tokens=8, eos_ids=(), mesh=mesh,
                            adaptive=False)
    assert (engine.target.config.num_heads, engine.target.config.num_kv_heads) == (16, 8)
    assert engine.layout.target.attention_sharded and engine.layout.draft.attention_sharded
    replicated = specjax.Engine(target, draft=draft, method="asd", k=2, max_new_tokens=8, eos_ids=(), adaptive=False,
                                mesh=sharding.MeshConfig(jax.make_mesh((1, 8), ("data", "model")),
                                                         attention="replicate"))
    padded_report = sharding.memory_report(engine, 8, 64)
    replicated_report = sharding.memory_report(replicated, 8, 64)
    assert padded_report["target_cache"] < replicated_report["target_cache"] / 3  # 1 kv head per device, not 4
    if ("asd", "model") not in _single:
        _single[("asd", "model")] = run_tiny(tiny, "asd", "model")[0]
    out = engine.generate(TINY_PROMPTS)
    assert_same_or_near_tie(target, TINY_PROMPTS, _single[("asd", "model")].tokens, out.tokens, "padded heads")


def test_draft_may_be_replicated(tiny):
    mesh = sharding.MeshConfig(jax.make_mesh((2, 4), ("data", "model")), draft="replicate")
    target, draft = tiny
    engine = specjax.Engine(target, draft=draft, method="greedy", k=2, max_new_tokens=8, eos_ids=(), mesh=mesh,
                            adaptive=False)
    shardings = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, engine.params.draft))
    assert all(s.is_fully_replicated for s in shardings)
    if ("greedy", "model") not in _single:
        _single[("greedy", "model")] = run_tiny(tiny, "greedy", "model")[0]
    out = engine.generate(TINY_PROMPTS)
    assert_same_or_near_tie(target, TINY_PROMPTS, _single[("greedy", "model")].tokens, out.tokens,
                            "replicated draft")


# --- SmolLM2-135M (9 heads / 3 kv heads: attention replicated, MLP and vocab sharded) ---

# SmolLM2's draft model is the target's own first 4 layers ("self:4"), to stay cheap.
SMOL_DRAFT = {"pld": "pld", "model": "self:4"}
SMOL_QUESTIONS = ["Write a Python function that reverses a list.", "What is 2 + 2?",
                  "Name three primary colors.", "def fibonacci(n):"]

# fixed K: one device and the mesh are compared round by round
SMOL_SETTINGS = dict(k=2, max_new_tokens=5, eos_ids=(), adaptive=False)
_smol_single = {}


@pytest.fixture(scope="module")
def smol_prompts(smollm2):
    ids = [smollm2.tokenizer.encode(q) for q in SMOL_QUESTIONS]  # short prompts: a cheap prefill
    return [ids[i % len(ids)] for i in range(8)]


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,method,drafter", SMOL_CASES)
def test_smollm2_tokens_equal_one_device(smollm2, smol_prompts, mesh_shape, method, drafter):
    def run(mesh):
        engine = specjax.Engine(smollm2, draft=SMOL_DRAFT[drafter], method=method, **SMOL_SETTINGS, mesh=mesh)
        return engine.generate(smol_prompts), engine

    if (method, drafter) not in _smol_single:
        _smol_single[(method, drafter)] = run(None)[0]
    one = _smol_single[(method, drafter)]
    out, engine = run(jax.make_mesh(mesh_shape, ("data", "model")))
    assert_same_or_near_tie(smollm2, smol_prompts, one.tokens, out.tokens, f"smollm2 {method}/{drafter} {mesh_shape}")
    layout = engine.layout
    assert layout.target.attention_sharded == (mesh_shape[1] == 1)  # 9 / 3 heads divide none of 2, 4, 8
    if mesh_shape[1] > 1:
        assert layout.vocab_sharded and layout.target.rules.mlp == "model"
        assert_partitioned(engine, smol_prompts, attention=False)
        # every device holds 1/m of the vocabulary and of the (block-quantized) MLP weights
        m, placed, params = mesh_shape[1], engine.params.target, smollm2.params
        assert sharding.max_bytes_per_device(placed["embed"]) * m == params["embed"].nbytes
        for name in ("w_gate", "w_up", "w_down"):
            assert sharding.max_bytes_per_device(placed["layers"][name]) * m == params["layers"][name].nbytes
        full = sum(x.nbytes for x in jax.tree.leaves(params))
        assert sharding.max_bytes_per_device(placed) < full * (0.8 if m == 4 else 0.6)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_padded_heads(smollm2, smol_prompts):
    """attention="pad" on (2, 4): 9 / 3 heads become 12 / 4; attention and KV cache split 4 ways."""
    mesh = sharding.MeshConfig(jax.make_mesh((2, 4), ("data", "model")), attention="pad")
    engine = specjax.Engine(smollm2, draft="pld", method="fly", **SMOL_SETTINGS, mesh=mesh)
    assert (engine.target.config.num_heads, engine.target.config.num_kv_heads) == (12, 4)
    assert engine.layout.target.attention_sharded
    if ("fly", "pld") not in _smol_single:
        _smol_single[("fly", "pld")] = specjax.Engine(smollm2, draft="pld", method="fly",
                                                      **SMOL_SETTINGS).generate(smol_prompts)
    out = engine.generate(smol_prompts)
    assert_same_or_near_tie(smollm2, smol_prompts, _smol_single[("fly", "pld")].tokens, out.tokens,
                            "smollm2 padded heads")
    wq = engine.params.target["layers"]["wq"]
    assert sharding.max_bytes_per_device(wq) * 4 == sum(x.nbytes for x in jax.tree.leaves(wq))
