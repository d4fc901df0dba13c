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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class BlockQuant:
    """A weight of logical shape `shape` = (codes * scale + offset).reshape(shape).

    Linear weights (ours are [*in, *out]): codes int8[in/bs, bs, out], scale/offset float32[in/bs, 1, out].
    A stacked layer weight has a leading L axis on every array; `shape` is per layer.
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    shape: tuple[int, ...] = struct.field(pytree_node=False)

    @property
    def dtype(self):
        return jnp.float32

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.codes, self.scale, self.offset)
                   if a is not None)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        w = self.codes.astype(jnp.float32) * self.scale
        if self.offset is not None:
            w = w + self.offset
        lead = self.codes.shape[: self.codes.ndim - 3]  # a leading L axis when stacked
        return w.reshape(*lead, *self.shape).astype(dtype)


def materialize(w, dtype=jnp.float32) -> jax.Array:
    """A float weight of `dtype` from a plain array or a BlockQuant."""
    return w.dequantize(dtype) if isinstance(w, BlockQuant) else jnp.asarray(w).astype(dtype)


def param_bytes(params) -> int:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, BlockQuant))
    return sum(x.nbytes if isinstance(x, BlockQuant) else int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


# --- from GGUF blocks -----------------------------------------------------------

def _gguf_types():
    from gguf import GGMLQuantizationType as T

    # qtype -> whether the block header has an offset (min) after the float16 scale
    return {T.Q4_0: False, T.Q4_1: True, T.Q5_0: False, T.Q5_1: True, T.Q8_0: False}


def supports(qtype) -> bool:
    return qtype in _gguf_types()


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
    """Integer codes and float32 scale/offset of a quantized GGUF tensor (uint8[rows, bytes])."""
    import gguf

    has_offset = _gguf_types()[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    unit = blocks.copy()
    unit[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    offset = None
    if has_offset:
        offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
        unit[:, 2:4] = np.array([0.0], np.float16).view(np.uint8)
    codes_f = gguf.quants.dequantize(unit.reshape(data.shape), qtype)
    codes = codes_f.astype(np.int8)
    # Self-check: the layout assumption must reproduce the library's values exactly.
    recon = np.repeat(scale, block_size, axis=1) * codes.astype(np.float32)
    if offset is not None:
        recon = recon + np.repeat(offset, block_size, axis=1)
    reference = gguf.quants.dequantize(data, qtype)
    if not (np.array_equal(codes.astype(np.float32), codes_f) and np.array_equal(recon, reference)):
        raise ValueError(f"block codes of a {qtype.name} tensor do not reproduce gguf's dequantization")
    return RawBlocks(codes, scale, offset, block_size)



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
