"""verify reads the logits through specjax.pallas: forced kernels and sharded statistics give the same verdicts.

The rules' agreement with the NumPy reference (test_verify_rules) runs on the
default path (the jnp references on CPU); here the same rules run with the
Pallas kernels forced (interpret mode on CPU) and with vocabulary-sharded
statistics on 8 fake CPU devices, and must give identical verdicts, state and info.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from specjax.backend import Backend
from specjax import pallas, verify

B, K = 3, 6
# (method, temperature, options): loose rules with settings that do accept mismatches here.
CASES = [
    ("greedy", 0.0, {}),
    ("fly", 0.0, dict(theta=0.0, window=1)),
    ("fly", 0.0, dict(theta=0.1, window=2, entropy="top3", rule="reference")),
    ("asd", 0.0, dict(gate=10.0, block_cap=3, budget=4.0)),
    ("asd", 0.0, dict(gate=10.0, block_cap=3, theta=0.1)),
    ("csd", 0.0, dict(min_count=-1, tau=1e-3)),
    ("typical", 1.0, dict(epsilon=0.3)),
    ("fly", 0.7, dict(theta=0.0, window=1)),
]


def round_inputs(V, seed=0, dtype=jnp.float32):
    """A batch of rounds: flat-ish rows (entropy gates open), a -inf column, drafts
    that mostly match, two mismatches per row, one row with num_draft < K."""
    rng = np.random.default_rng(seed)
    L = rng.normal(0.0, 0.7, (B, K + 1, V)).astype(np.float32)
    L[:, :, V // 2] = -np.inf
    d = L[:, :K].argmax(-1).astype(np.int32)
    d[:, 1] = (d[:, 1] + 1) % V
    d[:, 3] = (d[:, 3] + 5) % V
    k = np.array([K, K, 4], np.int32)
    return jnp.asarray(d), jnp.asarray(L, dtype), jnp.asarray(k)


def run_rule(method, T, opts, d, L, k, vocab_sharding=None, pallas_impl=None):
    rule = verify.rule(method, **opts)
    backend = Backend(vocab_sharding=vocab_sharding, pallas=pallas_impl)
    fn = jax.jit(lambda s, d, L, k, key: rule(s, d, L, num_draft_B=k, key=key, temperature=T, backend=backend))
    return fn(rule.init_state(d.shape[0]), d, L, k, jax.random.key(3))


def assert_same(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=what)


@pytest.mark.parametrize("method,T,opts", [CASES[i] for i in (0, 2, 4, 5, 6)], ids=lambda c: str(c))
def test_forced_kernel_equals_default(method, T, opts):
    d, L, k = round_inputs(V=300)  # V not a multiple of the kernel's block
    want = run_rule(method, T, opts, d, L, k)
    got = run_rule(method, T, opts, d, L, k, pallas_impl="kernel")
    jaxpr = str(jax.make_jaxpr(lambda d, L, k: run_rule(method, T, opts, d, L, k, pallas_impl="kernel"))(d, L, k))
    assert "pallas_call" in jaxpr
    assert_same(got, want, f"{method} T={T} {opts}")
    if method != "greedy" and T == 0:  # the loose rules do accept mismatches here
        assert int(np.asarray(got[0].num_loose).sum()) > 0


def test_env_var_forces_kernel_and_default_is_reference(monkeypatch):
    d, L, k = round_inputs(V=40, dtype=jnp.bfloat16)

    def jaxpr():
        return str(jax.make_jaxpr(lambda d, L, k: jax.vmap(
            lambda d, L, k: verify.asd(d, L, 8.0, gate=10.0, num_draft=k))(d, L, k))(d, L, k))

    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    # Default: the compiled kernels on GPU/TPU, the jnp references on CPU.
    assert jaxpr().count("pallas_call") == (2 if on_accelerator else 0)
    monkeypatch.setenv(pallas.ENV_VAR, "kernel")
    assert jaxpr().count("pallas_call") == 2  # gate statistics + regret prefix
    got = jax.jit(jax.vmap(lambda d, L, k: verify.fly(d, L, theta=0.0, window=1, num_draft=k)))(d, L, k)
    monkeypatch.delenv(pallas.ENV_VAR)
    want = jax.jit(jax.vmap(lambda d, L, k: verify.fly(d, L, theta=0.0, window=1, num_draft=k)))(d, L, k)
    assert_same(got, want, "fly bf16")


def test_row_stats_are_the_pallas_statistics():
    rng = np.random.default_rng(1)
    L = jnp.asarray(rng.normal(0, 3, (5, 37)), jnp.bfloat16)
    tok = jnp.array([0, 36, 5, -1, 37], jnp.int32)
    got = verify.row_stats(L, tok)
    want = pallas.gate_stats(L, tok)  # the dispatcher: kernel on GPU/TPU, reference on CPU
    mapping = dict(max="max_logit", logit_at="token_logit")
    for field in verify.RowStats._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                      np.asarray(getattr(want, mapping.get(field, field))), err_msg=field)
    # A token outside [0, V) has no logit: a rule never accepts it loosely.
    assert np.isnan(np.asarray(got.logit_at)[3:]).all()


# --- vocabulary-sharded statistics on 8 fake CPU devices ---

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
SHARDED_CASES = [CASES[i] for i in (1, 4, 6)]  # fly, asd with the FLy gate, typical


def collectives(fn, *args):
    hlo = fn.lower(*args).compile().as_text()
    ops = ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(", "reduce-scatter(")
    return [line for line in hlo.splitlines() if any(o in line for o in ops)]


@needs_8
@pytest.mark.parametrize("method,T,opts", SHARDED_CASES, ids=lambda c: str(c))
def test_vocab_sharded_rule_equals_unsharded(method, T, opts):
    # 8-way vocabulary sharding on a 1-D mesh (jax.make_mesh's Explicit axes).
    d, L, k = round_inputs(V=8 * 40)
    want = run_rule(method, T, opts, d, L, k)
    mesh = jax.make_mesh((8,), ("model",))
    Ls = jax.device_put(L, NamedSharding(mesh, P(None, None, "model")))
    got = run_rule(method, T, opts, d, Ls, k, vocab_sharding=verify.VocabSharding(mesh, "model"))
    assert_same(got, want, f"sharded {method} {opts}")


@needs_8
def test_vocab_and_batch_sharded_moves_only_partials():
    # ("data", "model") mesh: rows over data, vocabulary over model. The only
    # collective is the all-gather of 8-float partials per row over the model axis.
    d, L, k = round_inputs(V=4 * 64)
    d, L, k = (jnp.concatenate([x, x[:1]]) for x in (d, L, k))  # 4 rows, 2 per data shard
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    sharding = verify.VocabSharding(mesh, "model", batch_axis="data")
    Ls = jax.device_put(L, NamedSharding(mesh, P("data", None, "model")))
    ds, ks = (jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (d, k))
    for method, T, opts in (CASES[0], CASES[5]):  # greedy, csd (one memory for rows on two devices)
        want = run_rule(method, T, opts, d, L, k)
        assert_same(run_rule(method, T, opts, ds, Ls, ks, vocab_sharding=sharding), want, f"{method} {opts}")
    rule = verify.Fly(theta=0.0, window=1)
    fn = jax.jit(lambda d, L, k: rule((), d, L, num_draft_B=k, backend=Backend(vocab_sharding=sharding))[0])
    ops = collectives(fn, ds, Ls, ks)
    assert len(ops) == 1 and "all-gather" in ops[0] and f"f32[2,4,{K + 1},8]" in ops[0], ops


@needs_8
def test_vocab_sharding_with_a_plain_rule():
    d, L, k = round_inputs(V=8 * 16, seed=2)
    rule = lambda d, L, k: verify.fly(d, L, theta=0.3, window=1, entropy="top3", num_draft=k)  # noqa: E731
    want = jax.jit(jax.vmap(rule))(d, L, k)
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    backend = Backend(vocab_sharding=verify.VocabSharding(mesh))
    fn = jax.jit(jax.vmap(lambda d, L, k: verify.fly(d, L, theta=0.3, window=1, entropy="top3", num_draft=k,
                                                     backend=backend)))
    got = fn(d, L, k)
    ops = collectives(fn, d, L, k)
    assert_same(got, want, "fly top3 sharded")
    assert ops and all("all-gather" in o and ",8]" in o for o in ops), ops  # partials, never logits


def test_vocab_sharding_errors():
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        verify.VocabSharding(mesh, "vocab")
    with pytest.raises(ValueError, match="Auto axis types"):
        verify.VocabSharding(mesh, "model", batch_axis="data")
    with pytest.raises(ValueError, match="share \\['model'\\]"):
        verify.VocabSharding(jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
                             "model", batch_axis="model")
    with pytest.raises(ValueError, match="VocabSharding or None"):
        Backend(vocab_sharding=(mesh, "model"))
    with pytest.raises(ValueError, match="names no mesh axis"):
        verify.VocabSharding(mesh, ())
    one = verify.VocabSharding(jax.make_mesh((1,), ("model",)))
    assert hash(one) == hash(verify.VocabSharding(jax.make_mesh((1,), ("model",))))  # static under jit
