"""Gate statistics: the jnp references vs NumPy, Pallas kernels (interpret mode) vs the plain reference.

The plain reference is verify's (`verify._common.gate_stats_reference`, what the rules run on CPU);
`pallas.gate_stats_reference` is the kernels' own algebra in jnp (partials, then `finalize`); both
are checked against the NumPy oracle."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specjax.backend import Backend
from specjax import pallas as sp
from specjax.pallas import _dispatch, _gate_kernel
from specjax.verify import _common

VARIANTS = ("mosaic", "triton")
NEG = -np.inf


def numpy_stats(x, tok):
    """Float64 NumPy oracle of docs/rules.md's entropy definitions."""
    x = np.asarray(x, np.float64)
    V = x.shape[-1]
    m = x.max(-1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(-1))
    p = np.exp(x - lse[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    H = -plogp.sum(-1)
    norm = np.zeros_like(H) if V == 1 else np.clip(H / math.log(V), 0, 1)
    top = -np.sort(-p, axis=-1)[:, :min(3, V)]  # sorted top-k: ties keep multiplicity
    with np.errstate(divide="ignore", invalid="ignore"):
        h3 = np.maximum(-np.where(top > 0, top * np.log(top), 0.0).sum(-1), 0.0)
    tok = np.asarray(tok)
    ok = (tok >= 0) & (tok < V)
    tl = np.where(ok, x[np.arange(len(x)), np.clip(tok, 0, V - 1)], np.nan)
    return dict(max_logit=m, argmax=x.argmax(-1), lse=lse, entropy=H, entropy_normalized=norm,
                entropy_top3=h3, token_logit=tl)


def plain(x, tok=None):
    """The plain reference of the statistics (verify's), as pallas.GateStats (same fields, in order)."""
    return sp.GateStats(*_common.gate_stats_reference(x, tok))


REFERENCES = {"plain": plain, "kernel_algebra": lambda x, tok=None: sp.gate_stats_reference(x, tok)}


def assert_stats_close(a, b, rtol=1e-5, atol=1e-6, msg=""):
    for f in sp.GateStats._fields:
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
        if f == "argmax":
            np.testing.assert_array_equal(x, y, err_msg=f"{msg} {f}")
        else:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{msg} {f}")


def random_logits(rng, N, V, kind="normal"):
    if kind == "normal":
        return rng.normal(size=(N, V)).astype(np.float32) * 4
    if kind == "ties":  # small integer range: many exact ties, among the top 3 too
        return rng.integers(-2, 2, size=(N, V)).astype(np.float32)
    if kind == "one_finite":  # rows of -inf with one finite entry, at the edges too
        x = np.full((N, V), NEG, np.float32)
        cols = rng.integers(0, V, size=N)
        cols[0], cols[-1] = 0, V - 1
        x[np.arange(N), cols] = rng.normal(size=N) * 4
        return x
    if kind == "some_neg_inf":
        x = rng.normal(size=(N, V)).astype(np.float32) * 4
        x[rng.random((N, V)) < 0.5] = NEG
        x[np.arange(N), rng.integers(0, V, size=N)] = 1.0
        return x
    if kind == "peaked":  # near one-hot rows: entropy ~ 0, rescaling across blocks
        x = rng.normal(size=(N, V)).astype(np.float32)
        x[np.arange(N), rng.integers(0, V, size=N)] = 60.0
        return x
    raise ValueError(kind)


# ------------------------------------------------------------------ reference vs NumPy

@pytest.mark.parametrize("ref", REFERENCES)
@pytest.mark.parametrize("V", [1, 2, 3, 4, 17, 300])
@pytest.mark.parametrize("kind", ["normal", "ties", "one_finite", "some_neg_inf", "peaked"])
def test_reference_matches_numpy(V, kind, ref):
    rng = np.random.default_rng(V)
    x = random_logits(rng, 12, V, kind)
    tok = rng.integers(-1, V + 1, size=12).astype(np.int32)
    got = REFERENCES[ref](jnp.asarray(x), jnp.asarray(tok))
    want = numpy_stats(x, tok)
    for f, w in want.items():
        g = np.asarray(getattr(got, f))
        if f == "argmax":
            np.testing.assert_array_equal(g, w, err_msg=f)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6, equal_nan=True, err_msg=f)


@pytest.mark.parametrize("ref", REFERENCES)
def test_reference_spec_values(ref):
    reference = REFERENCES[ref]
    # uniform row: normalized entropy 1; top-3 entropy 3 * (1/V) log V
    V = 10
    s = reference(jnp.zeros((1, V)), jnp.zeros((1,), jnp.int32))
    np.testing.assert_allclose(s.entropy, [math.log(V)], rtol=1e-6)
    assert float(s.entropy_normalized[0]) == 1.0  # exactly: SPEC's theta = 1 remark
    np.testing.assert_allclose(s.entropy_top3, [3 * math.log(V) / V], rtol=1e-6)
    assert int(s.argmax[0]) == 0
    # V == 1: every entropy is 0
    s = reference(jnp.array([[3.0]]), jnp.array([0]))
    assert float(s.entropy[0]) == 0 and float(s.entropy_normalized[0]) == 0
    assert float(s.entropy_top3[0]) == 0 and float(s.lse[0]) == 3.0
    # tied top values count with multiplicity, like a sorted top-k
    s = reference(jnp.array([[1.0, 5.0, 5.0, 5.0, 5.0]]), jnp.array([2]))
    p = np.exp(5.0) / (np.exp(1.0) + 4 * np.exp(5.0))
    np.testing.assert_allclose(s.entropy_top3, [-3 * p * np.log(p)], rtol=1e-5)
    assert int(s.argmax[0]) == 1 and float(s.token_logit[0]) == 5.0


# ------------------------------------------------------------------ kernel vs reference

KINDS = ("normal", "ties", "one_finite", "some_neg_inf", "peaked")


def mixed_logits(rng, N, V):
    """N rows cycling through every kind of row (one compile covers them all)."""
    x = np.concatenate([random_logits(rng, N, V, kind) for kind in KINDS])
    return x[np.arange(N) * len(KINDS) + np.arange(N) % len(KINDS)]


KERNEL_CASES = [
    # (N, V, block_v)
    (1, 1, 128),
    (5, 2, 128),
    (5, 3, 128),
    (37, 300, 128),      # V not a multiple of the block, N not a multiple of 8 or 16
    (23, 257, 128),      # a last block holding a single column
    (20, 700, 256),
    (528, 6, 128),       # N = 16 * (32 + 1) rows with a small V
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("N,V,block_v", KERNEL_CASES)
def test_kernel_matches_reference(variant, N, V, block_v):
    rng = np.random.default_rng(N * 1000 + V)
    x = jnp.asarray(mixed_logits(rng, N, V))
    tok = jnp.asarray(rng.integers(-2, V + 2, size=N), jnp.int32)
    got = sp.gate_stats(x, tok, impl="kernel", interpret=True, variant=variant, block_v=block_v)
    assert_stats_close(got, plain(x, tok), msg=f"{variant} N={N} V={V}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_bfloat16(variant):
    rng = np.random.default_rng(7)
    x32 = mixed_logits(rng, 20, 333)
    x = jnp.asarray(x32).astype(jnp.bfloat16)
    tok = jnp.asarray(rng.integers(0, 333, size=20), jnp.int32)
    got = sp.gate_stats(x, tok, impl="kernel", interpret=True, variant=variant, block_v=128)
    # the same bf16 values, float32 arithmetic in both
    assert_stats_close(got, plain(x, tok), msg=variant)
    # and within bf16 precision of the float32 logits they were rounded from
    exact = plain(jnp.asarray(x32), tok)
    for f in ("entropy", "entropy_normalized", "entropy_top3", "lse", "max_logit"):
        np.testing.assert_allclose(getattr(got, f), getattr(exact, f), rtol=0.02, atol=0.05, err_msg=f)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_vocab_splits(variant):
    # S > 1 vocabulary splits per row, combined afterwards; S * blocks > nblocks exercises
    # the clamped (all-masked) blocks of the last split.
    rng = np.random.default_rng(3)
    x = random_logits(rng, 5, 1000, "normal")
    x[1, :] = 0.0                     # uniform row: argmax tie across splits -> index 0
    x[2, 900:] = x[2].max() + 1.0     # the max in the last split
    x[3, :] = NEG
    x[3, 999] = 2.0                   # only the last column is finite
    x, tok = jnp.asarray(x), jnp.asarray([0, 999, 950, 999, 500], jnp.int32)
    for splits in (3, 8):
        got = sp.gate_stats(x, tok, impl="kernel", interpret=True, variant=variant, block_v=128,
                            num_splits=splits)
        assert_stats_close(got, plain(x, tok), msg=f"{variant} S={splits}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_leading_dims_and_no_tokens(variant):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(2, 3, 150)), jnp.float32)  # [B, K+1, V]
    got = sp.gate_stats(x, impl="kernel", interpret=True, variant=variant, block_v=128)
    want = plain(x)
    assert got.entropy.shape == (2, 3) and got.argmax.dtype == jnp.int32
    assert np.isnan(np.asarray(got.token_logit)).all()
    assert_stats_close(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_under_vmap(variant):
    # verify's rules are written per sequence and batched with vmap
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(4, 3, 300)), jnp.float32)
    tok = jnp.asarray(rng.integers(0, 300, (4, 3)), jnp.int32)
    f = jax.vmap(lambda x, t: sp.gate_stats(x, t, impl="kernel", interpret=True, variant=variant,
                                            block_v=128))
    assert_stats_close(f(x, tok), plain(x, tok))


def test_kernel_under_jit():
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 200)), jnp.float32)
    tok = jnp.arange(4, dtype=jnp.int32)
    f = jax.jit(lambda x, t: sp.gate_stats(x, t, impl="kernel", interpret=True, block_v=128))
    assert_stats_close(f(x, tok), plain(x, tok))


# ------------------------------------------------------------------ dispatch and errors

def test_dispatch_defaults_and_switch(monkeypatch):
    calls = []
    real = _gate_kernel.gate_partials_kernel

    def spy(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(_gate_kernel, "gate_partials_kernel", spy)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(3, 130)), jnp.float32)
    tok = jnp.zeros((3,), jnp.int32)
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    sp.gate_stats(x, tok)  # CPU default: jnp reference
    assert _dispatch.resolve_impl(None) == "reference" and not calls
    monkeypatch.setenv(_dispatch.ENV_VAR, "kernel")
    assert_stats_close(sp.gate_stats(x, tok, block_v=128), plain(x, tok))
    assert len(calls) == 1 and calls[0]["interpret"] is True
    monkeypatch.setenv(_dispatch.ENV_VAR, "auto")
    sp.gate_stats(x, tok, block_v=128, backend=Backend(pallas="kernel"))  # the backend's choice beats the env
    assert len(calls) == 2
    sp.gate_stats(x, tok, impl="reference")
    assert len(calls) == 2
    monkeypatch.setenv(_dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="SPECJAX_PALLAS"):
        sp.gate_stats(x, tok)
    with pytest.raises(ValueError, match="pallas must be one of"):
        Backend(pallas="gpu")


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_errors(impl):
    f = lambda x, t=None, **kw: sp.gate_stats(x, t, impl=impl, interpret=True, **kw)
    with pytest.raises(ValueError, match="empty vocabulary"):
        f(jnp.zeros((2, 0)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        f(jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="leading shape"):
        f(jnp.zeros((2, 4)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="integer dtype"):
        f(jnp.zeros((2, 4)), jnp.zeros((2,), jnp.float32))
    with pytest.raises(ValueError, match="scalar"):
        f(jnp.float32(1.0))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        f(jnp.zeros((2, 4), jnp.float16))
    if impl == "kernel":
        with pytest.raises(ValueError, match="multiple of 128"):
            f(jnp.zeros((2, 4)), block_v=100)
        with pytest.raises(ValueError, match="power of two"):
            f(jnp.zeros((2, 4)), block_v=384, variant="triton")
        with pytest.raises(ValueError, match="variant"):
            f(jnp.zeros((2, 4)), variant="cuda")
        with pytest.raises(ValueError, match="interpret mode"):  # CPU cannot compile a kernel
            sp.gate_stats(jnp.zeros((2, 4)), impl="kernel", interpret=False)


_logit = st.sampled_from([NEG, -30.0, -2.0, -1.0, 0.0, 0.5, 1.0, 2.0, 7.0, 80.0])


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_hypothesis_rows(data):
    """Rows drawn from a small value set (ties, -inf, large gaps): NumPy == reference == kernel."""
    N, V = 6, 140  # one shape: one kernel compile; 140 > block 128
    x = np.array(data.draw(st.lists(_logit, min_size=N * V, max_size=N * V)), np.float32)
    x = x.reshape(N, V)
    fin = data.draw(st.lists(st.integers(0, V - 1), min_size=N, max_size=N))
    x[np.arange(N), fin] = np.where(np.isfinite(x[np.arange(N), fin]), x[np.arange(N), fin], 1.0)
    tok = np.array(data.draw(st.lists(st.integers(-1, V), min_size=N, max_size=N)), np.int32)
    ref = plain(jnp.asarray(x), jnp.asarray(tok))
    for f, w in numpy_stats(x, tok).items():
        np.testing.assert_allclose(np.asarray(getattr(ref, f)), w, rtol=1e-5, atol=2e-6,
                                   equal_nan=True, err_msg=f)
    got = sp.gate_stats(jnp.asarray(x), jnp.asarray(tok), impl="kernel", interpret=True,
                        variant="triton", block_v=128)
    assert_stats_close(got, ref)


def test_mosaic_on_tpu_interpreter_with_poisoned_reads():
    """The TPU interpreter models Mosaic's semantics more closely: out-of-bounds parts of
    partial blocks read NaN, buffers start as NaN, and races between grid steps are
    detected. The column mask and the resident accumulators must still give exact stats."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    params = pltpu.InterpretParams(out_of_bounds_reads="uninitialized",
                                   uninitialized_memory="nan", detect_races=True)
    rng = np.random.default_rng(9)
    for N, V, block_v, block_n, dtype, splits in [(23, 300, 128, 16, jnp.float32, 1),
                                                  (9, 257, 128, 8, jnp.bfloat16, 2)]:
        x = jnp.asarray(mixed_logits(rng, N, V)).astype(dtype)
        tok = jnp.asarray(rng.integers(-1, V + 1, N), jnp.int32)
        tok_k = jnp.where((tok >= 0) & (tok < V), tok, -1)
        m, s, t, v2, v3, arg, tk = _gate_kernel._mosaic_partials(
            x, tok_k, block_v=block_v, block_n=block_n, num_splits=splits, interpret=params)
        p = sp.GatePartials(m, s, t, jnp.stack([m, v2, v3], -1), arg.astype(jnp.int32), tk)
        got = sp.finalize_partials(sp.combine_partials(p), V, tok)
        assert_stats_close(got, plain(x, tok), msg=f"N={N} V={V}")
