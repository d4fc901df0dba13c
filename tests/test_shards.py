"""Per-shard loading (`models.load(..., mesh=)`, `models.shards`) against the whole-tensor path:
the same values bit for bit, at the layout's shardings, and the cache restored at them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _checkpoints import SHAPE, write_gguf, write_hf
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
            "gguf-partly": write_gguf(root / "partly.gguf", layer_types=["Q8_0", "F16"]),
            # 8 query heads / 2 KV heads: a model axis of 4 or 8 repeats each KV head (wide tensor parallelism)
            "wide-hf-qwen2-bf16": write_hf(root / "wide-hf", shape=WIDE, qwen2=True, dtype="bfloat16"),
            "wide-gguf-mixed": write_gguf(root / "wide.gguf", shape=WIDE, layer_types=MIXED)}


WIDE = {**SHAPE, "num_heads": 8, "num_kv_heads": 2}


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


def _rename_in_place(path, old: str, new: str):
    """A tensor renamed in the file's header (same length: nothing else moves)."""
    data = path.read_bytes()
    assert len(old) == len(new) and data.count(old.encode()) == 1
    path.write_bytes(data.replace(old.encode(), new.encode()))


@pytest.mark.parametrize("kind", ["hf", "hf-sharded", "gguf"])
def test_missing_tensor_per_shard_names_the_file_as_the_whole_load_does(tmp_path, kind):
    """The per-shard reader raises the whole-tensor loader's error, word for word: the file that
    lacks the tensor (the index for a sharded directory) and the file's nearest names."""
    if kind == "gguf":
        path = write_gguf(tmp_path / "m.gguf")
        _rename_in_place(path, "blk.0.ffn_up.weight", "blk.7.ffn_up.weight")
        listing, lazy = path, shards.lazy_gguf
    else:
        path = write_hf(tmp_path / "m", max_shard_bytes=20_000 if kind == "hf-sharded" else None)
        listing = path / ("model.safetensors.index.json" if kind == "hf-sharded" else "model.safetensors")
        _rename_in_place(listing, "layers.0.mlp.up_proj", "layers.0.mlp.up_prok")
        lazy = shards.lazy_hf_dir
    with pytest.raises(models.MissingTensorError) as whole:
        models.load(path, cache=False)
    with pytest.raises(models.MissingTensorError) as per_shard:
        lazy(path)
    assert str(per_shard.value) == str(whole.value)
    assert str(per_shard.value).startswith(str(listing)) and "nearest in the file: " in str(per_shard.value)


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
def test_cache_is_restored_at_the_shardings(checkpoints, name, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    mc = mesh_config((2, 4))
    first = models.load(checkpoints[name], mesh=mc)  # converted per shard, cache written
    second = models.load(checkpoints[name], mesh=mc, dtype=jnp.bfloat16)
    assert (first.load_source, second.load_source) == ("converted", "cache")
    assert_same_tree(models.load(checkpoints[name], cache=False, dtype=jnp.bfloat16).params, second.params)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
    # a cache written by a one-process, one-device load is restored at the mesh's shardings too
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "other"))
    models.load(checkpoints[name])
    third = models.load(checkpoints[name], mesh=mc)
    assert third.load_source == "cache"
    assert_same_tree(first.params, third.params)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(third.params)):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)


# --- KV heads repeated per shard (wide tensor parallelism, docs/wide_tp.md) ---------------


def _kv_file_bytes(path, name):
    """Bytes of every layer's k_proj (GGUF attn_k) tensor in the file."""
    if str(path).endswith(".gguf"):
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("attn_k.weight"))
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="numpy") as f:
        return sum(f.get_slice(k)[:].nbytes for k in f.keys() if k.endswith("k_proj.weight"))


@pytest.mark.parametrize("mesh_shape,attention", [((2, 4), "repeat_kv"), ((1, 8), "auto")])
@pytest.mark.parametrize("name,keep_quantized", [("wide-hf-qwen2-bf16", True), ("wide-gguf-mixed", True),
                                                 ("wide-gguf-mixed", False)])
def test_wide_load_equals_the_repeated_whole_load(checkpoints, name, keep_quantized, mesh_shape, attention):
    """Loaded per shard with the KV heads repeated: the model `prepare_model` makes of the whole
    load (config, name, every parameter bit for bit: bf16 k/v biases, block-quantized and
    RoPE-reordered GGUF k/v), at the repeated layout's shardings, kept as it is by the Engine."""
    mc = mesh_config(mesh_shape, attention=attention)
    placed = models.load(checkpoints[name], mesh=mc, cache=False, keep_quantized=keep_quantized)
    want = sharding.prepare_model(mc, models.load(checkpoints[name], cache=False, keep_quantized=keep_quantized),
                                  "target")
    tp = mesh_shape[1]
    assert (placed.config, placed.name) == (want.config, want.name) and placed.config.num_kv_heads == tp
    assert isinstance(placed.params["layers"]["wk"], quant.BlockQuant) == (name.endswith("gguf-mixed")
                                                                           and keep_quantized)
    assert_same_tree(want.params, placed.params)
    layout = sharding.make_layout(mc, placed.config)
    assert layout.target.attention_sharded  # one KV head per device, not the attention replicated
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    for x, s in zip(jax.tree.leaves(placed.params),
                    jax.tree.leaves(layout.param_shardings(placed.params), is_leaf=is_sharding)):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    engine = Engine(placed, draft="pld", method="fly", mesh=mc)
    assert engine.target.config == placed.config
    for a, b in zip(jax.tree.leaves(engine.params.target), jax.tree.leaves(placed.params)):
        assert a is b


@pytest.mark.parametrize("name", ["wide-hf-qwen2-bf16", "wide-gguf-mixed"])
def test_repeated_kv_heads_are_read_once_per_file_head(checkpoints, name):
    """A device's copy of KV head j reads the file's head j // r and nothing else; placing the
    repeated wk on a (2, 4) mesh (4 copies of each of the 2 heads) reads the file's k_proj once."""
    path = checkpoints[name]
    lazy = (shards.lazy_gguf(path) if name.endswith("gguf-mixed") else shards.lazy_hf_dir(path))[1]
    wk = shards.repeat_kv(lazy, 4)["layers"]["wk"]
    whole = full_read(lazy)["layers"]["wk"]
    per_head = _kv_file_bytes(path, name) // 2
    mc = mesh_config((2, 4), attention="repeat_kv")
    if isinstance(wk, quant.BlockQuant):
        assert wk.shape == (256, 8, 16) and wk.codes.shape[-1] == 8 * 16
        shards.BYTES_READ.clear()
        part = wk.codes.read((slice(None), slice(None), slice(None), slice(5 * 16, 6 * 16)))  # KV head 5 -> 1
        np.testing.assert_array_equal(part, np.asarray(whole.codes)[..., 16:32])
        assert shards.BYTES_READ["layers"] == per_head
        wk.codes.read.group.clear()
    else:
        assert wk.shape == (2, 256, 8, 16)
        shards.BYTES_READ.clear()
        part = wk.read((slice(None), slice(None), slice(2, 4), slice(None)))  # KV heads 2, 3 -> the file's 0
        np.testing.assert_array_equal(part, np.repeat(whole[:, :, :1], 2, axis=2))
        assert shards.BYTES_READ["layers"] == per_head
    # a region over several of the file's heads: each repeated in place (head j <- j // r, not tiled)
    wide = full_read(shards.repeat_kv(lazy, 4))["layers"]
    for key in ("wk", "wv", "bk", "bv"):
        if key in wide:
            got, base = wide[key], full_read(lazy)["layers"][key]
            if isinstance(got, quant.BlockQuant):
                got, base = got.dequantize(), base.dequantize()
            np.testing.assert_array_equal(np.asarray(got), np.repeat(np.asarray(base), 4, axis=np.ndim(base) - 2))
    wk = shards.repeat_kv(lazy, 4)["layers"]["wk"]
    abstract_wk = {"layers": {"wk": shards.abstract(wk)}}
    spec = sharding.make_layout(mc, dataclasses.replace(
        shards.lazy_hf_dir(path)[0] if not name.endswith("gguf-mixed") else shards.lazy_gguf(path)[0],
        num_kv_heads=8)).param_shardings(abstract_wk)
    shards.BYTES_READ.clear()
    placed = shards.place({"layers": {"wk": wk}}, spec)["layers"]["wk"]
    assert shards.BYTES_READ["layers"] == 2 * per_head
    got = placed.dequantize() if isinstance(placed, quant.BlockQuant) else placed
    want = whole.dequantize() if isinstance(whole, quant.BlockQuant) else whole
    np.testing.assert_array_equal(np.asarray(got), np.repeat(np.asarray(want), 4, axis=2))


def test_wide_cache_holds_the_repeated_layout(checkpoints, tmp_path, monkeypatch):
    """The conversion cached by a repeated load is the repeated layout (its own entry), restored
    per shard at its shardings; a load without the repeat keeps its own entry."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    mc = mesh_config((1, 4), attention="repeat_kv")
    path = checkpoints["wide-hf-qwen2-bf16"]
    first = models.load(path, mesh=mc)
    second = models.load(path, mesh=mc, dtype=jnp.bfloat16)
    assert (first.load_source, second.load_source) == ("converted", "cache")
    assert second.config.num_kv_heads == 4 and second.name == first.name
    want = sharding.prepare_model(mc, models.load(path, cache=False, dtype=jnp.bfloat16), "target")
    assert_same_tree(want.params, second.params)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert b.sharding.is_equivalent_to(a.sharding, a.ndim)
    assert sorted(p.name[-4:] for p in (tmp_path / "params").iterdir()) == ["-kv2"]
    plain = models.load(path, mesh=mesh_config((1, 2)))  # 2 KV heads divide 2: nothing repeated
    assert plain.load_source == "converted" and plain.config.num_kv_heads == 2


def test_draft_role_repeats_only_a_sharded_draft(checkpoints):
    path = checkpoints["wide-hf-qwen2-bf16"]
    shard = models.load(path, mesh=mesh_config((1, 8), attention="repeat_kv"), role="draft", cache=False)
    assert shard.config.num_kv_heads == 8
    rep = models.load(path, mesh=mesh_config((1, 8), attention="repeat_kv", draft="replicate"), role="draft",
                      cache=False)
    assert rep.config.num_kv_heads == 2 and all(x.sharding.is_fully_replicated for x in jax.tree.leaves(rep.params))


def test_wide_load_gives_the_tokens_of_one_device(checkpoints):
    """The per-shard repeated load (bf16 k/v biases) on (2, 4) generates the tokens of the whole
    load on one device."""
    path = checkpoints["wide-hf-qwen2-bf16"]
    prompts = [[5, 6, 7, 8, 5, 6, 7], [11, 12, 13], [3, 1, 4, 1, 5], [9, 9, 9]]
    run = lambda m, mesh: Engine(m, draft="pld", method="fly", k=2, max_new_tokens=5, eos_ids=(),  # noqa: E731
                                 mesh=mesh).generate(prompts).tokens
    mc = mesh_config((2, 4), attention="repeat_kv")
    assert run(models.load(path, mesh=mc, cache=False), mc) == run(models.load(path, cache=False), None)
