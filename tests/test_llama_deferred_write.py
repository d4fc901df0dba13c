"""A deferred cache write (`llama.forward_cached(..., write=False)` + `llama.write_kv`) is the
in-place forward, bit for bit: the adaptive loop's branches rely on it for exactness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import native
from specjax.backend import Backend
from specjax.models import Config, llama

TINY = Config(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=300.0)
B, S = 3, 24


def _filled_cache(params):
    """A cache holding ragged prompts, with stale values past each row's length (as rejected drafts leave)."""
    prompt = jax.random.randint(jax.random.PRNGKey(1), (B, 10), 0, TINY.vocab_size)
    cache = llama.init_cache(TINY, B, S)
    _, cache = llama.forward_cached(TINY, params, prompt, cache)
    return cache._replace(lengths=jnp.array([4, 10, 7], jnp.int32))


@pytest.mark.parametrize("layout", ["scan", "unrolled"])
@pytest.mark.parametrize("T", [1, 5])
def test_deferred_write_is_the_in_place_forward(layout, T):
    params = llama.init_params(TINY, seed=3)
    if layout == "unrolled":
        params = llama.unstack_layers(params)
    cache = _filled_cache(params)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, TINY.vocab_size)
    logits, written = jax.jit(lambda p, c: llama.forward_cached(TINY, p, tokens, c))(params, cache)
    logits_d, new = jax.jit(lambda p, c: llama.forward_cached(TINY, p, tokens, c, write=False))(params, cache)
    assert isinstance(new, llama.NewKV) and new.k.shape == (TINY.num_layers, B, T, 2, 8)
    np.testing.assert_array_equal(logits_d, logits)
    deferred = llama.write_kv(cache, new)
    for a, b in zip(deferred, written):
        np.testing.assert_array_equal(a, b)
    # the features path too
    _, feats, new_f = jax.jit(lambda p, c: llama.forward_features(TINY, p, tokens, c, write=False))(params, cache)
    _, feats_w, written_f = jax.jit(lambda p, c: llama.forward_features(TINY, p, tokens, c))(params, cache)
    np.testing.assert_array_equal(feats, feats_w)
    np.testing.assert_array_equal(llama.write_kv(cache, new_f).v, written_f.v)


def test_write_kv_count_leaves_the_padding_unwritten():
    params = llama.init_params(TINY, seed=3)
    cache = _filled_cache(params)
    tokens = jnp.ones((B, 4), jnp.int32)
    _, new = llama.forward_cached(TINY, params, tokens, cache, write=False)
    out = llama.write_kv(cache, new, count=2)
    for b, L in enumerate(np.asarray(cache.lengths)):
        np.testing.assert_array_equal(out.k[:, b, L:L + 2], new.k[:, b, :2])
        np.testing.assert_array_equal(out.k[:, b, L + 2:], cache.k[:, b, L + 2:])  # padding: not written
        np.testing.assert_array_equal(out.v[:, b, :L], cache.v[:, b, :L])
    # positions past the cache's end are dropped, not wrapped
    full = cache._replace(lengths=jnp.full((B,), S - 1, jnp.int32))
    out = llama.write_kv(full, new)
    np.testing.assert_array_equal(out.k[:, :, : S - 1], full.k[:, :, : S - 1])
    np.testing.assert_array_equal(out.k[:, :, S - 1], new.k[:, :, 0])


@pytest.mark.skipif(not native.available(), reason="the native kernel is not built here")
def test_deferred_write_with_native_attention():
    params = llama.unstack_layers(llama.init_params(TINY, seed=3))
    backend = Backend(kernels=native, native_attention=True)
    cache = _filled_cache(params)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, 3), 0, TINY.vocab_size)
    logits, written = llama.forward_cached(TINY, params, tokens, cache, backend=backend)
    logits_d, new = llama.forward_cached(TINY, params, tokens, cache, backend=backend, write=False)
    np.testing.assert_array_equal(logits_d, logits)
    np.testing.assert_array_equal(llama.write_kv(cache, new).k, written.k)
