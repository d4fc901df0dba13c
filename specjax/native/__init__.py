"""A native CPU kernel for decode-sized matmuls with block-quantized weights (`blockdot.cc`).

XLA:CPU dequantizes block codes into a float32 buffer and then dots it, at a fraction of
the speed of reading the codes (experiments/profile_step.py). `blockdot.cc` expands each
code in registers right before its multiply-add, as an XLA FFI custom call. It is compiled
on first use with the host's C++ compiler (`$CXX`, else g++, `-O3 -march=native`) against
the FFI headers that jaxlib ships, into the specjax cache (keyed by the source, the flags,
jaxlib's version and the CPU), and registered with XLA. Where that fails (no compiler), or
with `SPECJAX_NATIVE=0`, `available()` is False and the models keep XLA's dot.

A library in the cache is loaded only if it is the one built: each build writes the SHA-256
and size of the library beside it (`blockdot-*.so.sha256`), and a library that does not match
(truncated by a killed process, replaced, or without that record) is rebuilt with one warning;
loading a truncated one would kill the process with a bus error.

This package owns the kernel's weight layouts (`PackedQuant`, `Q8Tiles`, `_layouts`) and the
packing of an engine's parameters into them (`pack_params`, `_pack`). The models never import
it: the Engine hands this module to them as `Backend(kernels=native)`, whose `dot`, `supports`,
`attention` and `attention_supported` are the functions below.

    y_MN = dot(x_MK, w)   # w: float32 [K, N] or a BlockQuant with codes [K/bs, bs, N]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import quant
from specjax.models.quant import BlockQuant
from specjax.native._layouts import (PACK_COLUMNS, Q8_COLUMNS, PackedQuant, Q8Tiles, pack_for_native,  # noqa: F401
                                     pack_for_q8, pack_nibbles, tile_codes)
from specjax.native._pack import pack_params  # noqa: F401

ENV_VAR = "SPECJAX_NATIVE"
SOURCE = os.path.join(os.path.dirname(__file__), "blockdot.cc")
SOURCES = (SOURCE, os.path.join(os.path.dirname(__file__), "attention.cc"))  # one library
HEADERS = (os.path.join(os.path.dirname(__file__), "parallel.h"),)  # in the library's key too
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
COLUMNS = PACK_COLUMNS  # N must be a multiple of the kernel's tile (blockdot.cc: kCols)


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("0", "off", "false", "no")


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _library_path() -> str:
    import jaxlib

    from specjax.models import presets

    text = b""
    for source in (*SOURCES, *HEADERS):
        with open(source, "rb") as f:
            text += f.read()
    digest = hashlib.sha256(text + " ".join(FLAGS).encode() + jaxlib.__version__.encode()
                            + _cpu_key().encode()).hexdigest()[:16]
    return os.path.join(presets.cache_dir(), "native", f"blockdot-{digest}.so")


def _digest(path: str) -> str:
    """"<sha256> <size>" of the file at `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return f"{h.hexdigest()} {os.path.getsize(path)}"


def _record(path: str) -> str:
    return path + ".sha256"


def _is_built(path: str) -> bool:
    """Whether the library at `path` is byte for byte the one a build recorded beside it."""
    try:
        with open(_record(path)) as f:
            return f.read().strip() == _digest(path)
    except OSError:
        return False


def _compile(path: str) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    fd, record = tempfile.mkstemp(suffix=".sha256", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(_digest(tmp) + "\n")
    os.replace(record, _record(path))
    os.replace(tmp, path)  # atomic: a concurrent process sees the whole library or none


@functools.lru_cache(maxsize=None)
def _load() -> bool:
    if not enabled_by_env():
        return False
    path = _library_path()
    try:
        if not os.path.exists(path):
            _compile(path)
        elif not _is_built(path):  # truncated, replaced, or of an older specjax: never load it
            warnings.warn(f"specjax's cached native library {path} is not the one built (its SHA-256 or size "
                          f"differs from {os.path.basename(_record(path))}, or that record is missing): "
                          "rebuilding it", stacklevel=2)
            _compile(path)
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target("specjax_blockdot", jax.ffi.pycapsule(lib.SpecjaxBlockDot), platform="cpu")
        jax.ffi.register_ffi_target("specjax_densedot", jax.ffi.pycapsule(lib.SpecjaxDenseDot), platform="cpu")
        jax.ffi.register_ffi_target("specjax_tiledot", jax.ffi.pycapsule(lib.SpecjaxTileDot), platform="cpu")
        jax.ffi.register_ffi_target("specjax_q8dot", jax.ffi.pycapsule(lib.SpecjaxQ8Dot), platform="cpu")
        jax.ffi.register_ffi_target("specjax_attention", jax.ffi.pycapsule(lib.SpecjaxAttention), platform="cpu")
        jax.ffi.register_ffi_target("specjax_attention_deferred", jax.ffi.pycapsule(lib.SpecjaxAttentionDeferred),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(f"specjax's native CPU matmul is unavailable, using XLA's dot instead: {e}", stacklevel=2)
        return False
    return True


def available() -> bool:
    """Whether the kernel is built and registered (compiles it on the first call)."""
    return _load()


def supports(x, w, stacked: bool = False) -> bool:
    """Whether dot(x, w) can run natively: float32 activations, a float32 [K, N] matrix, a
    BlockQuant with int8 codes, or a PackedQuant (`stacked`: one with a leading layer axis), N a
    multiple of the tile."""
    if x.dtype != jnp.float32:
        return False
    if isinstance(w, Q8Tiles):
        return (w.data.ndim == 3 + stacked and w.data.dtype == jnp.uint8 and w.data.shape[-1] == 64
                and w.scale.dtype == jnp.float32 and w.scale.shape[-1] == Q8_COLUMNS)
    if isinstance(w, PackedQuant):
        return (w.data.ndim == 3 + stacked and w.data.dtype == (jnp.uint8 if w.bits == 4 else jnp.int8)
                and w.scale.dtype == jnp.float32 and w.data.shape[-1] == COLUMNS)
    if stacked:
        return False
    if isinstance(w, BlockQuant):
        return (w.codes.ndim == 3 and w.codes.dtype == jnp.int8 and w.scale.dtype == jnp.float32
                and w.codes.shape[-1] % COLUMNS == 0)
    return w.ndim == 2 and w.dtype == jnp.float32 and w.shape[-1] % COLUMNS == 0


def dot(x_MK: jax.Array, w, layer=None) -> jax.Array:
    """float32[M, N] = x @ w, with w a float32 [K, N] array, a BlockQuant (codes [K/bs, bs, N]),
    a PackedQuant (tile-major codes [N/32, K or K/2, 32]) or a Q8Tiles (the int8-activation path:
    each row of x quantized to int8 per block, llama.cpp's numerics, not float32's). With `layer`
    (an int32 scalar, traced or not), w is a PackedQuant or Q8Tiles stack [L, ...] and layer
    `layer` is read where it lies.

    Differentiable (a custom call is not): tangents go through XLA's dot of the same values, to
    x, and to a float w; a block-coded weight is a constant (a tangent of its scales is refused)."""
    return _dot(x_MK, w, layer)


@jax.custom_jvp
def _dot(x_MK, w, layer):
    return _ffi_dot(x_MK, w, layer)


@functools.partial(_dot.defjvp, symbolic_zeros=True)
def _dot_jvp(primals, tangents):
    x_MK, w, layer = primals  # the layer index is an integer: no tangent
    dx_MK, dw, _ = tangents
    y = _dot(x_MK, w, layer)
    w_KN = quant.materialize(w if layer is None else quant.layer_of(w, layer))
    dy = jnp.zeros_like(y)
    if not isinstance(dx_MK, jax.custom_derivatives.SymbolicZero):
        dy = dy + dx_MK @ w_KN
    dw_leaves = [t for t in jax.tree.leaves(dw, is_leaf=lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero))
                 if not isinstance(t, jax.custom_derivatives.SymbolicZero)]
    if dw_leaves:
        if quant.is_quantized(w):
            raise ValueError("native.dot: a block-coded weight has no derivative here (its codes are integers); "
                             "differentiate a float weight, or use Backend(matmul='xla')")
        dy = dy + x_MK @ (dw if layer is None else quant.layer_of(dw, layer))
    return y, dy


def _ffi_dot(x_MK, w, layer):
    if not available():
        raise RuntimeError("the native kernel is not available (see specjax.native)")
    if not supports(x_MK, w, layer is not None):
        raise ValueError(f"native.dot takes float32 x and a float32 or block-coded weight whose columns are a "
                         f"multiple of {COLUMNS} (a stack only of PackedQuant); got x {x_MK.dtype}, weight "
                         f"{type(w).__name__} {getattr(w, 'shape', None)}")
    M, K = x_MK.shape
    out = lambda n: jax.ShapeDtypeStruct((M, n), jnp.float32)  # noqa: E731
    if isinstance(w, Q8Tiles):
        stack = (lambda a: a) if layer is not None else (lambda a: a[None])  # noqa: E731
        data, scale = stack(w.data), stack(w.scale)
        _, T, groups, _ = data.shape
        if groups * (8 if w.bits == 4 else 4) != K:
            raise ValueError(f"x has {K} columns, the weight {groups * (8 if w.bits == 4 else 4)} rows")
        offset = stack(w.offset) if w.offset is not None else scale  # unread without an offset
        index = jnp.asarray(0 if layer is None else layer, jnp.int32)
        return jax.ffi.ffi_call("specjax_q8dot", out(T * Q8_COLUMNS), vmap_method="sequential")(
            x_MK, data, scale, offset, index, has_offset=w.offset is not None, bits=np.int32(w.bits),
            zero=np.int32(w.zero))
    if isinstance(w, PackedQuant):
        stack = (lambda a: a) if layer is not None else (lambda a: a[None])  # noqa: E731
        data = stack(w.data)
        _, T, rows, C = data.shape
        if rows * (8 // w.bits) != K:
            raise ValueError(f"x has {K} columns, the weight {rows * (8 // w.bits)} rows")
        scale = stack(w.scale)
        offset = stack(w.offset) if w.offset is not None else scale  # unread without an offset
        index = jnp.asarray(0 if layer is None else layer, jnp.int32)
        return jax.ffi.ffi_call("specjax_tiledot", out(T * C), vmap_method="sequential")(
            x_MK, data, scale, offset, index, has_offset=w.offset is not None, bits=np.int32(w.bits),
            is_signed=w.signed)
    if isinstance(w, BlockQuant):
        nb, bs, N = w.codes.shape
        if nb * bs != K:
            raise ValueError(f"x has {K} columns, the weight {nb * bs} rows")
        scale = w.scale.reshape(nb, N)
        offset = w.offset.reshape(nb, N) if w.offset is not None else scale  # unread without an offset
        return jax.ffi.ffi_call("specjax_blockdot", out(N), vmap_method="sequential")(
            x_MK, w.codes.reshape(K, N), scale, offset, has_offset=w.offset is not None)
    if w.shape[0] != K:
        raise ValueError(f"x has {K} columns, the weight {w.shape[0]} rows")
    return jax.ffi.ffi_call("specjax_densedot", out(w.shape[1]), vmap_method="sequential")(x_MK, w)


def attention_supported(q_BTHDh, cache_k) -> bool:
    """Whether `attention` takes these: float32 queries and cache, H a multiple of G."""
    return (q_BTHDh.dtype == jnp.float32 and cache_k.dtype == jnp.float32 and cache_k.ndim == 5
            and q_BTHDh.shape[2] % cache_k.shape[3] == 0 and q_BTHDh.shape[3] == cache_k.shape[4])


def attention(q_BTHDh, cache_k_NBSGDh, cache_v_NBSGDh, layer, positions_BT, new_kv=None):
    """float32[B, T, H, Dh]: each query's attention over the keys of layer `layer` of the cache
    at positions j <= its own position (`attention.cc`), the stack read where it lies. The same
    values as llama.Block's masked softmax up to float32 rounding (a polynomial exponential), and
    a query's output does not depend on T, on the cache length or on the other rows.

    new_kv: None, or the T fed tokens' (keys, values) float32[B, T, G, Dh], not in the cache (a
    deferred write): a row's positions must then be consecutive, and the keys from its first
    position on are read from these. Bit for bit the output of writing them into the cache first."""
    if not available():
        raise RuntimeError("the native kernel is not available (see specjax.native)")
    if not attention_supported(q_BTHDh, cache_k_NBSGDh) or cache_v_NBSGDh.shape != cache_k_NBSGDh.shape:
        raise ValueError(f"native.attention takes float32 q [B, T, H, Dh] and caches [L, B, S, G, Dh] with H a "
                         f"multiple of G; got q {q_BTHDh.dtype} {q_BTHDh.shape}, k {cache_k_NBSGDh.dtype} "
                         f"{cache_k_NBSGDh.shape}, v {cache_v_NBSGDh.shape}")
    args = (q_BTHDh, cache_k_NBSGDh, cache_v_NBSGDh, jnp.asarray(layer, jnp.int32), positions_BT.astype(jnp.int32))
    out = jax.ShapeDtypeStruct(q_BTHDh.shape, jnp.float32)
    if new_kv is None:
        return jax.ffi.ffi_call("specjax_attention", out, vmap_method="sequential")(*args)
    B, T, _, Dh = q_BTHDh.shape
    want = (B, T, cache_k_NBSGDh.shape[3], Dh)
    if any(a.shape != want or a.dtype != jnp.float32 for a in new_kv):
        raise ValueError(f"native.attention: new keys and values must be float32{list(want)}, got "
                         f"{[(str(a.dtype), a.shape) for a in new_kv]}")
    return jax.ffi.ffi_call("specjax_attention_deferred", out, vmap_method="sequential")(*args, *new_kv)
