"""Per-shard loading (`models.load(..., mesh=)`, `models.shards`) against the whole-tensor path:
the same values bit for bit, at the layout's shardings, and orbax restoring the cache at them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _checkpoints import write_gguf, write_hf
from specjax import Engine, models, sharding
from specjax.models import convert, quant, shards

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

# GGUF layer weights of five block types, cycled: stacks mix K-quant and legacy blocks, with
# and without offsets, so the rebinned stacking is read per region too.
MIXED = ["Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q5_1"]


def full_read(lazy_tree):
    return jax.tree.map(lambda x: x.read(tuple(slice(None) for _ in x.shape)), lazy_tree)


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def mesh_config(shape, **kw):
    return sharding.MeshConfig(jax.make_mesh(shape, ("data", "model")), **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"hf": write_hf(root / "hf"),
            "hf-qwen2-bf16-tied-sharded": write_hf(root / "hfq", qwen2=True, tie=True, dtype="bfloat16",
                                                   max_shard_bytes=400_000),
            "gguf": write_gguf(root / "q8.gguf"),
            "gguf-mixed": write_gguf(root / "mixed.gguf", layer_types=MIXED, tie=True),
            # a weight whose layers are Q8_0 in one and F16 in the other stacks as float (both paths)
            "gguf-partly": write_gguf(root / "partly.gguf", layer_types=["Q8_0", "F16"])}


@pytest.mark.parametrize("name", ["hf", "hf-qwen2-bf16-tied-sharded"])
def test_lazy_hf_tree_is_the_converted_tree(checkpoints, name):
    path = checkpoints[name]
    c, whole = convert.load_hf_dir(path)
    lazy_c, lazy = shards.lazy_hf_dir(path)
    assert lazy_c == c
    assert_same_tree(whole, full_read(lazy))


@pytest.mark.parametrize("keep_quantized", [True, False])
@pytest.mark.parametrize("name", ["gguf", "gguf-mixed", "gguf-partly"])
def test_lazy_gguf_tree_is_the_converted_tree(checkpoints, name, keep_quantized):
    path = checkpoints[name]
    c, whole, _ = convert.load_gguf(path, keep_quantized=keep_quantized)
    lazy_c, lazy = shards.lazy_gguf(path, keep_quantized=keep_quantized)
    assert lazy_c == c
    if keep_quantized:  # the layer weights stay block-quantized on both paths, unless partly float
        assert isinstance(lazy["layers"]["wq"], quant.BlockQuant) == (name != "gguf-partly")
    assert_same_tree(whole, full_read(lazy))


def test_regions_read_only_what_they_cover(checkpoints):
    """A region of a Q8_0 weight reads its rows (heads) and whole blocks, no more."""
    _, lazy = shards.lazy_gguf(checkpoints["gguf"], keep_quantized=False)
    wq = lazy["layers"]["wq"]  # [L, D, H, Dh] from attn_q [H*Dh, D]: 34 bytes per 32 inputs
    L, D, H, Dh = wq.shape
    whole = wq.read((slice(None),) * 4)
    shards.BYTES_READ.clear()
    part = wq.read((slice(1, 2), slice(None), slice(4, 6), slice(None)))
    np.testing.assert_array_equal(part, whole[1:2, :, 4:6])
    assert shards.BYTES_READ["layers"] == 2 * Dh * D // 32 * 34


def test_quantized_head_regions_read_only_what_they_cover(checkpoints):
    """The Q8_0 LM head stays block-quantized ([D, V], blocks along D, as the converted tree);
    a region of it reads its vocabulary rows and whole blocks, no more."""
    _, lazy = shards.lazy_gguf(checkpoints["gguf"])
    head = lazy["lm_head"]
    assert isinstance(head, quant.BlockQuant) and head.offset is None
    D, V = head.shape
    whole = head.codes.read((slice(None),) * 3)
    head.codes.read.group.clear()
    shards.BYTES_READ.clear()
    part = head.codes.read((slice(None), slice(None), slice(V // 4, V // 2)))
    np.testing.assert_array_equal(part, whole[:, :, V // 4:V // 2])
    assert shards.BYTES_READ["other"] == V // 4 * D // 32 * 34
    head.codes.read.group.clear()
    shards.BYTES_READ.clear()
    head.scale.read((slice(2, 4), slice(None), slice(0, V // 8)))  # 2 blocks of V/8 rows
    assert shards.BYTES_READ["other"] == V // 8 * 2 * 34


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("name", ["hf-qwen2-bf16-tied-sharded", "gguf-mixed"])
def test_load_on_a_mesh_equals_the_whole_load(checkpoints, name, mesh_shape, dtype):
    mc = mesh_config(mesh_shape)
    placed = models.load(checkpoints[name], mesh=mc, cache=False, dtype=dtype)
    whole = models.load(checkpoints[name], cache=False, dtype=dtype)
    assert_same_tree(whole.params, placed.params)
    want = sharding.make_layout(mc, placed.config).param_shardings(placed.params)
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    for x, s in zip(jax.tree.leaves(placed.params), jax.tree.leaves(want, is_leaf=is_sharding)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    # the engine keeps the placed arrays (no second read or transfer)
    engine = Engine(placed, draft="pld", method="fly", mesh=mc)
    for a, b in zip(jax.tree.leaves(engine.params.target), jax.tree.leaves(placed.params)):
        assert a is b


def test_draft_role_follows_the_draft_plan(checkpoints):
    mc = mesh_config((1, 8), draft="replicate")
    d = models.load(checkpoints["hf"], mesh=mc, role="draft", cache=False)
    t = models.load(checkpoints["hf"], mesh=mc, cache=False)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(d.params))
    assert not t.params["layers"]["w_up"].sharding.is_fully_replicated
    with pytest.raises(ValueError, match="role must be 'target' or 'draft'"):
        models.load(checkpoints["hf"], mesh=mc, role="drafter", cache=False)


def test_head_padding_is_refused_by_name(tmp_path):
    shape = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=6,
                 num_kv_heads=3, head_dim=16)
    path = write_hf(tmp_path / "odd", shape=shape)
    with pytest.raises(ValueError, match="attention='pad' would need zero heads appended to 6/3 heads"):
        models.load(path, mesh=mesh_config((1, 8), attention="pad"), cache=False)
    # auto: the attention is replicated, the rest split; the values are the whole load's
    placed = models.load(path, mesh=mesh_config((1, 8)), cache=False)
    assert_same_tree(models.load(path, cache=False).params, placed.params)


@pytest.mark.parametrize("name", ["hf", "gguf-mixed"])
def test_orbax_cache_is_restored_at_the_shardings(checkpoints, name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    mc = mesh_config((2, 4))
    first = models.load(checkpoints[name], mesh=mc)  # converted per shard, cache written
    second = models.load(checkpoints[name], mesh=mc, dtype=jnp.bfloat16)
    assert (first.load_source, second.load_source) == ("converted", "orbax-cache")
    assert_same_tree(models.load(checkpoints[name], cache=False, dtype=jnp.bfloat16).params, second.params)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
    # a cache written by a one-process, one-device load is restored at the mesh's shardings too
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "other"))
    models.load(checkpoints[name])
    third = models.load(checkpoints[name], mesh=mc)
    assert third.load_source == "orbax-cache"
    assert_same_tree(first.params, third.params)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(third.params)):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
