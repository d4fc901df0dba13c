"""Wide tensor parallelism: more chips on "model" than KV heads (docs/wide_tp.md), 8 fake CPU devices.

A tiny target and draft with 8 query heads / 2 KV heads on model axes of 4 and 8: each device
holds 8 / TP query heads and a copy of the KV head they read (`sharding.repeat_kv_heads`). Every
rule, with prompt lookup and with the draft model, gives the tokens of one device; the parameters
and caches per device are those of the hand count; shapes that cannot be placed are refused
before anything compiles, and attention="pad" works on abstract models.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _distributed import load_distributed  # noqa: E402

import specjax
from specjax.costs import CostTable
from specjax import aot, models, sharding, verify
from specjax.models import Config, Model, quant

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

_dist = load_distributed()
WIDE = Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
              head_dim=8, rope_theta=500.0)
WIDE_DRAFT = dataclasses.replace(WIDE, hidden_size=32, intermediate_size=64, num_layers=1)
PROMPTS = _dist.TINY_PROMPTS[:4]
RULES = tuple(m for m in verify.METHODS if m not in verify.ALIASES)  # asd csd fly greedy sampling typical


def mesh(data, model, **kw):
    return sharding.MeshConfig(jax.make_mesh((data, model), ("data", "model")), **kw)


@pytest.fixture(scope="module")
def wide():
    return (Model(WIDE, _dist.random_params(WIDE, 3), name="wide"),
            Model(WIDE_DRAFT, _dist.random_params(WIDE_DRAFT, 4), name="wide-draft"))


def _quantize(params, seed=0, bs=8):
    """wk / wv as random BlockQuant codes ([L, D/bs, bs, G*Dh], scales per output)."""
    rng = np.random.default_rng(seed)
    layers = dict(params["layers"])
    for name in ("wk", "wv"):
        L, D, G, Dh = np.shape(layers[name])
        codes = rng.integers(-8, 8, (L, D // bs, bs, G * Dh)).astype(np.int8)
        scale = rng.uniform(0.001, 0.01, (L, D // bs, 1, G * Dh)).astype(np.float32)
        offset = rng.uniform(-0.01, 0.01, (L, D // bs, 1, G * Dh)).astype(np.float32)
        layers[name] = quant.BlockQuant(codes, scale, offset, (D, G, Dh))
    return {**params, "layers": layers}


# --- the repeated model ---------------------------------------------------------


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "blockquant"])
def test_repeated_kv_heads_compute_the_same_logits(wide, quantized):
    target = wide[0] if not quantized else wide[0].with_params(_quantize(wide[0].params))
    assert sharding.repeated_kv_heads(WIDE, 4) == 4 and sharding.repeated_kv_heads(WIDE, 8) == 8
    assert sharding.repeated_kv_heads(WIDE, 2) == 2  # divides already: nothing to repeat
    assert sharding.repeat_kv_heads(target, 2) is target
    tokens = np.asarray([[3, 1, 4, 1, 5, 9]], np.int32)
    for tp in (4, 8):
        rep = sharding.repeat_kv_heads(target, tp)
        assert (rep.config.num_heads, rep.config.num_kv_heads) == (8, tp)
        k = rep.params["layers"]["wk"]
        k = k.dequantize(jnp.float32) if quantized else k
        k0 = target.params["layers"]["wk"]
        k0 = k0.dequantize(jnp.float32) if quantized else k0
        # KV head g' of the repeated model is a copy of the original's g' // (tp / 2)
        np.testing.assert_array_equal(np.asarray(k), np.repeat(np.asarray(k0), tp // 2, axis=2))
    # the function itself (once: each logits call compiles a forward)
    np.testing.assert_allclose(np.asarray(rep.logits(tokens)), np.asarray(target.logits(tokens)), rtol=1e-6, atol=1e-6)


def test_heads_that_cannot_be_placed_are_refused_before_compiling(wide):
    odd = Config(**{**dataclasses.asdict(WIDE), "num_heads": 6, "num_kv_heads": 2, "rope_scaling": None})
    assert sharding.repeated_kv_heads(odd, 4) is None  # 6 query heads on 4 devices: 1.5 each
    model = Model(odd, _dist.random_params(odd, 0), name="odd")
    with pytest.raises(ValueError, match=r"odd: 6 query heads / 2 KV heads cannot be placed on a model axis of 4.*"
                                         r"attention='pad' or 'replicate'"):
        specjax.Engine(model, draft="pld", k=2, max_new_tokens=4, eos_ids=(), mesh=mesh(2, 4, attention="repeat_kv"))
    # "auto" replicates such an attention (the MLP and vocabulary stay split), as before
    auto = specjax.Engine(model, draft="pld", k=2, max_new_tokens=4, eos_ids=(), mesh=mesh(2, 4))
    assert not auto.layout.target.attention_sharded and auto.target.config.num_kv_heads == 2
    # a plan for unrepeated heads under "repeat_kv" names the missing step
    with pytest.raises(ValueError, match="must be repeated first"):
        sharding.plan_model(WIDE, sharding.auto_mesh(jax.make_mesh((1, 8), ("data", "model"))),
                            attention="repeat_kv")


@pytest.mark.parametrize("data,tp", [(2, 4), (1, 8)])
def test_one_kv_head_per_device_as_the_hand_count_says(wide, data, tp):
    target, draft = wide
    engine = specjax.Engine(target, draft=draft, method="fly", k=2, max_new_tokens=4, eos_ids=(),
                            mesh=mesh(data, tp))
    assert engine.target.config.num_kv_heads == tp and engine.drafter.config.num_kv_heads == tp
    assert engine.layout.target.attention_sharded and engine.layout.draft.attention_sharded
    specs = sharding.param_specs(engine.params.target, engine.layout.target, engine.layout.mesh)["layers"]
    assert specs["wq"] == specs["wk"] == P(None, None, "model", None) and specs["wo"] == P(None, "model", None, None)
    report = sharding.memory_report(engine, 8, 64)
    for key, c in (("target", WIDE), ("draft", WIDE_DRAFT)):
        hand = aot.hand_count(c, tp, data, 8, 64, 4)  # H/TP query heads, lcm(G, TP)/TP = 1 KV head each
        assert report[f"{key}_params"] == hand["params"], key
        assert report[f"{key}_cache"] == hand["cache"], key
    replicated = specjax.Engine(target, draft=draft, method="fly", k=2, max_new_tokens=4, eos_ids=(),
                                mesh=mesh(data, tp, attention="replicate"))
    assert sharding.memory_report(replicated, 8, 64)["target_cache"] > 1.9 * report["target_cache"]
    # the verify rules still reduce the vocabulary-split logits shard by shard
    assert engine.layout.vocab_sharded and engine.layout.vocab_sharding.vocab_axis == "model"


def test_abstract_models_take_repeat_and_pad_alike(wide):
    """Abstract (weightless) models get the same plan and bytes as real ones, under every attention mode."""
    for attention in ("auto", "repeat_kv", "pad"):
        plans = []
        for t, d in (wide, (models.abstract(WIDE), models.abstract(WIDE_DRAFT))):
            e = specjax.Engine(t, draft=d, method="fly", k=2, max_new_tokens=4, eos_ids=(),
                               mesh=mesh(1, 8, attention=attention))
            plans.append((e.target.config, e.drafter.config, sharding.memory_report(e, 8, 64)))
        assert plans[0] == plans[1], attention
        assert plans[0][0].num_kv_heads == 8  # repeated 4x, or padded to 8 (H' = 32 then)
    # pad on the abstract 70B (it raised IndexError): 8 -> 16 KV heads, 128 query heads
    m = jax.make_mesh((1, 8), ("data", "model"))
    big = sharding.prepare_model(sharding.MeshConfig(m, attention="pad"),
                                 models.abstract("llama-3.1-70b", jnp.bfloat16), "target")
    assert (big.config.num_heads, big.config.num_kv_heads) == (64, 8)  # 8 divides 8: unchanged
    big = sharding.pad_heads(models.abstract("llama-3.1-70b", jnp.bfloat16), 16)
    assert (big.config.num_heads, big.config.num_kv_heads) == (128, 16)
    assert big.params["layers"]["wk"].shape == (80, 8192, 16, 128) and models.is_abstract(big.params)


# --- fsdp -------------------------------------------------------------------------


def test_fsdp_splits_the_target_weights_over_data_too(wide):
    target, draft = wide
    with pytest.raises(TypeError, match="fsdp must be True or False"):
        sharding.MeshConfig.of(mesh(2, 4, fsdp="yes"))
    plain = specjax.Engine(target, draft="pld", method="greedy", k=2, max_new_tokens=6, eos_ids=(), mesh=mesh(2, 4))
    engine = specjax.Engine(target, draft="pld", method="greedy", k=2, max_new_tokens=6, eos_ids=(),
                            mesh=mesh(2, 4, fsdp=True))
    specs = sharding.param_specs(engine.params.target, engine.layout.target, engine.layout.mesh)
    assert specs["layers"]["wq"] == P(None, "data", "model", None)  # D over data, heads over model
    assert specs["layers"]["w_down"] == P(None, "model", "data") and specs["embed"] == P("data", "model")
    r0, r1 = sharding.memory_report(plain, 4, 64), sharding.memory_report(engine, 4, 64)
    assert r1["target_params"] == aot.hand_count(WIDE, 4, 2, 4, 64, 4, fsdp=True)["params"]
    assert r1["target_params"] * 2 == r0["target_params"] and r1["target_cache"] == r0["target_cache"]
    assert any("fsdp" in n for n in engine.layout.target.notes)
    if ("greedy", "pld") not in _single:
        _single[("greedy", "pld")] = _run(wide, "greedy", "pld")[0]
    assert engine.generate(PROMPTS).tokens == _single[("greedy", "pld")].tokens
    # each layer's weights are gathered over "data" inside the program, not stored whole
    compiled = engine.lower(PROMPTS).compile()
    assert "all-gather" in compiled.as_text()
    stats = compiled.memory_analysis()
    if stats is not None:
        assert stats.argument_size_in_bytes < r0["target_params"]


# --- the same tokens as one device ----------------------------------------------

# Every rule on both model axes, each with prompt lookup on one and the draft model on the other.
# In CI each rule runs once (both axes and both drafters covered: about 2 minutes on 2 idle cores);
# the other six under the `matrix` marker.
def _drafter(i, j):
    return ("pld", "model")[(i + j) % 2]


CASES = [pytest.param(tp, rule, _drafter(i, j), id=f"tp{tp}-{rule}-{_drafter(i, j)}",
                      marks=[] if j == (i // 2) % 2 else [pytest.mark.matrix])  # CI: all four (TP, drafter)
         for i, rule in enumerate(RULES) for j, tp in enumerate((4, 8))]
_single = {}


def _run(wide, rule, drafter, mesh_config=None):
    target, draft_model = wide
    # one cost table for both engines, so the adaptive loop chooses the same widths on the mesh as
    # on one device (each engine would otherwise time its own)
    costs = CostTable(verify_s=(1.0, 1.1, 1.2), draft_step_s=0.05, platform="cpu", source="test")
    engine = specjax.Engine(target, draft=draft_model if drafter == "model" else "pld", method=rule, k=2,
                            max_new_tokens=6, eos_ids=(), mesh=mesh_config, costs=costs,
                            temperature=1.0 if rule == "sampling" else 0.0)
    return engine.generate(PROMPTS), engine


@pytest.mark.parametrize("tp,rule,drafter", CASES)
def test_wide_mesh_tokens_equal_one_device(wide, tp, rule, drafter):
    if (rule, drafter) not in _single:
        _single[(rule, drafter)] = _run(wide, rule, drafter)[0]
    one = _single[(rule, drafter)]
    out, engine = _run(wide, rule, drafter, mesh(8 // tp, tp))
    assert engine.target.config.num_kv_heads == tp and engine.layout.target.attention_sharded
    assert out.tokens == one.tokens, f"{rule}/{drafter} on (data {8 // tp}, model {tp})"
