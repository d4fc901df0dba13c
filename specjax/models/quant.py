"""Block-quantized weights kept as the GGUF stores them, dequantized inside the forward.

Decoding at small batch is bound by reading the weights. A Q4_1/Q8_0 GGUF
holds each block of 32 weights as integer codes with one float16 scale (and
an offset for the `_1` types); expanding them to float32 at load time makes
every token read 4 bytes per weight. We keep the codes (int8) and the per-
block scale and offset (float32), and XLA fuses `codes * scale + offset` into
the matmul's operand: about 1.1 bytes per weight for the same values.

The values are bit-identical to `gguf.quants.dequantize`: a code times a
float16-derived scale is exact in float32, so the one rounding (the `+ offset`)
is the library's own, with or without a fused multiply-add. `extract_codes`
uses the library to unpack the codes (it dequantizes a copy of the blocks
whose scale is set to 1 and offset to 0) and checks the reconstruction
against the library's dequantization of the original before returning.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.backend import PLAIN, Backend


def _bytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays if a is not None)


class _Coded:
    """What every block-coded weight shares: float32 values, and the bytes of its arrays."""

    @property
    def dtype(self):
        return jnp.float32

    @property
    def nbytes(self) -> int:
        return _bytes(*self.stored())


@struct.dataclass
class BlockQuant(_Coded):
    """A weight of logical shape `shape` = (codes * scale + offset).reshape(shape).

    Linear weights (ours are [*in, *out]): codes int8[in/bs, bs, out], scale/offset float32[in/bs, 1, out].
    A stacked layer weight has a leading L axis on every array; `shape` is per layer.
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    shape: tuple[int, ...] = struct.field(pytree_node=False)

    def stored(self) -> tuple:
        return self.codes, self.scale, self.offset

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        w = self.codes.astype(jnp.float32) * self.scale
        if self.offset is not None:
            w = w + self.offset
        lead = self.codes.shape[: self.codes.ndim - 3]  # a leading L axis when stacked
        return w.reshape(*lead, *self.shape).astype(dtype)


class Relaid(_Coded):
    """Base of a BlockQuant kept in another layout for a kernel (`specjax.native` defines them:
    `native.PackedQuant`, `native.Q8Tiles`). What this module needs of one: float32 values,
    their bytes, and the same weight as a row-major BlockQuant (`unpacked`). A subclass has
    `data`, `scale`, `offset` and `shape` fields.

    any_rows: the kernel runs it at every number of rows (the int8-activation tiles, whose
    numerics must not change with the rows), not only up to `Backend.native_max_rows`."""

    any_rows: ClassVar[bool] = False

    def stored(self) -> tuple:
        return self.data, self.scale, self.offset

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.unpacked().dequantize(dtype)

    def unpacked(self) -> BlockQuant:
        raise NotImplementedError


def is_quantized(w) -> bool:
    return isinstance(w, (BlockQuant, Relaid))


def materialize(w, dtype=jnp.float32) -> jax.Array:
    """A float weight of `dtype` from a plain array, a BlockQuant or a Relaid one."""
    return w.dequantize(dtype) if is_quantized(w) else jnp.asarray(w).astype(dtype)


# Vocabulary columns dequantized per step of the head's scan: the float chunk (D x 1024
# float32 = 2.4 MB for SmolLM2) stays in cache between its dequantization and the dot.
# The chunking is a fix for XLA:CPU. On a GPU/TPU, or with the table split over the vocabulary
# on a mesh (where a scan of dynamic slices would all-gather the whole table every step), the
# head is one dot that GSPMD shards (`default_head_chunk`; the Engine sets `Backend.head_chunk`).
VOCAB_CHUNK = 1024


def _use_native(x, w, rows: int, backend: Backend, stacked: bool = False) -> bool:
    """Whether the backend's native kernel computes dot(x, w): a decode-sized product (or a
    layout the kernel runs at every size, `Relaid.any_rows`) that the kernel supports."""
    if not backend.native:
        return False
    small = rows <= backend.native_max_rows or getattr(w, "any_rows", False)
    return small and backend.kernels.supports(x, w, stacked)


def layer_of(w, layer):
    """Layer `layer` (a traced index) of a stacked weight: float, BlockQuant or Relaid."""
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
    return jax.tree.map(pick, w) if is_quantized(w) else pick(w)


def contract(spec: str, x: jax.Array, w, n_in: int, dtype=jnp.float32, layer=None, backend=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for a linear layer: x [..., *in] with w [*in, *out] (`n_in`
    contracted dimensions), w float or block-quantized; with `layer`, w is a stack of layers and
    layer `layer` is used. With a native `backend` (`Backend.matmul`), decode-sized products go
    to its kernel (the same values from codes or from their float32 dequantization, bit for bit),
    which reads a stacked Relaid weight in place; everything else is XLA's dot of the
    materialized weight."""
    backend = backend or PLAIN  # plain data on the traced path (no call)
    lead, inner = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in:]
    K, rows = math.prod(inner), math.prod(lead)
    if layer is not None and not (isinstance(w, Relaid) and _use_native(x, w, rows, backend, stacked=True)):
        w, layer = layer_of(w, layer), None  # the layer's slice (a copy, as a scan would make)
    out = tuple(w.shape[n_in:]) if is_quantized(w) else tuple(w.shape[(layer is not None) + n_in:])
    w2 = w if is_quantized(w) else w.reshape(K, math.prod(out))
    if layer is not None or _use_native(x, w2, rows, backend):
        return backend.kernels.dot(x.reshape(rows, K), w2, layer).reshape(*lead, *out)
    return jnp.einsum(spec, x, materialize(w, dtype))


def default_head_chunk(platform: str | None = None, vocab_sharded: bool = False) -> int:
    """VOCAB_CHUNK on an unsharded CPU program, else 0 (one whole dot)."""
    platform = platform or jax.default_backend()
    return VOCAB_CHUNK if platform == "cpu" and not vocab_sharded else 0


def take_columns(w: BlockQuant, ids, dtype=jnp.float32) -> jax.Array:
    """Columns `ids` of a [D, V] block-quantized table (the embedding lookup): [*ids.shape, D].
    Only the gathered blocks are dequantized; the values are those of `dequantize()`."""
    if len(w.shape) != 2 or w.codes.ndim != 3:
        raise ValueError(f"take_columns needs an unstacked [D, V] table, got shape {w.shape}")
    take = lambda a: jnp.take(a, ids, axis=-1)  # noqa: E731
    x = take(w.codes).astype(jnp.float32) * take(w.scale)
    if w.offset is not None:
        x = x + take(w.offset)
    x = x.reshape(w.shape[0], *ids.shape)  # [D, *ids]
    return jnp.moveaxis(x, 0, -1).astype(dtype)


def matmul_columns(x_BTD: jax.Array, w, dtype=jnp.float32, chunk: int | None = None, backend=None) -> jax.Array:
    """float32[B, T, V] = x @ w for a [D, V] table (the LM head), float or block-quantized.

    Outside the layer scan XLA:CPU fuses a dequantization into the dot as a naive loop
    (measured ~10x slower than the float32 dot), so the columns are taken `chunk` at a
    time inside a scan and each chunk meets an ordinary dot. A float table goes through
    the same chunks: XLA:CPU's dot blocks its reduction over D differently for different
    numbers of columns, so the float32 model and the block-quantized one give the same
    logits bit for bit only when both compute them in the same chunks. The last chunk
    starts at V - chunk (dynamic_slice clamps), overlapping its neighbour when chunk
    does not divide V. chunk 0 is one whole dot; None takes `backend.head_chunk`, else
    `default_head_chunk()`. With a native `backend` a decode-sized product runs in its kernel.
    """
    backend = backend or PLAIN  # plain data on the traced path (no call)
    shape = w.shape
    if len(shape) != 2 or (isinstance(w, BlockQuant) and w.codes.ndim != 3):
        raise ValueError(f"matmul_columns needs an unstacked [D, V] table, got shape {shape}")
    B, T = x_BTD.shape[:2]
    if _use_native(x_BTD, w, B * T, backend):  # reads the table where it lies, one column tile at a time
        return backend.kernels.dot(x_BTD.reshape(B * T, shape[0]), w).reshape(B, T, shape[1])
    if isinstance(w, Relaid):
        w = w.unpacked()
    if chunk is None:
        chunk = backend.head_chunk if backend.head_chunk is not None else default_head_chunk()
    if chunk == 0:
        return jnp.einsum("btd,dv->btv", x_BTD, materialize(w, dtype), preferred_element_type=jnp.float32)
    V = shape[1]
    chunk = min(chunk, V)
    n = -(-V // chunk)

    def one(_, i):
        start = jnp.minimum(i * chunk, V - chunk)
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=-1)  # noqa: E731
        if isinstance(w, BlockQuant):
            part = BlockQuant(sl(w.codes), sl(w.scale), None if w.offset is None else sl(w.offset),
                              (shape[0], chunk)).dequantize(dtype)
        else:
            part = sl(w).astype(dtype)
        return None, jnp.einsum("btd,dv->btv", x_BTD, part, preferred_element_type=jnp.float32)

    _, parts_NBTC = jax.lax.scan(one, None, jnp.arange(n))
    head = jnp.moveaxis(parts_NBTC[:-1], 0, 2).reshape(B, T, (n - 1) * chunk)
    tail = parts_NBTC[-1][:, :, chunk - (V - (n - 1) * chunk):]
    return jnp.concatenate([head, tail], axis=-1)


def pad_columns(w: BlockQuant, extra: int) -> BlockQuant:
    """`w` [D, V] with `extra` zero columns (codes, scale and offset 0: value 0)."""
    pad = lambda a: None if a is None else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])  # noqa: E731
    return BlockQuant(pad(w.codes), pad(w.scale), pad(w.offset), (*w.shape[:-1], w.shape[-1] + extra))


def param_bytes(params) -> int:
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    return sum(x.nbytes if is_quantized(x) else _bytes(x) for x in leaves)


# --- from GGUF blocks -----------------------------------------------------------

def _gguf_types():
    from gguf import GGMLQuantizationType as T

    # qtype -> whether the block header has an offset (min) after the float16 scale
    return {T.Q4_0: False, T.Q4_1: True, T.Q5_0: False, T.Q5_1: True, T.Q8_0: False}


def _k_probes():
    """K-quants: (sub-block size, how to make blocks whose values are the scales, and the
    offsets). A probe only rewrites code bytes or the min's scale; the library dequantizes."""
    from gguf import GGMLQuantizationType as T

    def q4k_scale(b):  # every 4-bit code 1 and dmin 0: value = d * sc
        b[:, 2:4] = np.array([0.0], np.float16).view(np.uint8)
        b[:, 16:144] = 0x11

    def q4k_offset(b):  # every code 0: value = -dmin * m
        b[:, 16:144] = 0

    def q6k_scale(b):  # every 6-bit code 33 (low nibbles 1, high bits 2): value = d * sc * (33 - 32)
        b[:, 0:128] = 0x11
        b[:, 128:192] = 0xAA

    return {T.Q4_K: (32, q4k_scale, q4k_offset), T.Q6_K: (16, q6k_scale, None)}


def supports(qtype) -> bool:
    return qtype in _gguf_types() or qtype in _k_probes()


class RawBlocks:
    """Codes and per-block scale/offset of a GGUF tensor in its [out, in] row layout."""

    def __init__(self, codes, scale, offset, block_size):
        self.codes, self.scale, self.offset, self.block_size = codes, scale, offset, block_size
        self.shape = codes.shape

    def permute_rows(self, perm) -> "RawBlocks":
        return RawBlocks(self.codes[perm], self.scale[perm], None if self.offset is None else self.offset[perm],
                         self.block_size)

    def as_linear(self, shape) -> BlockQuant:
        """Our [*in, *out] layout (`shape`): codes [in/bs, bs, out]."""
        out, inp = self.codes.shape
        bs = self.block_size
        codes = np.ascontiguousarray(self.codes.reshape(out, inp // bs, bs).transpose(1, 2, 0))
        side = lambda a: None if a is None else np.ascontiguousarray(a.T[:, None, :])  # noqa: E731
        return BlockQuant(codes, side(self.scale), side(self.offset), tuple(shape))


def extract_codes(data: np.ndarray, qtype) -> RawBlocks:
    """Integer codes and float32 scale/offset of a quantized GGUF tensor (uint8[rows, bytes]).

    Legacy types (Q4_0 .. Q8_0): the float16 scale (and min) head each block; the codes are
    what the library gives for the block with scale 1 and min 0. K-quants: the library's
    values of probe blocks give each sub-block's scale and offset; codes follow from them.
    Either way the result must reproduce `gguf.quants.dequantize` bit for bit, or it raises.
    """
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    reference = gguf.quants.dequantize(data, qtype)
    deq = lambda b: gguf.quants.dequantize(b.reshape(data.shape), qtype)  # noqa: E731
    if qtype in _gguf_types():
        sub, offset = block_size, None
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
        unit = blocks.copy()
        unit[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
        if _gguf_types()[qtype]:
            offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
            unit[:, 2:4] = np.array([0.0], np.float16).view(np.uint8)
        codes_f = deq(unit)
    else:
        sub, scale_probe, offset_probe = _k_probes()[qtype]
        probe = blocks.copy()
        scale_probe(probe)
        scale = deq(probe)[:, ::sub]
        offset = None
        if offset_probe is not None:
            probe = blocks.copy()
            offset_probe(probe)
            offset = deq(probe)[:, ::sub]
        s_full = np.repeat(scale, sub, axis=1)
        centered = reference - (np.repeat(offset, sub, axis=1) if offset is not None else 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            codes_f = np.where(s_full != 0, np.round(centered / np.where(s_full != 0, s_full, 1)), 0.0)
    if np.abs(codes_f).max(initial=0) > 127:
        raise ValueError(f"codes of a {qtype.name} tensor do not fit int8")
    codes = codes_f.astype(np.int8)
    # Self-check: the layout assumption must reproduce the library's values exactly.
    recon = np.repeat(scale, sub, axis=1) * codes.astype(np.float32)
    if offset is not None:
        recon = recon + np.repeat(offset, sub, axis=1)
    if not (np.array_equal(codes.astype(np.float32), codes_f) and np.array_equal(recon, reference)):
        raise ValueError(f"block codes of a {qtype.name} tensor do not reproduce gguf's dequantization")
    return RawBlocks(codes, scale, offset, sub)


def stack_layers(per_layer: list):
    """Stacks per-layer weights on a new axis 0. Block-quantized layers of different types
    are brought to a common block size (scales repeated) and offset form (zeros); if only
    some layers are block-quantized, all are dequantized (the values are the same)."""
    quantized = [isinstance(x, BlockQuant) for x in per_layer]
    if not any(quantized):
        return np.stack(per_layer)
    if not all(quantized):
        return np.stack([np.asarray(x.dequantize()) if isinstance(x, BlockQuant) else x for x in per_layer])
    bs = math.gcd(*[x.codes.shape[-2] for x in per_layer])
    with_offset = any(x.offset is not None for x in per_layer)

    def rebin(x: BlockQuant) -> BlockQuant:
        nb, b, out = x.codes.shape
        rep = b // bs
        offset = x.offset if x.offset is not None else (np.zeros_like(x.scale) if with_offset else None)
        side = lambda a: None if a is None else np.repeat(a, rep, axis=0)  # noqa: E731
        return BlockQuant(np.asarray(x.codes).reshape(nb * rep, bs, out), side(x.scale), side(offset), x.shape)

    return jax.tree.map(lambda *xs: np.stack(xs), *[rebin(x) for x in per_layer])


def to_plain(tree):
    """(nested dicts of arrays, {path: shape} of the BlockQuant leaves), for orbax."""
    shapes = {}

    def walk(x, path):
        if isinstance(x, BlockQuant):
            shapes[path] = list(x.shape)
            out = {"codes": x.codes, "scale": x.scale}
            if x.offset is not None:
                out["offset"] = x.offset
            return out
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in x.items()}
        return x

    return walk(tree, ""), shapes


def from_plain(plain, shapes):
    def walk(x, path):
        if path in shapes:
            return BlockQuant(x["codes"], x["scale"], x.get("offset"), tuple(shapes[path]))
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in x.items()}
        return x

    return walk(plain, "")
