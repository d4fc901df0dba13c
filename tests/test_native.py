"""specjax.native: the CPU kernel for decode-sized matmuls against plain references.

Longer than our ~450-line rule on purpose: one file per module, and native/ is one kernel seen
from three sides (the float32 matmul, the q8 path, cached attention) whose tests share the
build check, the packed layouts and the random block-quantized weights made at the top.
"""

import dataclasses
import os
import re
import shutil
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import native
from specjax.backend import Backend
from specjax.models import Config, quant, random_model

NATIVE = Backend(matmul="native", kernels=native)  # what Engine(matmul="native") traces with
XLA = Backend()
NATIVE_MAX_ROWS = NATIVE.native_max_rows

if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
    pytest.skip("no C++ compiler: the native kernel cannot be built here", allow_module_level=True)


def block_weight(rng, K, N, bs, offset=True, codes_range=8):
    codes = rng.integers(-codes_range, codes_range, (K // bs, bs, N)).astype(np.int8)
    # float16-derived scales, as a GGUF holds them: code x scale is exact in float32
    scale = (rng.random((K // bs, 1, N)) * 0.02).astype(np.float16).astype(np.float32)
    off = (rng.standard_normal((K // bs, 1, N)) * 0.01).astype(np.float16).astype(np.float32) if offset else None
    return quant.BlockQuant(jnp.asarray(codes), jnp.asarray(scale), None if off is None else jnp.asarray(off), (K, N))


def reference(x, w):
    """float64 x @ w of the dequantized values."""
    wd = np.asarray(w.dequantize() if isinstance(w, quant.BlockQuant) else w, np.float64)
    return np.asarray(x, np.float64) @ wd


def bound(x, w):
    """A float32 summation error bound: K ulps of sum |x| |w| (elementwise)."""
    wd = np.abs(np.asarray(w.dequantize() if isinstance(w, quant.BlockQuant) else w, np.float64))
    return x.shape[1] * np.finfo(np.float32).eps * (np.abs(np.asarray(x, np.float64)) @ wd) + 1e-30


def test_the_kernel_builds_here():
    assert native.available()


@pytest.mark.heavy
def test_a_truncated_cached_library_is_rebuilt_with_one_warning(tmp_path):
    """A library cut short by a killed process used to kill every later run with a bus error
    (exit 135, no message); now it does not match the SHA-256 the build recorded, and the next
    load rebuilds it, with one warning. In subprocesses, each with this test's own cache."""
    import subprocess
    import sys

    env = {**os.environ, "SPECJAX_CACHE": str(tmp_path), "SPECJAX_NATIVE": "1"}
    code = ("import warnings, numpy as np, jax.numpy as jnp\n"
            "from specjax import native\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    ok = native.available()\n"
            "x = jnp.ones((2, 32), jnp.float32); w = jnp.eye(32, 64, dtype=jnp.float32)\n"
            "assert ok and np.allclose(np.asarray(native.dot(x, w)), np.asarray(x @ w))\n"
            "print('WARNINGS', sum('not the one built' in str(c.message) for c in caught))\n")

    def run():
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split("WARNINGS")[-1])

    assert run() == 0  # built fresh: no warning
    libraries = list((tmp_path / "native").glob("blockdot-*.so"))
    assert len(libraries) == 1 and (tmp_path / "native" / (libraries[0].name + ".sha256")).exists()
    library = libraries[0]
    size = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(size // 3)
    assert run() == 1  # not loaded: rebuilt, one warning
    assert library.stat().st_size == size
    assert run() == 0  # the rebuilt library is the one recorded


# awkward sizes: rows around the kernel's row groups (4 or 8), K not a multiple of the row chunk
# (64), a single tile of columns, block sizes of the K-quants (16) and the legacy types (32)
@pytest.mark.parametrize("M", [1, 3, 9, 17, 72])
@pytest.mark.parametrize("K, N, bs", [(32, 32, 32), (96, 96, 16), (576, 288, 32), (160, 64, 32)])
@pytest.mark.parametrize("offset", [True, False])
def test_block_codes_match_a_float64_reference(M, K, N, bs, offset):
    rng = np.random.default_rng(M * 1000 + K + N + bs + offset)
    w = block_weight(rng, K, N, bs, offset)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    y = np.asarray(jax.jit(native.dot)(x, w))
    assert y.shape == (M, N) and y.dtype == np.float32
    assert np.all(np.abs(y - reference(x, w)) <= bound(x, w))


@pytest.mark.parametrize("M, K, N", [(1, 64, 32), (7, 200, 96), (33, 576, 160)])
def test_float_weights_match_a_float64_reference(M, K, N):
    rng = np.random.default_rng(M + K + N)
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    y = np.asarray(jax.jit(native.dot)(x, w))
    assert np.all(np.abs(y - reference(x, w)) <= bound(x, w))


@pytest.mark.parametrize("M", [1, 9, 40])
def test_codes_and_their_dequantization_give_the_same_bits(M):
    """Why the kernel does not break the models' float32 / block-quantized parity."""
    rng = np.random.default_rng(M)
    w = block_weight(rng, 576, 192, 32)
    x = jnp.asarray(rng.standard_normal((M, 576)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(native.dot(x, w)), np.asarray(native.dot(x, w.dequantize())))


def test_a_row_does_not_depend_on_the_others():
    """The verify pass (K + 1 rows) and a one-token step compute a position the same way."""
    rng = np.random.default_rng(0)
    w = block_weight(rng, 576, 1536, 32)
    x = jnp.asarray(rng.standard_normal((13, 576)).astype(np.float32))
    full = np.asarray(native.dot(x, w))
    for i in (0, 5, 12):
        np.testing.assert_array_equal(full[i], np.asarray(native.dot(x[i:i + 1], w))[0])


def test_zeros_infinities_and_nans_propagate_as_in_xla():
    rng = np.random.default_rng(1)
    w = block_weight(rng, 64, 64, 32)
    x = np.zeros((4, 64), np.float32)
    x[1, 3] = -np.inf
    x[2, 5] = np.nan
    x[3] = rng.standard_normal(64)
    y = np.asarray(native.dot(jnp.asarray(x), w))
    want = np.asarray(jnp.asarray(x) @ w.dequantize())
    assert np.all(y[0] == 0.0)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    np.testing.assert_allclose(y[3], want[3], rtol=1e-5, atol=1e-6)


def test_vmap_runs_the_kernel_per_example():
    rng = np.random.default_rng(2)
    w = block_weight(rng, 64, 96, 32)
    xs = jnp.asarray(rng.standard_normal((3, 2, 64)).astype(np.float32))
    ys = jax.vmap(lambda x: native.dot(x, w))(xs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(native.dot(xs[i], w)))


def test_gradients_are_those_of_xla_dot():
    """A custom call has no derivative; dot's custom JVP gives XLA's, to x and to a float w;
    a block-coded weight is a constant (a tangent of its scales is refused by name)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    bq = block_weight(rng, 64, 96, 32)
    for fn, ref in ((lambda x, w: native.dot(x, w), lambda x, w: x @ w),
                    (lambda x, w: native.dot(x, bq), lambda x, w: x @ bq.dequantize())):
        got = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), (0, 1)))(x, w)
        want = jax.grad(lambda x, w: jnp.sum(jnp.sin(ref(x, w))), (0, 1))(x, w)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block-coded weight has no derivative"):
        jax.grad(lambda s: jnp.sum(native.dot(x, dataclasses.replace(bq, scale=s))))(bq.scale)


@pytest.mark.parametrize("x_dtype, N, rows", [(jnp.bfloat16, 64, 1), (jnp.float32, 48, 1),
                                              (jnp.float32, 64, NATIVE_MAX_ROWS + 1)])
def test_what_the_kernel_cannot_take_goes_to_xla_unchanged(x_dtype, N, rows):
    """bf16 activations, columns not a multiple of the tile, prefill-sized row counts: XLA's dot,
    bit for bit the einsum the model computed before the kernel existed."""
    rng = np.random.default_rng(N + rows)
    w = block_weight(rng, 64, N, 32)
    x = jnp.asarray(rng.standard_normal((1, rows, 64)), x_dtype)
    dtype = jnp.dtype(x_dtype)

    def run(on):
        backend = NATIVE if on else XLA
        return jax.jit(lambda x, w: quant.contract("btd,df->btf", x, w, 1, dtype, backend=backend))(x, w)

    plain = jax.jit(lambda x, w: jnp.einsum("btd,df->btf", x, w.dequantize(dtype)))(x, w)
    np.testing.assert_array_equal(np.asarray(run(True), np.float32), np.asarray(plain, np.float32))
    np.testing.assert_array_equal(np.asarray(run(False), np.float32), np.asarray(plain, np.float32))


def test_contract_reshapes_multi_dimensional_weights():
    """wq [D, H, Dh] and wo [H, Dh, D], as the decoder layer contracts them."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)).astype(np.float32))
    wq = jnp.asarray(rng.standard_normal((64, 4, 16)).astype(np.float32))
    q = jax.jit(lambda x, w: quant.contract("btd,dhk->bthk", x, w, 1, backend=NATIVE))(x, wq)
    wo = jnp.asarray(rng.standard_normal((4, 16, 32)).astype(np.float32))
    o = jax.jit(lambda a, w: quant.contract("bthk,hkd->btd", a, w, 2, backend=NATIVE))(q, wo)
    np.testing.assert_allclose(np.asarray(q), np.einsum("btd,dhk->bthk", x, wq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o), np.einsum("bthk,hkd->btd", q, wo), rtol=1e-5, atol=1e-4)


def test_bad_operands_are_named():
    rng = np.random.default_rng(4)
    w = block_weight(rng, 64, 64, 32)
    with pytest.raises(ValueError, match="x has 32 columns, the weight 64 rows"):
        native.dot(jnp.ones((1, 32), jnp.float32), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.dot(jnp.ones((1, 64), jnp.float32), jnp.ones((64, 40), jnp.float32))
    with pytest.raises(ValueError, match="float32 x"):
        native.dot(jnp.ones((1, 64), jnp.bfloat16), w)


# --- 4-bit codes two per byte ------------------------------------------------------

@pytest.mark.parametrize("lo, hi, signed", [(0, 16, False), (-8, 8, True)])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_nibbles_hold_the_codes_and_values(lo, hi, signed, lead):
    rng = np.random.default_rng(lo + 8 + len(lead))
    codes = rng.integers(lo, hi, (*lead, 4, 32, 64)).astype(np.int8)
    codes[..., 0, 0, :2] = [lo, hi - 1]  # both extremes present
    scale = jnp.asarray(rng.random((*lead, 4, 1, 64)).astype(np.float32))
    w = quant.BlockQuant(jnp.asarray(codes), scale, scale * 0.5, (128, 64))
    p = native.pack_nibbles(w)
    assert isinstance(p, native.PackedQuant) and p.signed == signed
    assert p.data.shape == (*lead, 2, 64, 32) and p.data.dtype == jnp.uint8
    assert p.nbytes < w.nbytes
    np.testing.assert_array_equal(np.asarray(p.unpacked().codes), codes)
    np.testing.assert_array_equal(np.asarray(p.dequantize()), np.asarray(w.dequantize()))


@pytest.mark.parametrize("codes, why", [([-9, 0], "below -8"), ([0, 16], "above 15"), ([-1, 9], "mixed signs")])
def test_codes_wider_than_4_bits_stay_unpacked(codes, why):
    c = np.zeros((1, 32, 32), np.int8)
    c[0, 0, :2] = codes
    w = quant.BlockQuant(jnp.asarray(c), jnp.ones((1, 1, 32)), None, (32, 32))
    assert native.pack_nibbles(w) is w, why
    odd = quant.BlockQuant(jnp.zeros((2, 3, 32), jnp.int8), jnp.ones((2, 1, 32)), None, (6, 32))
    assert native.pack_nibbles(odd) is odd  # blocks of an odd size cannot pair rows


@pytest.mark.parametrize("M", [1, 3, 9, 20])
@pytest.mark.parametrize("bs, offset, signed", [(32, True, False), (16, False, True), (32, False, True)])
def test_nibble_kernel_gives_the_int8_kernels_bits(M, bs, offset, signed):
    rng = np.random.default_rng(M + bs)
    lo, hi = (-8, 8) if signed else (0, 16)
    codes = rng.integers(lo, hi, (192 // bs, bs, 96)).astype(np.int8)
    scale = (rng.random((192 // bs, 1, 96)) * 0.02).astype(np.float16).astype(np.float32)
    off = (rng.standard_normal((192 // bs, 1, 96)) * 0.01).astype(np.float16).astype(np.float32)
    w = quant.BlockQuant(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(off) if offset else None, (192, 96))
    p = native.pack_nibbles(w)
    x = jnp.asarray(rng.standard_normal((M, 192)).astype(np.float32))
    y = np.asarray(jax.jit(native.dot)(x, p))
    np.testing.assert_array_equal(y, np.asarray(native.dot(x, w)))
    np.testing.assert_array_equal(y, np.asarray(native.dot(x, w.dequantize())))
    assert np.all(np.abs(y - reference(x, w)) <= bound(x, w))


@pytest.mark.parametrize("M", [9, 10, 11, 21, 128])
def test_packed_rows_do_not_depend_on_how_many_share_a_pass(M):
    """Up to 10 rows share one pass over a tile; above that the tile's values are expanded once
    into a buffer that every group of rows reads: a row's bits are those of a one-row product,
    at a group's edge as inside it, from nibbles as from their int8 codes."""
    rng = np.random.default_rng(M)
    w = block_weight(rng, 576, 1536, 32)
    p = native.pack_nibbles(w)
    x = jnp.asarray(rng.standard_normal((M, 576)).astype(np.float32))
    full = np.asarray(native.dot(x, p))
    np.testing.assert_array_equal(full, np.asarray(native.dot(x, w)))
    for i in sorted({0, 8, min(9, M - 1), min(10, M - 1), M - 1}):
        np.testing.assert_array_equal(full[i], np.asarray(native.dot(x[i:i + 1], p))[0])


# --- in the engine ---------------------------------------------------------------

# MLP width and heads x head_dim multiples of the kernel's tile, so that those matmuls run natively
SMALL = Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, rope_theta=500.0)
PROMPTS = [[5, 6, 7, 8, 9], [11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]]


def _q8_layers(model):
    """`model` with its MLP and attention output matrices as Q8_0 block codes."""
    import gguf

    layers = dict(model.params["layers"])
    for name in ("w_gate", "w_up", "w_down", "wq"):
        w = np.asarray(layers[name])
        rows = w.reshape(w.shape[0], w.shape[1], -1)  # [L, in, out]; GGUF blocks run along `in`
        blocks = [quant.extract_codes(gguf.quants.quantize(np.ascontiguousarray(rows[i].T),
                                                           gguf.GGMLQuantizationType.Q8_0),
                                      gguf.GGMLQuantizationType.Q8_0).as_linear(w.shape[1:])
                  for i in range(w.shape[0])]
        layers[name] = quant.stack_layers(blocks)
    return model.with_params({**model.params, "layers": layers})


@pytest.fixture(scope="module")
def small_q8():
    return _q8_layers(random_model(SMALL, seed=5))


@pytest.mark.parametrize("draft, method", [(None, "greedy"), ("pld", "fly"),
                                           pytest.param("model", "exact", marks=pytest.mark.heavy)])
def test_native_and_xla_matmuls_give_the_same_tokens(small_q8, draft, method):
    draft = random_model(dataclasses.replace(SMALL, num_layers=1), seed=3) if draft == "model" else draft
    # fixed K: adaptive engines would each weigh widths against their own measured costs
    settings = dict(draft=draft, method=method, k=3, max_new_tokens=8, eos_ids=(), adaptive=False)
    a = specjax.Engine(small_q8, **settings, matmul="native").generate(PROMPTS)
    b = specjax.Engine(small_q8, **settings, matmul="xla").generate(PROMPTS)
    assert a.tokens == b.tokens and a.stats == b.stats


def test_the_native_program_calls_the_kernel_and_the_xla_one_does_not(small_q8):
    from specjax.models import llama

    def hlo(on):
        cache = llama.init_cache(SMALL, 1, 32)
        step = jax.jit(lambda p, t, c: llama.forward_cached(SMALL, p, t, c, backend=NATIVE if on else XLA)[0])
        return step.lower(small_q8.params, jnp.ones((1, 1), jnp.int32), cache).as_text()

    assert "specjax_blockdot" in hlo(True) and "specjax_densedot" in hlo(True)
    assert "specjax_" not in hlo(False)


@pytest.mark.parametrize("matmul, native", [("native", True), ("q8", True), ("xla", False)])
def test_an_engine_with_native_matmuls_runs_the_native_attention_too(small_q4, matmul, native):
    engine = specjax.Engine(small_q4, matmul=matmul, max_new_tokens=4, eos_ids=())
    assert ("specjax_attention" in engine.lower([[5, 6, 7]]).as_text()) == native


def _quantize(w, qtype):
    """float [D, F] -> BlockQuant of GGUF type `qtype` (blocks along D)."""
    import gguf

    T = getattr(gguf.GGMLQuantizationType, qtype)
    return quant.extract_codes(gguf.quants.quantize(np.ascontiguousarray(np.asarray(w).T), T), T).as_linear(w.shape)


def test_the_engine_packs_codes_only_for_the_native_kernel(small_q8):
    """Native layers (stacked or unrolled) hold 4-bit codes two per byte and int8 codes tile by
    tile, and the head a tile-major copy of the table; the tokens stay those of XLA's program."""
    from specjax.models import llama

    base = random_model(SMALL, seed=5)
    w_up = np.asarray(base.params["layers"]["w_up"])  # [L, D, F]
    layers = {**small_q8.params["layers"], "w_up": quant.stack_layers([_quantize(w, "Q4_1") for w in w_up])}
    head = "lm_head" if "lm_head" in base.params else "embed"
    model = small_q8.with_params({**small_q8.params, "layers": layers, head: _quantize(base.params[head], "Q8_0")})
    native_engine = specjax.Engine(model, matmul="native", max_new_tokens=4, eos_ids=())
    unrolled_native = specjax.Engine(model, matmul="native", layers="unrolled", max_new_tokens=4, eos_ids=())
    xla_engine = specjax.Engine(model, matmul="xla", max_new_tokens=4, eos_ids=())
    stacked, layer = native_engine.params.target["layers"], unrolled_native.params.target["layer_1"]
    for w_up, w_gate in ((stacked["w_up"], stacked["w_gate"]), (layer["w_up"], layer["w_gate"])):
        assert isinstance(w_up, native.PackedQuant) and w_up.bits == 4
        assert isinstance(w_gate, native.PackedQuant) and w_gate.bits == 8  # Q8_0
    assert stacked["w_up"].data.shape == (SMALL.num_layers, *layer["w_up"].data.shape)
    for engine in (native_engine, unrolled_native):
        head = engine.params.target["head_tiles"]
        assert isinstance(head, native.PackedQuant) and head.bits == 8
        assert head.shape == (SMALL.hidden_size, SMALL.vocab_size)
    assert "head_tiles" not in xla_engine.params.target
    assert all(isinstance(v, quant.BlockQuant) for v in xla_engine.params.target["layers"].values()
               if quant.is_quantized(v))
    stacked_native = unrolled_native  # both native layouts must give XLA's tokens
    expected = xla_engine.generate(PROMPTS).tokens
    assert native_engine.generate(PROMPTS).tokens == expected == stacked_native.generate(PROMPTS).tokens
    # a prefill-sized forward (XLA's dot) reads the packed weights too: the same values
    tokens = jnp.asarray(np.arange(NATIVE_MAX_ROWS + 2)[None] % SMALL.vocab_size)
    np.testing.assert_allclose(np.asarray(llama.forward(SMALL, native_engine.params.target, tokens, backend=XLA)),
                               np.asarray(llama.forward(SMALL, model.params, tokens, backend=XLA)), rtol=1e-5, atol=1e-5)


def test_tile_major_int8_codes_give_the_row_major_bits():
    rng = np.random.default_rng(6)
    w = block_weight(rng, 96, 64, 32, codes_range=100)
    t = native.tile_codes(w)
    assert isinstance(t, native.PackedQuant) and t.bits == 8 and t.data.shape == (2, 96, 32)
    np.testing.assert_array_equal(np.asarray(t.unpacked().codes), np.asarray(w.codes))
    assert isinstance(native.pack_for_native(w), native.PackedQuant) and native.pack_for_native(w).bits == 8
    for M in (1, 5, 12):
        x = jnp.asarray(rng.standard_normal((M, 96)).astype(np.float32))
        np.testing.assert_array_equal(np.asarray(native.dot(x, t)), np.asarray(native.dot(x, w)))


def test_a_packed_stack_is_read_in_place(small_q8):
    """The scan over packed layers passes the whole stack and a layer index to the kernel: no
    per-step slice of the codes is copied (the copy cost more than the 4-bit codes saved)."""
    from specjax.native import pack_params as _pack
    from specjax.models import llama

    w_up = np.asarray(random_model(SMALL, seed=5).params["layers"]["w_up"])
    params = {**small_q8.params, "layers": {**small_q8.params["layers"],
                                            "w_up": quant.stack_layers([_quantize(w, "Q4_1") for w in w_up])}}
    packed = _pack(params, jnp.float32)
    cache = llama.init_cache(SMALL, 1, 32)
    step = jax.jit(lambda p, t, c: llama.forward_cached(SMALL, p, t, c, backend=NATIVE)[0])
    hlo = step.lower(packed, jnp.ones((1, 1), jnp.int32), cache).compile().as_text()
    got = step(packed, jnp.ones((1, 1), jnp.int32), cache)
    assert "specjax_tiledot" in hlo
    one_layer = r"u8\[(1,)*" + ",".join(map(str, packed["layers"]["w_up"].data.shape[1:])) + r"\]"
    assert re.search(r"u8\[" + ",".join(map(str, packed["layers"]["w_up"].data.shape)) + r"\]", hlo)
    assert not re.search(one_layer, hlo)  # no one-layer slice of the nibbles is ever made
    want = jax.jit(lambda p, t, c: llama.forward_cached(SMALL, p, t, c, backend=XLA)[0])(
        params, jnp.ones((1, 1), jnp.int32), cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_matmul_setting_is_checked(small_q8):
    with pytest.raises(ValueError, match="matmul must be 'auto', 'native', 'q8' or 'xla'"):
        specjax.Engine(small_q8, matmul="fast")
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="matmul='native' runs on one device"):
        specjax.Engine(small_q8, matmul="native", mesh=mesh)


# --- the int8-activation path (Engine(matmul="q8")): llama.cpp's numerics ---


def _q8_unpacked(q, dtype):
    """The kernel's operands: codes [K, N] (int64), scale and offset [K / bs, N] in dtype, bs, xb."""
    w = q.unpacked()
    codes = np.asarray(w.codes, np.int64)
    nb, bs, N = codes.shape
    scale = np.asarray(w.scale, dtype)[:, 0]
    offset = None if w.offset is None else np.asarray(w.offset, dtype)[:, 0]
    return codes.reshape(nb * bs, N), scale, offset, bs, min(bs, 32)


def _q8_activations(xr):
    """One block of activations as the kernel quantizes it: float32 scale amax / 127, codes rounded
    half to even; (scale, int64 codes)."""
    xr = np.asarray(xr, np.float32)
    dx = np.float32(np.abs(xr).max()) / np.float32(127)
    inv = np.float32(1) / dx if dx > 0 else np.float32(0)
    return dx, np.clip(np.rint(xr * inv), -127, 127).astype(np.int64)


def q8_reference(x, q):
    """float64 of what the q8 kernel computes: each row's blocks of min(bs, 32) activations
    quantized as the kernel does, exact integer dot products with the codes, then scale and offset."""
    codes, scale, offset, bs, xb = _q8_unpacked(q, np.float64)
    y = np.zeros((x.shape[0], codes.shape[1]))
    for m in range(x.shape[0]):
        for k0 in range(0, codes.shape[0], xb):
            dx, xq = _q8_activations(x[m, k0:k0 + xb])
            b = k0 // bs
            v = scale[b] * (xq @ codes[k0:k0 + xb]) + (0 if offset is None else offset[b] * xq.sum())
            y[m] += np.float64(dx) * v
    return y


def q8_weight(rng, K, N, bs, kind, offset):
    lo, hi = {"u4": (0, 16), "s4": (-8, 8), "i8": (-128, 128), "q6": (-32, 32)}[kind]
    codes = rng.integers(lo, hi, (K // bs, bs, N)).astype(np.int8)
    scale = (rng.random((K // bs, 1, N)) * 0.02).astype(np.float16).astype(np.float32)
    off = (rng.standard_normal((K // bs, 1, N)) * 0.01).astype(np.float32) if offset else None
    return quant.BlockQuant(jnp.asarray(codes), jnp.asarray(scale), None if off is None else jnp.asarray(off), (K, N))


@pytest.mark.parametrize("kind, bits, zero", [("u4", 4, 0), ("s4", 4, 8), ("i8", 8, 128), ("q6", 8, 128)])
@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("bs", [16, 32])
def test_q8_tiles_hold_the_codes(kind, bits, zero, lead, bs):
    rng = np.random.default_rng(bs + bits + len(lead))
    w = q8_weight(rng, 64, 48, bs, kind, offset=True)
    if lead:
        w = quant.stack_layers([w, q8_weight(rng, 64, 48, bs, kind, True), q8_weight(rng, 64, 48, bs, kind, True)])
    q = native.pack_for_q8(w)
    assert isinstance(q, native.Q8Tiles) and (q.bits, q.zero) == (bits, zero)
    assert q.data.dtype == jnp.uint8 and q.data.shape == (*lead, 3, 64 // (8 if bits == 4 else 4), 64)
    np.testing.assert_array_equal(np.asarray(q.unpacked().codes), np.asarray(w.codes))
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(w.dequantize()))
    # the documented byte order, checked on tile 1, group 2 directly against the codes
    c = np.asarray(w.codes, np.int32).reshape(*lead, 64, 48)[(0,) * len(lead)] + zero  # [K, N]
    byte = np.asarray(q.data)[(0,) * len(lead)][1, 2].reshape(16, 4)  # [n, i]
    if bits == 4:
        np.testing.assert_array_equal(byte & 15, c[16:20, 16:32].T)
        np.testing.assert_array_equal(byte >> 4, c[20:24, 16:32].T)
    else:
        np.testing.assert_array_equal(byte, c[8:12, 16:32].T)


@pytest.mark.parametrize("shape, why", [((64, 40), "columns"), ((36, 32), "block")])
def test_weights_the_q8_kernel_cannot_take_stay_as_they_are(shape, why):
    rng = np.random.default_rng(1)
    K, N = shape
    bs = 12 if why == "block" else 32
    w = q8_weight(rng, K, N, bs, "u4", True)
    assert native.pack_for_q8(w) is w


# awkward sizes: 1 row, a verify pass (9), more than one pass of rows (13, 25, 72), K not a multiple
# of the 64-row chunk, one tile of columns, block sizes 16 (K-quants) and 32, 4- and 8-bit codes
@pytest.mark.parametrize("M", [1, 3, 9, 13, 25, 72])
@pytest.mark.parametrize("K, N, bs, kind, offset", [(32, 16, 32, "u4", True), (96, 80, 16, "q6", True),
                                                    (160, 64, 32, "s4", False), (576, 96, 32, "i8", False),
                                                    (64, 32, 16, "u4", False)])
def test_q8_kernel_matches_its_float64_reference(M, K, N, bs, kind, offset):
    rng = np.random.default_rng(M * 100 + K + N)
    q = native.pack_for_q8(q8_weight(rng, K, N, bs, kind, offset))
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, : min(K, 40)] *= 30  # blocks of very different scales in one row
    y = np.asarray(jax.jit(native.dot)(jnp.asarray(x), q))
    want = q8_reference(x, q)
    assert y.shape == (M, N) and y.dtype == np.float32
    # the integer sums are exact; only the float32 scaling of each block's sums rounds
    tol = 4 * (K // min(bs, 32)) * np.finfo(np.float32).eps * (np.abs(x).max(1, keepdims=True) * 0.02 * 128 * 32)
    assert np.all(np.abs(y - want) <= tol)
    # and it is close to the float32 model: int8 activations cost about 0.5% of a product's size
    f = x.astype(np.float64) @ np.asarray(q.dequantize(), np.float64)
    assert np.abs(y - f).max() <= 0.03 * np.abs(f).max()


def _round_f32(v: Fraction) -> np.float32:
    """The float32 nearest to an exact value, ties to even (through float64 only where that is exact:
    a float64 that lands on a float32 midpoint is settled against the exact value)."""
    d = np.float64(float(v))  # correctly rounded
    f = np.float32(d)
    other = np.nextafter(f, np.float32(np.inf if Fraction(float(f)) < Fraction(float(d)) else -np.inf))
    mid = (Fraction(float(f)) + Fraction(float(other))) / 2
    if Fraction(float(d)) == mid and v != mid:  # double rounding: take the side the exact value is on
        return f if abs(v - Fraction(float(f))) < abs(v - Fraction(float(other))) else other
    return f


def _fma32(a, b, c) -> np.float32:
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def q8_float32_steps(x, q):
    """The q8 kernel's own float32 steps, emulated exactly: per block of xb activations, its integer
    sum I (exact), v = f32(I) * scale, v = fma(offset, X, v), acc = fma(v, dx, acc)."""
    codes, scale, offset, bs, xb = _q8_unpacked(q, np.float32)
    y = np.zeros((x.shape[0], codes.shape[1]), np.float32)
    for m in range(x.shape[0]):
        for n in range(codes.shape[1]):
            acc = np.float32(0)
            for k0 in range(0, codes.shape[0], xb):
                dx, xq = _q8_activations(x[m, k0:k0 + xb])
                b = k0 // bs
                v = np.float32(np.float32(int(xq @ codes[k0:k0 + xb, n])) * scale[b, n])
                if offset is not None:
                    v = _fma32(offset[b, n], np.float32(int(xq.sum())), v)
                acc = _fma32(v, dx, acc)
            y[m, n] = acc
    return y


@pytest.mark.parametrize("M, K, N, bs, kind, offset", [(1, 64, 32, 32, "u4", True), (9, 96, 16, 16, "q6", True),
                                                       (13, 64, 32, 32, "i8", False), (3, 64, 16, 32, "s4", False),
                                                       (10, 32, 16, 32, "i8", True)])
def test_q8_kernel_gives_the_bits_of_its_float32_steps(M, K, N, bs, kind, offset):
    """Bit for bit on every CPU (AVX-512 VNNI, AVX2, portable): the integer sums are exact and every
    path takes the same float32 steps, so a run resumed on another machine decodes the same tokens."""
    rng = np.random.default_rng(M * 7 + K + N)
    q = native.pack_for_q8(q8_weight(rng, K, N, bs, kind, offset))
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[0, :16] *= 30
    np.testing.assert_array_equal(np.asarray(native.dot(jnp.asarray(x), q)), q8_float32_steps(x, q))


def test_q8_rows_do_not_depend_on_the_others():
    """Bit for bit, whatever rows share the call and however they are split into passes, so a
    verify pass and a decode step compute a position alike (exact speculation = target-only)."""
    rng = np.random.default_rng(2)
    q = native.pack_for_q8(q8_weight(rng, 192, 64, 32, "u4", True))
    x = jnp.asarray(rng.standard_normal((23, 192)).astype(np.float32))
    full = np.asarray(native.dot(x, q))
    for i in (0, 9, 22):
        np.testing.assert_array_equal(np.asarray(native.dot(x[i:i + 1], q))[0], full[i])
    np.testing.assert_array_equal(np.asarray(native.dot(x[5:14], q)), full[5:14])


def test_q8_zeros_and_non_finite_rows():
    rng = np.random.default_rng(3)
    q = native.pack_for_q8(q8_weight(rng, 64, 32, 32, "i8", False))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[1] = 0
    x[2, 5], x[3, 40] = np.inf, np.nan
    y = np.asarray(native.dot(jnp.asarray(x), q))
    assert np.all(y[1] == 0)
    assert not np.any(np.isfinite(y[2])) and not np.any(np.isfinite(y[3]))  # as a float dot would give
    np.testing.assert_array_equal(y[0], np.asarray(native.dot(jnp.asarray(x[:1]), q))[0])


def test_q8_stack_is_read_in_place_by_layer():
    rng = np.random.default_rng(4)
    ws = [q8_weight(rng, 96, 32, 32, "u4", True) for _ in range(3)]
    stack = native.pack_for_q8(quant.stack_layers(ws))
    x = jnp.asarray(rng.standard_normal((9, 96)).astype(np.float32))
    f = jax.jit(lambda x, s, i: native.dot(x, s, i))
    for i, w in enumerate(ws):
        np.testing.assert_array_equal(np.asarray(f(x, stack, jnp.int32(i))), np.asarray(native.dot(x, native.pack_for_q8(w))))


@pytest.fixture(scope="module")
def small_q4():
    """SMALL with Q4_1 MLP matrices, Q8_0 attention output and head (SmolLM2's GGUF mix)."""
    base = random_model(SMALL, seed=5)
    model = _q8_layers(base)
    layers = dict(model.params["layers"])
    for name in ("w_gate", "w_up", "w_down"):
        layers[name] = quant.stack_layers([_quantize(w, "Q4_1") for w in np.asarray(base.params["layers"][name])])
    head = "lm_head" if "lm_head" in base.params else "embed"
    return model.with_params({**model.params, "layers": layers, head: _quantize(base.params[head], "Q8_0")})


def test_the_q8_engine_packs_for_the_int8_path_and_stays_close_to_float(small_q4):
    from specjax.native import pack_params as _pack
    from specjax.models import llama

    engine = specjax.Engine(small_q4, matmul="q8", max_new_tokens=4, eos_ids=())
    layers = engine.params.target["layers"]
    assert isinstance(layers["w_up"], native.Q8Tiles) and layers["w_up"].bits == 4  # Q4_1
    assert isinstance(layers["wq"], native.Q8Tiles) and layers["wq"].bits == 8  # Q8_0
    assert isinstance(engine.params.target["head_tiles"], native.Q8Tiles)
    cache = llama.init_cache(SMALL, 2, 32)
    tokens = jnp.asarray([[5, 6, 7], [1, 2, 3]], jnp.int32)
    step = jax.jit(lambda p, t, c: llama.forward_cached(SMALL, p, t, c, backend=NATIVE)[0])
    q8 = np.asarray(step(engine.params.target, tokens, cache))
    hlo = step.lower(engine.params.target, tokens, cache).as_text()
    exact = np.asarray(step(_pack(small_q4.params, jnp.float32), tokens, cache))
    assert "specjax_q8dot" in hlo
    assert np.abs(q8 - exact).max() <= 0.05 * np.abs(exact).max()
    # a prefill-sized forward goes through the same kernel (no float path with other numerics)
    long = jnp.asarray(np.arange(NATIVE_MAX_ROWS + 2)[None] % SMALL.vocab_size)
    text = jax.jit(lambda p, t: llama.forward(SMALL, p, t, backend=NATIVE)).lower(engine.params.target, long).as_text()
    assert "specjax_q8dot" in text


def test_engines_of_one_model_share_its_packed_weights_until_the_model_goes(small_q4):
    """An audit or benchmark builds one engine per method: each must not hold its own packed copy
    of the model (13 methods of a 1.5B + 0.5B pair ran out of memory); the copy goes with the model."""
    import gc

    from specjax.native import _pack as engine_module  # the packing cache lives with the kernel

    before = len(engine_module._PACKED)
    model = small_q4.with_params(jax.tree.map(lambda x: x, small_q4.params))  # its own weight objects
    draft = random_model(dataclasses.replace(SMALL, num_layers=1), seed=3)
    a = specjax.Engine(model, matmul="q8", max_new_tokens=4, eos_ids=())
    b = specjax.Engine(model, draft=draft, method="fly", k=2, matmul="q8", max_new_tokens=4, eos_ids=())
    native_engine = specjax.Engine(model, matmul="native", max_new_tokens=4, eos_ids=())
    for name in ("w_up", "wq"):
        assert a.params.target["layers"][name] is b.params.target["layers"][name]
        assert isinstance(native_engine.params.target["layers"][name], native.PackedQuant)  # not q8's tiles
    assert a.params.target["head_tiles"] is b.params.target["head_tiles"]
    assert len(engine_module._PACKED) > before
    expected = a.generate(PROMPTS).tokens
    del a, b, native_engine, model
    gc.collect()
    assert len(engine_module._PACKED) == before
    # packed again from the same weights, the tokens are the same
    assert specjax.Engine(small_q4, matmul="q8", max_new_tokens=4, eos_ids=()).generate(PROMPTS).tokens == expected


@pytest.mark.parametrize("draft, method", [("pld", "exact"), ("model", "exact"), ("pld", "fly")])
def test_q8_speculation_runs_and_exact_keeps_only_target_tokens(small_q4, draft, method):
    """Exact speculation on the q8 path accepts no loose token and, on this small model, gives q8
    target-only's tokens (not guaranteed in general: see Engine's matmul="q8"); runs repeat."""
    draft = random_model(dataclasses.replace(SMALL, num_layers=1), seed=3) if draft == "model" else draft
    settings = dict(k=3, max_new_tokens=10, eos_ids=(), matmul="q8")
    base = specjax.Engine(small_q4, **settings).generate(PROMPTS)
    spec = specjax.Engine(small_q4, draft=draft, method=method, **settings).generate(PROMPTS)
    assert all(len(t) == 10 for t in spec.tokens)
    if method == "exact":
        assert spec.stats["loose_share"] == 0 and spec.tokens == base.tokens
    assert specjax.Engine(small_q4, draft=draft, method=method, **settings).generate(PROMPTS).tokens == spec.tokens


def test_q8_setting_is_checked(small_q4):
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="matmul='q8' runs on one device"):
        specjax.Engine(small_q4, matmul="q8", mesh=mesh)
    with pytest.raises(ValueError, match="matmul='q8' runs float32 models"):
        specjax.Engine(random_model(SMALL, seed=1, dtype=jnp.bfloat16), matmul="q8")


# --- the native attention of the q8 path ---


def attention_reference(q, k, v, layer, positions):
    """float64 softmax attention of each query over the keys at positions <= its own."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, Dh = q.shape
    G = k.shape[3]
    out = np.zeros((B, T, H, Dh))
    for b in range(B):
        for t in range(T):
            n = min(int(positions[b, t]) + 1, k.shape[2])
            for h in range(H):
                g = h // (H // G)
                s = k[layer, b, :n, g] @ q[b, t, h] / np.sqrt(Dh)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[layer, b, :n, g]
    return out


@pytest.mark.parametrize("B, T, H, G, S, Dh", [(1, 1, 9, 3, 64, 64), (3, 5, 4, 4, 40, 16), (2, 9, 14, 2, 33, 64),
                                               (1, 3, 2, 1, 17, 12)])
def test_native_attention_matches_a_float64_reference(B, T, H, G, S, Dh):
    rng = np.random.default_rng(B * 100 + T + S)
    L = 3
    q = rng.standard_normal((B, T, H, Dh)).astype(np.float32) * 2
    k = rng.standard_normal((L, B, S, G, Dh)).astype(np.float32)
    v = rng.standard_normal((L, B, S, G, Dh)).astype(np.float32)
    k[1, 0, 0] = 8.0  # one dominant key: a large spread of scores
    positions = np.stack([rng.integers(0, S + 3, T) for _ in range(B)]).astype(np.int32)  # ragged, some past S
    positions[0, 0] = 0  # a query that sees one key
    f = jax.jit(native.attention)
    for layer in (0, 1):
        got = np.asarray(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(layer), jnp.asarray(positions)))
        np.testing.assert_allclose(got, attention_reference(q, k, v, layer, positions), rtol=2e-5, atol=2e-5)


def _exp32(x):
    """attention.cc's exponential, its float32 steps (the vector and the scalar form agree)."""
    f = np.float32
    x = max(f(x), f(-87.3))
    n = f(np.rint(f(x * f(1.44269504088896341))))
    r = _fma32(-n, f(0.693359375), x)
    r = _fma32(-n, f(-2.12194440e-4), r)
    p = f(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = _fma32(p, r, f(c))
    p = _fma32(p, f(r * r), f(r + f(1)))
    return f(np.ldexp(p, int(n)))


def _dot32(a, b):
    """A query-key dot as the kernel sums it: for Dh % 16 == 0 in 16 lanes, each a multiply-add
    chain, reduced in AVX-512's tree (halves, quarters, pairs); else one chain in order."""
    if len(a) % 16:
        d = np.float32(0)
        for x, y in zip(a, b):
            d = _fma32(x, y, d)
        return d
    lanes = [np.float32(0)] * 16
    for i in range(0, len(a), 16):
        lanes = [_fma32(a[i + j], b[i + j], lanes[j]) for j in range(16)]
    h8 = [np.float32(lanes[j] + lanes[j + 8]) for j in range(8)]
    h4 = [np.float32(h8[j] + h8[j + 4]) for j in range(4)]
    h2 = [np.float32(h4[j] + h4[j + 2]) for j in range(2)]
    return np.float32(h2[0] + h2[1])


def attention_float32_steps(q, k, v, layer, positions):
    """native.attention's float32 steps, emulated exactly (fused multiply-adds rounded once)."""
    B, T, H, Dh = q.shape
    G = k.shape[3]
    scale = np.float32(1) / np.float32(np.sqrt(np.float32(Dh)))
    out = np.zeros(q.shape, np.float32)
    for b in range(B):
        for t in range(T):
            n = min(int(positions[b, t]) + 1, k.shape[2])
            for h in range(H):
                g = h // (H // G)
                sc = [np.float32(_dot32(q[b, t, h], k[layer, b, j, g]) * scale) for j in range(n)]
                m = max(sc)
                e = [_exp32(np.float32(x - m)) for x in sc]
                total = np.float32(0)
                for x in e:
                    total = np.float32(total + x)
                inv = np.float32(1) / total
                for i in range(Dh):
                    o = np.float32(0)
                    for j in range(n):
                        o = _fma32(e[j], v[layer, b, j, g, i], o)
                    out[b, t, h, i] = np.float32(o * inv)
    return out


@pytest.mark.parametrize("Dh", [32, 12])
def test_native_attention_gives_the_bits_of_its_float32_steps(Dh):
    """Bit for bit on every CPU: the AVX2 build sums a query-key dot in AVX-512's lanes and tree, so
    a run resumed on another machine decodes the same tokens."""
    rng = np.random.default_rng(Dh)
    q = (rng.standard_normal((1, 2, 2, Dh)) * 2).astype(np.float32)
    k = rng.standard_normal((1, 1, 21, 1, Dh)).astype(np.float32)
    v = rng.standard_normal((1, 1, 21, 1, Dh)).astype(np.float32)
    positions = np.asarray([[19, 20]], np.int32)  # 20 keys: a vector of 16 exponentials and a tail
    got = np.asarray(native.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0, jnp.asarray(positions)))
    np.testing.assert_array_equal(got, attention_float32_steps(q, k, v, 0, positions))


def test_native_attention_depends_on_a_query_position_only():
    """Bit for bit the same output for a query whatever T, the cache length and the other rows:
    what makes the q8 path's verify pass and decode step agree."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 6, 4, 16)).astype(np.float32))
    k = rng.standard_normal((2, 2, 48, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 48, 2, 16)).astype(np.float32)
    pos = jnp.asarray([[10, 11, 12, 13, 14, 15], [3, 4, 5, 6, 7, 8]], jnp.int32)
    full = np.asarray(native.attention(q, jnp.asarray(k), jnp.asarray(v), 1, pos))
    one = np.asarray(native.attention(q[1:, 2:3], jnp.asarray(k[:, 1:]), jnp.asarray(v[:, 1:]), 1, pos[1:, 2:3]))
    np.testing.assert_array_equal(one[0, 0], full[1, 2])
    longer = [np.concatenate([a, rng.standard_normal((2, 2, 16, 2, 16)).astype(np.float32)], axis=2) for a in (k, v)]
    np.testing.assert_array_equal(np.asarray(native.attention(q, jnp.asarray(longer[0]), jnp.asarray(longer[1]), 1, pos)), full)


@pytest.mark.parametrize("B, T, H, G, S, Dh", [(1, 1, 9, 3, 64, 64), (3, 5, 4, 4, 40, 16), (2, 9, 14, 2, 33, 64),
                                               (1, 3, 2, 1, 17, 12)])
def test_deferred_native_attention_is_the_in_place_write_bit_for_bit(B, T, H, G, S, Dh):
    """New keys given apart (a verify inside a branch, the cache only read) give exactly the output
    of writing them into the cache first, also where a row's positions run past the cache (those
    writes are dropped), at position 0, and with -inf-like and tied scores."""
    rng = np.random.default_rng(B * 10 + T + S)
    L = 2
    q = rng.standard_normal((B, T, H, Dh)).astype(np.float32) * 3
    k = rng.standard_normal((L, B, S, G, Dh)).astype(np.float32)
    v = rng.standard_normal((L, B, S, G, Dh)).astype(np.float32)
    nk = rng.standard_normal((B, T, G, Dh)).astype(np.float32)
    nv = rng.standard_normal((B, T, G, Dh)).astype(np.float32)
    nk[0, 0] = 0.0  # ties: one new key scores 0 against every query
    k[1, 0, :2] = -1e30  # scores far below the rest: their weights underflow to 0
    first = rng.integers(0, S, B)
    first[0] = 0
    first[-1] = S - T // 2 - 1  # its last writes fall past the cache
    positions = (first[:, None] + np.arange(T)[None]).astype(np.int32)
    written_k, written_v = k.copy(), v.copy()
    for b in range(B):
        for t in range(T):
            if positions[b, t] < S:
                written_k[1, b, positions[b, t]], written_v[1, b, positions[b, t]] = nk[b, t], nv[b, t]
    f = jax.jit(native.attention)
    want = np.asarray(f(*map(jnp.asarray, (q, written_k, written_v)), jnp.int32(1), jnp.asarray(positions)))
    got = np.asarray(f(*map(jnp.asarray, (q, k, v)), jnp.int32(1), jnp.asarray(positions),
                       (jnp.asarray(nk), jnp.asarray(nv))))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()


def test_deferred_native_attention_refuses_scattered_positions():
    q = jnp.zeros((1, 2, 2, 8), jnp.float32)
    k = jnp.zeros((1, 1, 8, 1, 8), jnp.float32)
    new = (jnp.zeros((1, 2, 1, 8), jnp.float32),) * 2
    with pytest.raises(Exception, match="consecutive"):
        jax.block_until_ready(native.attention(q, k, k, 0, jnp.asarray([[3, 5]], jnp.int32), new))
    with pytest.raises(ValueError, match=r"new keys and values must be float32\[1, 2, 1, 8\]"):
        native.attention(q, k, k, 0, jnp.asarray([[3, 4]], jnp.int32), (jnp.zeros((1, 2, 2, 8), jnp.float32),) * 2)


def test_native_attention_refuses_what_it_cannot_take():
    q = jnp.zeros((1, 1, 3, 8), jnp.float32)
    with pytest.raises(ValueError, match="H a multiple of G"):
        native.attention(q, jnp.zeros((1, 1, 4, 2, 8)), jnp.zeros((1, 1, 4, 2, 8)), 0, jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="float32"):
        native.attention(q.astype(jnp.bfloat16), jnp.zeros((1, 1, 4, 3, 8)), jnp.zeros((1, 1, 4, 3, 8)), 0,
                         jnp.zeros((1, 1), jnp.int32))


def test_q8_forward_uses_the_native_attention_and_stays_close(small_q4):
    from specjax.models import llama

    engine = specjax.Engine(small_q4, matmul="q8", max_new_tokens=4, eos_ids=())
    cache = llama.init_cache(SMALL, 2, 32)
    prefix = jnp.asarray([[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]], jnp.int32)

    def run(attention):
        backend = NATIVE.replace(native_attention=attention)

        def fwd(p, t, cache):
            logits, cache = llama.forward_cached(SMALL, p, t, cache, backend=backend)
            cache = cache._replace(lengths=jnp.asarray([6, 4], jnp.int32))
            return llama.forward_cached(SMALL, p, t[:, :3], cache, backend=backend)[0]
        f = jax.jit(fwd)
        return np.asarray(f(engine.params.target, prefix, cache)), f.lower(engine.params.target, prefix, cache).as_text()

    on, text_on = run(True)
    off, text_off = run(False)
    assert "specjax_attention" in text_on and "specjax_attention" not in text_off
    np.testing.assert_allclose(on, off, rtol=1e-4, atol=1e-4)


def test_q8_forward_gives_a_position_the_same_logits_at_any_width():
    """On the q8 path every op of a position is per row (int8 rows, native attention, the norm's
    fixed-order sum), so a token scored in a K = 8 or 16 verify pass gets the bits it gets when
    decoded alone: what makes exact speculation equal q8 target-only decoding."""
    from specjax.native import pack_params as _pack
    from specjax.models import llama

    config = dataclasses.replace(SMALL, hidden_size=576, intermediate_size=128, num_heads=9, num_kv_heads=3,
                                 head_dim=64)  # SmolLM2's width, where XLA's own row sum changes at T = 9
    params = _pack(_q8_layers(random_model(config, seed=2)).params, jnp.float32, True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 30)), jnp.int32)

    def score(width):
        backend = NATIVE.replace(native_attention=True)

        def fwd(p, t, cache):
            _, cache = llama.forward_cached(config, p, t[:, :12], cache, backend=backend)
            cache = cache._replace(lengths=jnp.asarray([12, 12], jnp.int32))
            return llama.forward_cached(config, p, t[:, 12:12 + width], cache, backend=backend)[0]
        return np.asarray(jax.jit(fwd)(params, tokens, llama.init_cache(config, 2, 48)))

    one = score(1)
    for width in (5, 9, 17):
        np.testing.assert_array_equal(score(width)[:, :1], one)
