"""experiments/profile_step.py (its helpers in _profile): the unrolled variant computes the engine's logits,
and the profile reads XLA's operations."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments import _profile
from specjax import models
from specjax.models import llama

EXP = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def test_unrolled_layers_give_the_scanned_logits():
    config = models.Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                           num_kv_heads=2, head_dim=8, tie_embeddings=False)
    m = models.random_model(config, seed=3)
    cache = llama.init_cache(config, 2, 16, jnp.float32)._replace(lengths=jnp.array([4, 7], jnp.int32))
    tokens = jnp.array([[5, 9], [1, 2]], jnp.int32)
    want = llama.forward_cached(config, m.params, tokens, cache)[0]
    layers = [jax.tree.map(lambda x, i=i: x[i], m.params["layers"]) for i in range(config.num_layers)]
    got = _profile.unrolled_forward(config, m.params, layers, tokens, cache)
    assert got.shape == (2, 2, 64)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_profile_lists_the_programs_operations():
    fn = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
    ops = _profile.profile_ops(fn, (jnp.ones((64, 64)), jnp.ones((64, 64))), steps=3)
    assert ops and all(ms >= 0 and n > 0 for _, ms, n in ops)
    assert not any(name.startswith("$") for name, _, _ in ops)  # Python frames are not operations


def test_bad_flags_are_refused_before_loading():
    out = subprocess.run([sys.executable, str(EXP / "profile_step.py"), "--context=300", "--cache_len=256"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--context must be below --cache_len" in out.stderr
