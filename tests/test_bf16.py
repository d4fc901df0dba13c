"""bfloat16 end to end (params and caches stored in bf16, float32 logits), abstract models
and the configs of real models by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _presets import resolve_or_skip

import specjax
from specjax import models, sharding
from specjax.models import Config, ConfigError, catalog, llama, quant

TINY = Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8)


def float_dtypes(params):
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, quant.BlockQuant))
    return {str(x.dtype) for x in leaves if not isinstance(x, quant.BlockQuant)}


def test_random_model_stores_params_in_bf16_and_returns_float32_logits():
    m32, m16 = models.random_model(TINY, 0), models.random_model(TINY, 0, jnp.bfloat16)
    assert float_dtypes(m16.params) == {"bfloat16"}
    # the same random draw, rounded once
    for a, b in zip(jax.tree.leaves(m32.params), jax.tree.leaves(m16.params)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
    tokens = np.arange(12)[None] % 96
    l16 = m16.logits(tokens)
    assert l16.dtype == jnp.float32
    l32 = np.asarray(m32.logits(tokens))
    assert 0 < np.abs(np.asarray(l16) - l32).max() < 0.05 * np.abs(l32).max()


def test_cache_is_bf16_inside_the_forward():
    m = models.random_model(TINY, 0, jnp.bfloat16)
    cache = llama.init_cache(TINY, 2, 16, jnp.bfloat16)
    logits, cache = jax.jit(llama.forward_cached, static_argnums=0, static_argnames="dtype")(
        TINY, m.params, jnp.ones((2, 3), jnp.int32), cache, dtype=jnp.bfloat16)
    assert cache.k.dtype == cache.v.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    # [N, B, S, G, Dh]: the three positions written, nothing after them
    assert float(jnp.abs(cache.k[:, :, :3].astype(jnp.float32)).sum()) > 0
    assert float(jnp.abs(cache.k[:, :, 3:].astype(jnp.float32)).sum()) == 0


def test_block_quantized_layers_dequantize_to_the_compute_dtype():
    """A BlockQuant weight in a bf16 model computes exactly as its float values rounded to bf16."""
    m = models.random_model(TINY, 1, jnp.bfloat16)
    rng = np.random.default_rng(0)
    L, D, H, Dh = TINY.num_layers, TINY.hidden_size, TINY.num_heads, TINY.head_dim
    codes = rng.integers(-8, 8, (L, D // 16, 16, H * Dh)).astype(np.int8)
    scale = (rng.random((L, D // 16, 1, H * Dh)) * 0.02).astype(np.float32)
    bq = quant.BlockQuant(jnp.asarray(codes), jnp.asarray(scale), None, (D, H, Dh))
    plain = {**m.params, "layers": {**m.params["layers"], "wq": bq.dequantize(jnp.bfloat16)}}
    quantized = {**m.params, "layers": {**m.params["layers"], "wq": bq}}
    tokens = np.arange(10)[None] % 96
    np.testing.assert_array_equal(np.asarray(m.with_params(quantized).logits(tokens)),
                                  np.asarray(m.with_params(plain).logits(tokens)))
    assert float_dtypes(models.cast_params(quantized, jnp.bfloat16)) == {"bfloat16"}
    assert models.cast_params(quantized, jnp.bfloat16)["layers"]["wq"].scale.dtype == jnp.float32


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_memory_report_halves_in_bf16(mesh_shape):
    mesh = None if mesh_shape is None else jax.make_mesh(mesh_shape, ("data", "model"))
    reports = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        t, d = models.random_model(TINY, 0, dtype), models.random_model(TINY, 1, dtype)
        engine = specjax.Engine(t, draft=d, k=2, max_new_tokens=4, mesh=mesh, eos_ids=())
        reports[dtype] = sharding.memory_report(engine, 8, 64)
    r32, r16 = reports[jnp.float32], reports[jnp.bfloat16]
    for key in ("target_params", "draft_params"):
        assert r16[key] * 2 == r32[key] > 0, key
    for key in ("target_cache", "draft_cache"):  # k and v halve; the int32 lengths [B] do not
        assert r16[key] * 2 - r32[key] == 4 * 8 // (1 if mesh is None else mesh.shape["data"]), key


def test_bf16_engine_runs_and_keeps_float32_rule_inputs():
    t, d = models.random_model(TINY, 0, jnp.bfloat16), models.random_model(TINY, 1, jnp.bfloat16)
    out = specjax.Engine(t, draft=d, method="fly", k=3, max_new_tokens=6, eos_ids=()).generate([[1, 2, 3], [4]])
    assert [len(x) for x in out.tokens] == [6, 6]
    low = specjax.Engine(t, draft=d, method="fly", k=3, max_new_tokens=6, eos_ids=()).lower([[1, 2, 3]])
    text = low.as_text()
    assert "tensor<2x1x64x2x8xbf16>" in text  # the target cache [L, B, S, G, Dh] lives in bf16
    assert "tensor<2x1x64x2x8xf32>" not in text


# --- abstract models and real configs -------------------------------------------

# Parameter counts as published on the model cards (billions, rounded as there).
PUBLISHED = {"llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "qwen2.5-7b": 7.61,
             "qwen2.5-coder-7b": 7.61, "qwen2.5-coder-1.5b": 1.54, "qwen2.5-coder-0.5b": 0.49,
             "smollm2-135m": 0.135}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_configs_have_the_published_size(name):
    c = catalog.config(name)
    assert c.num_params() / 1e9 == pytest.approx(PUBLISHED[name], abs=0.006 if PUBLISHED[name] < 2 else 0.06)
    m = models.abstract(name, jnp.bfloat16)
    assert models.is_abstract(m.params)
    assert {x.dtype for x in jax.tree.leaves(m.params)} == {jnp.dtype(jnp.bfloat16)}
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(m.params)) == c.num_params()


def test_real_config_details():
    l8, l1, q7, q05 = (catalog.config(n) for n in ("llama-3.1-8b", "llama-3.2-1b", "qwen2.5-coder-7b",
                                                     "qwen2.5-coder-0.5b"))
    assert l8.vocab_size == l1.vocab_size == 128256 and l8.rope_theta == 500000.0
    assert l8.rope_scaling.factor == 8.0 and l1.rope_scaling.factor == 32.0
    assert l1.tie_embeddings and not l8.tie_embeddings and (l8.num_kv_heads, l1.head_dim) == (8, 64)
    assert q7.vocab_size == 152064 and q05.vocab_size == 151936 and q7.qkv_bias and q7.rope_theta == 1e6
    with pytest.raises(KeyError, match="llama-3.1-8b"):
        catalog.config("llama-9")


def test_unsupported_real_config_field_is_named():
    cfg = dict(catalog.HF_CONFIGS["smollm2-135m-instruct"], rope_interleaved=True)
    with pytest.raises(ConfigError, match="rope_interleaved"):
        models.from_hf_dict(cfg)
    with pytest.raises(ConfigError, match="use_sliding_window"):
        models.from_hf_dict(dict(catalog.HF_CONFIGS["qwen2.5-7b"], use_sliding_window=True))


def test_abstract_model_lowers_on_a_mesh_and_plans_memory():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    t, d = models.abstract(TINY, jnp.bfloat16), models.abstract(TINY, jnp.bfloat16)
    engine = specjax.Engine(t, draft=d, method="fly", k=2, max_new_tokens=4, mesh=mesh, eos_ids=())
    report = sharding.memory_report(engine, 4, 64)
    real = specjax.Engine(models.random_model(TINY, 0, jnp.bfloat16), draft=models.random_model(TINY, 1, jnp.bfloat16),
                          method="fly", k=2, max_new_tokens=4, mesh=mesh, eos_ids=())
    assert report == sharding.memory_report(real, 4, 64)
    compiled = engine.lower([[1, 2], [3], [4], [5]]).compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_pad_vocab_gives_the_same_tokens_and_never_a_padding_id():
    m = models.random_model(TINY, 0)
    p = models.pad_vocab(m, 128)
    assert p.config.vocab_size == 128 and p.config.vocab_used == 96
    tokens = np.arange(9)[None]
    lm, lp = np.asarray(m.logits(tokens)), np.asarray(p.logits(tokens))
    np.testing.assert_array_equal(lp[..., :96], lm)
    assert np.all(lp[..., 96:] == -np.inf)
    target = models.random_model(Config(**{**TINY.__dict__, "vocab_size": 128}), 2)
    out = specjax.Engine(target, draft=p, k=3, max_new_tokens=8, eos_ids=()).generate([[1, 2, 3]])
    base = specjax.Engine(target, max_new_tokens=8, eos_ids=()).generate([[1, 2, 3]])
    assert out.tokens == base.tokens
    with pytest.raises(ValueError, match="down to"):
        models.pad_vocab(m, 64)


@pytest.mark.smollm2
def test_catalog_smollm2_matches_its_gguf():
    from specjax.models import model as model_lib

    path = resolve_or_skip("smollm2-135m-instruct")
    from_file, _ = model_lib._read_config_and_tokenizer(path, True)
    named = catalog.config("smollm2-135m-instruct")
    dims = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "rope_theta", "tie_embeddings", "qkv_bias")
    assert {k: getattr(named, k) for k in dims} == {k: getattr(from_file, k) for k in dims}
    assert np.float32(named.rms_norm_eps) == np.float32(from_file.rms_norm_eps)  # GGUF stores float32
