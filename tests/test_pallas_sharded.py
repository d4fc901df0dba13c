"""Vocabulary-sharded gate statistics on 8 fake CPU devices equal the unsharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from specjax import pallas as sp
from specjax.verify import _common

NEG = -np.inf

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def plain(x, tok=None):
    """The plain reference of the statistics (verify's), as pallas.GateStats."""
    return sp.GateStats(*_common.gate_stats_reference(x, tok))


def assert_stats_close(a, b, msg=""):
    for f in sp.GateStats._fields:
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
        if f == "argmax":
            np.testing.assert_array_equal(x, y, err_msg=f"{msg} {f}")
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=f"{msg} {f}")


def hard_rows(rng, B, R, V, S):
    """[B, R, V] logits whose statistics straddle shards: ties across shards, whole -inf
    shards, a single finite entry in the last shard, top-3 spread over shards."""
    x = (rng.normal(size=(B, R, V)) * 3).astype(np.float32)
    rows = x.reshape(-1, V)
    w = V // S
    rows[0] = 0.0                                  # uniform: argmax 0, h = 1
    rows[1, 1 * w + 1] = rows[1, 3 * w + 2] = 50.0  # tied max in shards 1 and 3
    rows[2] = NEG
    rows[2, V - 1] = 1.5                           # only the last column is finite
    rows[3, : (S - 2) * w] = NEG                   # whole shards of -inf
    rows[4, [w - 1, w, 2 * w, (S - 1) * w]] = [9.0, 9.0, 8.0, 9.0]  # top-3 ties over shards
    rows[5] = np.round(rows[5])                    # many ties
    return x


@pytest.mark.parametrize("impl,variant", [("reference", None), ("kernel", "mosaic"),
                                          ("kernel", "triton")])
def test_vocab_only_mesh(impl, variant):
    mesh = jax.make_mesh((8,), ("model",))
    rng = np.random.default_rng(0)
    V = 8 * 300                                     # 300 per shard: not a multiple of the block
    x = jnp.asarray(hard_rows(rng, 2, 4, V, 8))
    tok = jnp.asarray(rng.integers(0, V, (2, 4)), jnp.int32).at[0, 0].set(V - 1).at[0, 1].set(0)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, None, "model")))
    got = sp.gate_stats_sharded(xs, tok, mesh=mesh, vocab_axis="model", impl=impl,
                                interpret=True, variant=variant, block_v=128)
    assert_stats_close(got, plain(x, tok), msg=f"{impl} {variant}")
    assert got.entropy.shape == (2, 4)


@pytest.mark.parametrize("impl,variant", [("reference", None), ("kernel", "mosaic")])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_data_model_mesh(impl, variant, axis_type):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    rng = np.random.default_rng(1)
    V = 4 * 64
    x = jnp.asarray(hard_rows(rng, 4, 3, V, 4))   # [B, K+1, V], B over "data"
    tok = jnp.asarray(rng.integers(-1, V + 1, (4, 3)), jnp.int32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))
    got = sp.gate_stats_sharded(xs, tok, mesh=mesh, vocab_axis="model", row_axis="data",
                                impl=impl, interpret=True, variant=variant, block_v=128)
    assert_stats_close(got, plain(x, tok), msg=f"{impl} {axis_type}")


def test_inside_jit_no_tokens_bf16():
    mesh = jax.make_mesh((8,), ("model",))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(5, 8 * 40)), jnp.bfloat16)
    f = jax.jit(lambda x: sp.gate_stats_sharded(x, mesh=mesh, vocab_axis="model",
                                                impl="reference"))
    got = f(x)
    want = plain(x)
    assert_stats_close(got, want)
    assert np.isnan(np.asarray(got.token_logit)).all()


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_no_full_gather(impl):
    # The compiled program moves only the 8-float partials per row between devices:
    # one all-gather of f32[8 shards, rows, 8], no other collective.
    mesh = jax.make_mesh((8,), ("model",))
    V = 8 * 1024
    x = jax.device_put(jnp.zeros((6, V)), NamedSharding(mesh, P(None, "model")))
    tok = jnp.zeros((6,), jnp.int32)
    f = jax.jit(lambda x, t: sp.gate_stats_sharded(x, t, mesh=mesh, vocab_axis="model",
                                                   impl=impl, interpret=True))
    hlo = f.lower(x, tok).compile().as_text()
    ops = ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(", "reduce-scatter(")
    collectives = [l for l in hlo.splitlines() if any(o in l for o in ops)]
    assert len(collectives) == 1 and "f32[8,6,8]" in collectives[0], collectives


def test_errors():
    mesh = jax.make_mesh((8,), ("model",))
    with pytest.raises(ValueError, match="does not divide"):
        sp.gate_stats_sharded(jnp.zeros((2, 100)), mesh=mesh, vocab_axis="model")
    with pytest.raises(ValueError, match="no axis"):
        sp.gate_stats_sharded(jnp.zeros((2, 64)), mesh=mesh, vocab_axis="vocab")
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="rows do not divide"):
        sp.gate_stats_sharded(jnp.zeros((3, 64)), mesh=mesh2, vocab_axis="model", row_axis="data")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        sp.gate_stats_sharded(jnp.zeros((2, 64), jnp.int32), mesh=mesh, vocab_axis="model")
