"""Block-quantized weights: the values are gguf's own, only the storage differs."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.backend import Backend
from specjax.models import quant

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_codes_reproduce_gguf_dequantization_exactly(qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero block row
    w[5, :32] = 7.0  # a constant block
    data = gguf.quants.quantize(w, qtype)
    reference = gguf.quants.dequantize(data, qtype)
    raw = quant.extract_codes(data, qtype)
    assert raw.codes.dtype == np.int8 and raw.codes.shape == (48, 96)
    bq = raw.as_linear((96, 48))  # ours: [in, out]
    np.testing.assert_array_equal(np.asarray(bq.dequantize()), reference.T)
    # inside jit too (XLA may contract to a fused multiply-add: still exact, code*scale is exact)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda b: b.dequantize())(bq)), reference.T)


def test_row_permutation_moves_codes_and_scales_together():
    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = gguf.quants.quantize(w, T.Q4_1)
    raw = quant.extract_codes(data, T.Q4_1)
    perm = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    got = raw.permute_rows(perm).as_linear((64, 8)).dequantize()
    np.testing.assert_array_equal(np.asarray(got), gguf.quants.dequantize(data, T.Q4_1)[perm].T)


def test_stacked_layers_and_plain_round_trip():
    mats = [gguf.quants.quantize(np.full((4, 32), i + 0.5, np.float32), T.Q8_0) for i in range(3)]
    per_layer = [quant.extract_codes(m, T.Q8_0).as_linear((32, 2, 2)) for m in mats]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *per_layer)
    assert stacked.codes.shape == (3, 1, 32, 4) and stacked.shape == (32, 2, 2)
    np.testing.assert_allclose(np.asarray(stacked.dequantize())[2], np.full((32, 2, 2), 2.5), rtol=1e-2)
    plain, shapes = quant.to_plain({"layers": {"w": stacked}, "norm": np.ones(3)})
    assert shapes == {"/layers/w": [32, 2, 2]} and set(plain["layers"]["w"]) == {"codes", "scale"}
    back = quant.from_plain(plain, shapes)
    np.testing.assert_array_equal(back["layers"]["w"].dequantize(), stacked.dequantize())
    assert quant.param_bytes(back) == stacked.codes.nbytes + stacked.scale.nbytes + 3 * 8


def test_unsupported_layout_is_refused():
    data = gguf.quants.quantize(np.ones((2, 32), np.float32), T.Q8_0)
    broken = data.copy()
    broken[:, 0:2] = np.array([np.nan], np.float16).view(np.uint8)  # a scale that cannot round-trip
    with pytest.raises(ValueError, match="do not reproduce gguf's dequantization"):
        quant.extract_codes(broken, T.Q8_0)


@pytest.mark.smollm2
def test_smollm2_quantized_storage_gives_the_float32_logits(smollm2):
    from specjax.models import convert, llama, presets

    _, float_params, _ = convert.load_gguf(presets.resolve("smollm2-135m-instruct"), keep_quantized=False)
    assert quant.param_bytes(smollm2.params) < 0.5 * quant.param_bytes(float_params)
    tokens = jnp.asarray([smollm2.tokenizer.encode("The capital of France is")])
    ours = smollm2.logits(tokens)
    ref = jax.jit(llama.forward, static_argnums=0)(smollm2.config, jax.tree.map(jnp.asarray, float_params), tokens)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("qtype, d_offsets", [(T.Q4_K, (0, 2)), (T.Q6_K, (208,))])
def test_k_quant_codes_from_random_blocks(qtype, d_offsets):
    """K-quants (gguf can read but not write them): random valid blocks, finite float16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, (6 * 3, type_size), dtype=np.uint8)  # 6 rows x 3 blocks of 256
    for off in d_offsets:
        blocks[:, off: off + 2] = rng.uniform(-0.1, 0.1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(6, 3 * type_size)
    raw = quant.extract_codes(data, qtype)
    reference = gguf.quants.dequantize(data, qtype)
    np.testing.assert_array_equal(np.asarray(raw.as_linear((3 * 256, 6)).dequantize()), reference.T)


def test_layers_of_mixed_types_stack_to_one_form():
    a = quant.extract_codes(gguf.quants.quantize(np.full((4, 64), 0.5, np.float32), T.Q8_0), T.Q8_0)
    b = quant.extract_codes(gguf.quants.quantize(np.linspace(-1, 1, 256, dtype=np.float32).reshape(4, 64),
                                                 T.Q4_1), T.Q4_1)
    layers = [a.as_linear((64, 4)), b.as_linear((64, 4))]
    stacked = quant.stack_layers(layers)
    assert stacked.offset is not None  # Q8_0 gets zero offsets to match Q4_1
    for i, layer in enumerate(layers):
        np.testing.assert_array_equal(np.asarray(stacked.dequantize())[i], np.asarray(layer.dequantize()))
    mixed = quant.stack_layers([layers[0], np.ones((64, 4), np.float32)])  # one float layer: all float
    assert isinstance(mixed, np.ndarray) and mixed.shape == (2, 64, 4)


def _table(qtype, D, V, seed=0):
    """A [D, V] table stored as the GGUF stores an embedding ([V, D] rows, blocks along D)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((V, D)) * rng.uniform(0.01, 2, (V, 1))).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    return quant.extract_codes(data, qtype).as_linear((D, V)), gguf.quants.dequantize(data, qtype).T


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1])
@pytest.mark.parametrize("V, chunk", [(96, 32), (100, 32), (64, 128), (37, 8)])
def test_head_in_vocabulary_chunks_gives_the_dequantized_logits(qtype, V, chunk):
    """Chunks that divide V, that do not (the last one overlaps), and one larger than V: bit for bit
    the float table's logits in the same chunks (the float32 model's head), and the plain product's
    up to the reduction order over D (XLA:CPU blocks it differently for different widths)."""
    bq, table = _table(qtype, 64, V, seed=V)
    x = jax.random.normal(jax.random.PRNGKey(V), (2, 3, 64))
    chunked = jax.jit(lambda x, w: quant.matmul_columns(x, w, chunk=chunk))
    got = chunked(x, bq)
    assert got.shape == (2, 3, V) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(chunked(x, jnp.asarray(table))))
    plain = jnp.einsum("btd,dv->btv", x, jnp.asarray(table), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_head_chunks_in_bf16_match_the_bf16_table():
    bq, table = _table(T.Q8_0, 64, 100)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 64)).astype(jnp.bfloat16)
    chunked = jax.jit(lambda x, w: quant.matmul_columns(x, w, jnp.bfloat16, chunk=32))
    np.testing.assert_array_equal(np.asarray(chunked(x, bq)), np.asarray(chunked(x, jnp.asarray(table, jnp.bfloat16))))


def test_embedding_lookup_gathers_the_dequantized_columns():
    bq, table = _table(T.Q4_1, 64, 50)
    ids = jnp.asarray([[0, 49, 7], [7, 7, 1]])
    got = jax.jit(quant.take_columns)(bq, ids)
    assert got.shape == (2, 3, 64)
    np.testing.assert_array_equal(np.asarray(got), table.T[np.asarray(ids)])
    with pytest.raises(ValueError, match="unstacked"):
        quant.take_columns(quant.BlockQuant(bq.codes[None], bq.scale[None], bq.offset[None], bq.shape[:1]), ids)


def test_padded_quantized_vocabulary_has_zero_columns():
    from specjax import models

    bq, table = _table(T.Q8_0, 32, 10)
    padded = quant.pad_columns(bq, 6)
    assert padded.shape == (32, 16)
    np.testing.assert_array_equal(np.asarray(padded.dequantize()), np.pad(table, [(0, 0), (0, 6)]))
    config = models.Config(vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16, tie_embeddings=True)
    m = models.random_model(config)
    m = m.with_params({**m.params, "embed": bq})
    wide = models.pad_vocab(m, 16)
    logits = wide.logits(jnp.asarray([[1, 2, 9]]))
    assert wide.config.vocab_used == 10 and bool(jnp.all(jnp.isneginf(logits[..., 10:])))
    np.testing.assert_array_equal(np.asarray(logits[..., :10]), np.asarray(m.logits(jnp.asarray([[1, 2, 9]]))))


@pytest.mark.smollm2
def test_smollm2_embedding_and_head_keep_the_files_blocks(smollm2):
    """SmolLM2's tied Q8_0 table stays int8 codes: about 1.1 bytes a weight instead of 4."""
    embed = smollm2.params["embed"]
    assert isinstance(embed, quant.BlockQuant) and embed.codes.dtype == jnp.int8
    assert embed.shape == (576, 49152)
    assert embed.nbytes < 0.3 * 576 * 49152 * 4


def test_head_is_one_dot_off_the_cpu_or_on_a_vocabulary_split_mesh():
    """The chunk scan is for XLA:CPU only; elsewhere (and when GSPMD splits V) one dot that a
    mesh can shard, with the same values as the plain product of the dequantized table."""
    assert quant.default_head_chunk("cpu") == quant.VOCAB_CHUNK
    assert quant.default_head_chunk("cpu", vocab_sharded=True) == 0
    assert quant.default_head_chunk("tpu") == quant.default_head_chunk("gpu") == 0
    bq, table = _table(T.Q8_0, 64, 100)
    x = jax.random.normal(jax.random.PRNGKey(2), (1, 2, 64))
    whole = jax.jit(lambda x, w: quant.matmul_columns(x, w, chunk=0))(x, bq)
    plain = jnp.einsum("btd,dv->btv", x, jnp.asarray(table), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(plain))

    def has_scan(chunk):
        backend = Backend(head_chunk=chunk)
        return "scan" in str(jax.make_jaxpr(lambda x: quant.matmul_columns(x, bq, backend=backend))(x))

    assert has_scan(32) and not has_scan(0)
