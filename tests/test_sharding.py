"""specjax.sharding: logical-axis rules, parameter/cache specs, padded heads, memory per device,
bad input. (Tokens on meshes and the partitioned programs: test_sharding_engine.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from _distributed import load_distributed  # noqa: E402

import specjax
from specjax import sharding
from specjax.models import Config, Model, quant


_dist = load_distributed()
TINY, random_params, tiny_models = _dist.TINY, _dist.random_params, _dist.tiny_models
pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

SMOL_SHAPES = Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, tie_embeddings=True)


def mesh(data, model):
    return jax.make_mesh((data, model), ("data", "model"))


# --- rules ----------------------------------------------------------------------


def test_rules_map_logical_axes_and_refuse_collisions():
    rules = sharding.ShardingRules()
    assert rules.spec(("layers", "embed", "heads", "head_dim")) == P(None, None, "model", None)
    assert rules.spec(sharding.CACHE_AXES) == P(None, "data", None, "model", None)
    assert rules.spec(sharding.LOGITS_AXES) == P("data", None, "model")
    with pytest.raises(ValueError, match="'batch' and 'kv_heads'.*same mesh axis 'model'"):
        dataclasses.replace(rules, batch="model").spec(sharding.CACHE_AXES)
    with pytest.raises(ValueError, match="same mesh axis 'model'"):  # refused when the mesh is given
        sharding.MeshConfig.of(sharding.MeshConfig(mesh(2, 4), dataclasses.replace(rules, embed="model")))
    with pytest.raises(ValueError, match="no axis 'tensor'"):
        sharding.MeshConfig.of(sharding.MeshConfig(mesh(2, 4), dataclasses.replace(rules, mlp="tensor")))
    with pytest.raises(ValueError, match="unknown logical axis 'ffw'"):
        rules.spec(("ffw",))


def test_two_mesh_axes_on_one_dimension():
    rules = sharding.ShardingRules(batch=None, vocab=("data", "model"), mlp=("data", "model"))
    plan = sharding.plan_model(Config(**TINY), sharding.auto_mesh(mesh(2, 4)), rules)
    specs = sharding.param_specs(random_params(Config(**TINY), 0), plan, sharding.auto_mesh(mesh(2, 4)))
    assert specs["embed"] == P(None, ("data", "model"))
    assert specs["layers"]["w_down"] == P(None, ("data", "model"), None)


def test_mesh_must_have_data_and_model_axes():
    with pytest.raises(ValueError, match=r"mesh axes must be \('data', 'model'\)"):
        sharding.MeshConfig.of(jax.make_mesh((8,), ("model",)))
    with pytest.raises(TypeError, match="Mesh"):
        sharding.MeshConfig.of("2x4")
    with pytest.raises(ValueError, match="attention"):
        sharding.MeshConfig.of(sharding.MeshConfig(mesh(2, 4), attention="split"))


def test_heads_that_do_not_divide_replicate_attention_only():
    m = sharding.auto_mesh(mesh(2, 4))
    plan = sharding.plan_model(SMOL_SHAPES, m)  # 9 heads / 3 kv heads on a model axis of 4
    assert not plan.attention_sharded and "attention replicated" in plan.notes[0]
    params = jax.eval_shape(lambda: _float_params(SMOL_SHAPES))
    specs = sharding.param_specs(params, plan, m)
    assert specs["layers"]["wq"] == specs["layers"]["wk"] == P(None, None, None, None)
    assert specs["layers"]["wo"] == P(None, None, None, None)
    assert specs["layers"]["w_gate"] == P(None, None, "model") and specs["layers"]["w_down"] == P(None, "model", None)
    assert specs["embed"] == P(None, "model")
    divides = sharding.plan_model(dataclasses.replace(SMOL_SHAPES, num_heads=12, num_kv_heads=4), m)
    assert divides.attention_sharded and not divides.notes
    odd_vocab = sharding.plan_model(dataclasses.replace(SMOL_SHAPES, vocab_size=49153), m)
    assert odd_vocab.rules.vocab is None and odd_vocab.rules.mlp == "model"
    assert not sharding.plan_model(Config(**TINY), m, attention="replicate").attention_sharded


def _float_params(c: Config):
    D, H, G, Dh, F, V, L = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                            c.vocab_size, c.num_layers)
    z = jnp.zeros
    return {"embed": z((D, V)), "final_norm": {"scale": z((D,))},
            "layers": {"attn_norm": {"scale": z((L, D))}, "mlp_norm": {"scale": z((L, D))},
                       "wq": z((L, D, H, Dh)), "wk": z((L, D, G, Dh)), "wv": z((L, D, G, Dh)),
                       "wo": z((L, H, Dh, D)), "w_gate": z((L, D, F)), "w_up": z((L, D, F)), "w_down": z((L, F, D))}}


def quantize(params, seed=0, bs=32):
    """Random BlockQuant layer weights of the same logical shapes (codes, scale, offset)."""
    rng = np.random.default_rng(seed)
    layers = dict(params["layers"])
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        w = np.asarray(layers[name])
        L, shape = w.shape[0], w.shape[1:]
        split = 1 if name != "wo" else 2  # [*in, *out]
        n_in, n_out = int(np.prod(shape[:split])), int(np.prod(shape[split:]))
        codes = rng.integers(-8, 8, (L, n_in // bs, bs, n_out)).astype(np.int8)
        scale = rng.uniform(0.001, 0.01, (L, n_in // bs, 1, n_out)).astype(np.float32)
        offset = rng.uniform(-0.01, 0.01, (L, n_in // bs, 1, n_out)).astype(np.float32)
        layers[name] = quant.BlockQuant(codes, scale, offset, tuple(shape))
    return {**params, "layers": layers}


# --- padded heads ---------------------------------------------------------------


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "blockquant"])
def test_padded_heads_compute_the_same_logits(quantized):
    from specjax.sharding import pad_heads, padded_counts

    config = Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=6,
                    num_kv_heads=3, head_dim=32, rope_theta=500.0, qkv_bias=not quantized)
    params = random_params(config, 1)
    model = Model(config, quantize(params) if quantized else params)
    assert padded_counts(config, 4) == (8, 4) and padded_counts(config, 3) == (6, 3)
    padded = pad_heads(model, 4)
    assert (padded.config.num_heads, padded.config.num_kv_heads) == (8, 4)
    assert pad_heads(model, 3) is model  # already divides
    tokens = np.asarray([[3, 1, 4, 1, 5, 9, 2, 6]], np.int32)
    np.testing.assert_allclose(np.asarray(padded.logits(tokens)), np.asarray(model.logits(tokens)),
                               rtol=1e-5, atol=1e-6)
    plan = sharding.plan_model(padded.config, sharding.auto_mesh(mesh(2, 4)), attention="pad")
    assert plan.attention_sharded


# --- bytes per device -----------------------------------------------------------

# head_dim 32: a head is a whole quantization block, so quantized heads split too
PER_DEVICE = Config(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=8,
                    num_kv_heads=8, head_dim=32, rope_theta=500.0)
GROUPS = {"vocab": ["embed"], "mlp": ["w_gate", "w_up", "w_down"], "attention": ["wq", "wk", "wv", "wo"]}


def _group_bytes(placed):
    out = {}
    for group, names in GROUPS.items():
        trees = [placed[n] if n == "embed" else placed["layers"][n] for n in names]
        out[group] = sharding.max_bytes_per_device(trees)
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "blockquant"])
def test_sharded_parameter_bytes_fall_as_one_over_model_axis(quantized):
    params = random_params(PER_DEVICE, 0)
    if quantized:
        params = quantize(params)
    full = _group_bytes(jax.device_put(params, jax.devices()[0]))
    for m in (1, 2, 4, 8):
        layout = sharding.make_layout(sharding.MeshConfig.of(mesh(8 // m, m)), PER_DEVICE)
        assert layout.target.attention_sharded
        placed = sharding.place(params, layout.param_shardings(params))
        got = _group_bytes(placed)
        for group in GROUPS:
            assert got[group] * m == full[group], (group, m, got[group], full[group])
        # the planned bytes (before placing) are the placed ones
        assert sharding.bytes_per_device(placed) == sharding.bytes_per_device(
            params, layout.param_shardings(params))
    if quantized:
        spec = sharding.param_specs(params, sharding.plan_model(PER_DEVICE, sharding.auto_mesh(mesh(1, 8))),
                                    sharding.auto_mesh(mesh(1, 8)))["layers"]
        assert spec["w_down"].codes == P(None, "model", None, None)  # input blocks split by F
        assert spec["wo"].codes == P(None, "model", None, None)  # heads are the input of wo
        assert spec["wq"].scale == P(None, None, None, "model")  # heads are the output of wq


def test_memory_report_counts_caches_per_device():
    target, draft = tiny_models(0)
    one = specjax.Engine(target, draft=draft, method="fly", k=2, max_new_tokens=4)
    sharded = specjax.Engine(target, draft=draft, method="fly", k=2, max_new_tokens=4, mesh=mesh(2, 4))
    r1, r8 = sharding.memory_report(one, 8, 64), sharding.memory_report(sharded, 8, 64)
    # target cache: batch over data (2) and kv heads (4 of 4) over model (4); draft: its 2 kv heads
    # repeated to 4 (wide tensor parallelism), one per device: a quarter, as the target's
    assert r8["target_cache"] < r1["target_cache"] / 7
    assert r1["draft_cache"] / 4 <= r8["draft_cache"] <= r1["draft_cache"] / 4 + 16
    replicated = specjax.Engine(target, draft=draft, method="fly", k=2, max_new_tokens=4,
                                mesh=sharding.MeshConfig(mesh(2, 4), attention="replicate"))
    r_rep = sharding.memory_report(replicated, 8, 64)  # both kv heads on every device: only the batch splits
    assert r1["draft_cache"] / 2 - 16 <= r_rep["draft_cache"] <= r1["draft_cache"] / 2 + 16
    assert r8["target_params"] < r1["target_params"] / 3
    assert r8["total"] == sum(v for k, v in r8.items() if k != "total")


# --- engine: bad input -----------------------------------------------------------


def test_batch_the_data_axis_does_not_divide_is_an_error():
    target, _ = tiny_models(0)
    engine = specjax.Engine(target, draft="pld", k=2, max_new_tokens=4, mesh=mesh(4, 2))
    with pytest.raises(ValueError, match="batch of 3 prompts does not divide over mesh axis 'data' of size 4"):
        engine.generate([[1, 2], [3], [4, 5]])
    with pytest.raises(ValueError, match="mesh axes must be"):
        specjax.Engine(target, mesh=jax.make_mesh((2, 4), ("batch", "model")))
