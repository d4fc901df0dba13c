"""The native kernel's weight layouts: a BlockQuant's codes in the order `blockdot.cc` reads.

    PackedQuant   tiles of 32 columns, 4-bit codes two per byte (or int8), float32 dot
    Q8Tiles       tiles of 16 columns of 64-byte groups, the int8-activation (VNNI) path

Both subclass `quant.Relaid`, so the models treat them as any block-quantized weight
(`quant.materialize`, `quant.layer_of`); only this package makes them (`_pack`), on the
host, and only its kernel reads them where they lie.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.models.quant import BlockQuant, Relaid

# Columns per tile of a PackedQuant: the native kernel's tile (specjax/native/blockdot.cc, kCols).
PACK_COLUMNS = 32


@struct.dataclass
class PackedQuant(Relaid):
    """A BlockQuant's codes in the native CPU kernel's order: each tile of 32 columns one
    contiguous stream, which the kernel reads where it lies, and 4-bit codes two per byte (half
    the code bytes). The engine makes them only for that kernel (`pack_nibbles`, `tile_codes`),
    never on a mesh.

    data: bits 4: uint8[..., out/32, in/2, 32]: tile t, byte j holds the codes of rows 2j (low
    nibble) and 2j + 1 (high nibble) of columns 32t .. 32t + 31, as unsigned 0..15 or, with
    `signed`, two's complement -8..7; bits 8: int8[..., out/32, in, 32].
    scale / offset: float32[..., out/32, in/bs, 32].
    """

    data: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False, default=4)
    signed: bool = struct.field(pytree_node=False, default=False)

    def unpacked(self) -> BlockQuant:
        """The same weight as a BlockQuant (one int8 code per weight, row-major)."""
        if self.bits == 4:
            b = self.data.astype(jnp.int32)  # [..., T, K/2, 32]
            lo, hi = b & 15, b >> 4
            if self.signed:
                lo, hi = lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)
            codes = jnp.stack([lo, hi], axis=-2).reshape(*b.shape[:-2], 2 * b.shape[-2], b.shape[-1])
        else:
            codes = self.data
        *lead, T, K, C = codes.shape
        nb = self.scale.shape[-2]
        codes = codes.reshape(*lead, T, nb, K // nb, C)  # [..., T, nb, bs, 32]
        rows = lambda a: jnp.moveaxis(a, -4, -2).reshape(*a.shape[:-4], a.shape[-3], a.shape[-2], T * C)  # noqa: E731
        side = lambda a: None if a is None else rows(a[..., None, :])  # [..., T, nb, 1, 32] -> [..., nb, 1, N]
        return BlockQuant(rows(codes).astype(jnp.int8), side(self.scale), side(self.offset), self.shape)


def _tiles(a, lead):
    """[..., nb, r, N] -> [..., N/32, nb * r, 32] (each tile's rows contiguous)."""
    a = np.asarray(a)
    a = a.reshape(*a.shape[:-1], a.shape[-1] // PACK_COLUMNS, PACK_COLUMNS)
    return np.ascontiguousarray(np.moveaxis(a, -2, -4)).reshape(*lead, a.shape[-2], -1, PACK_COLUMNS)


def pack_nibbles(w: BlockQuant):
    """`w` as a 4-bit PackedQuant when every code fits in 4 bits (Q4_0: -8..7; Q4_1/Q4_K:
    0..15), its blocks have an even size and its columns fill tiles; otherwise `w` unchanged.
    On the host."""
    codes = np.asarray(w.codes)  # [..., nb, bs, N]
    *lead, nb, bs, N = codes.shape
    if bs % 2 or N % PACK_COLUMNS or codes.size == 0:
        return w
    lo, hi = int(codes.min()), int(codes.max())
    if 0 <= lo and hi <= 15:
        signed = False
    elif -8 <= lo and hi <= 7:
        signed = True
    else:
        return w
    nib = codes.astype(np.uint8) & 15  # two's complement keeps a signed code's low 4 bits
    packed = nib[..., 0::2, :] | (nib[..., 1::2, :] << 4)  # [..., nb, bs/2, N]
    return PackedQuant(jnp.asarray(_tiles(packed, lead)), jnp.asarray(_tiles(w.scale, lead)),
                       None if w.offset is None else jnp.asarray(_tiles(w.offset, lead)), w.shape, 4, signed)


def tile_codes(w: BlockQuant):
    """`w` as an 8-bit PackedQuant (its int8 codes tile by tile) when its columns fill tiles;
    otherwise `w` unchanged. On the host."""
    codes = np.asarray(w.codes)
    *lead, nb, bs, N = codes.shape
    if N % PACK_COLUMNS or codes.size == 0:
        return w
    return PackedQuant(jnp.asarray(_tiles(codes, lead)), jnp.asarray(_tiles(w.scale, lead)),
                       None if w.offset is None else jnp.asarray(_tiles(w.offset, lead)), w.shape, 8)


def pack_for_native(w: BlockQuant):
    """`w` in the native kernel's order: 4-bit codes two per byte where they fit, else int8
    codes tile by tile; `w` unchanged where its columns do not fill tiles."""
    packed = pack_nibbles(w)
    return packed if isinstance(packed, PackedQuant) else tile_codes(w)


# Columns per tile of a Q8Tiles weight (blockdot.cc, kQCols): one vector of int32 lanes.
Q8_COLUMNS = 16


@struct.dataclass
class Q8Tiles(Relaid):
    """A BlockQuant's codes for the native kernel's int8-activation path (Engine(matmul="q8")):
    tiles of 16 columns, each a contiguous stream of 64-byte groups in which lane n holds four
    consecutive rows of column n, so that a group meets four int8 activations in one VNNI
    dot product. Codes are stored unsigned, `zero` added (0 for 0..15, 8 for -8..7, 128 for int8).
    The kernel runs it at every number of rows (`any_rows`): a prefill, a verify pass and a
    decode step compute a position alike.

    data: uint8[..., out/16, in/8, 64] (bits 4: byte 4n + i of group g = u(8g + i, n) |
          u(8g + 4 + i, n) << 4) or uint8[..., out/16, in/4, 64] (bits 8: byte 4n + i = u(4g + i, n)).
    scale / offset: float32[..., out/16, in/bs, 16].
    """

    data: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False, default=4)
    zero: int = struct.field(pytree_node=False, default=0)
    any_rows: ClassVar[bool] = True

    def unpacked(self) -> BlockQuant:
        """The same weight as a BlockQuant (one int8 code per weight, row-major)."""
        b = self.data.astype(jnp.int32)  # [..., T, G, 64]
        *lead, T, G, _ = b.shape
        b = b.reshape(*lead, T, G, Q8_COLUMNS, 4)  # [..., T, G, n, i]
        if self.bits == 4:  # rows 8g + i (low nibbles), then 8g + 4 + i (high)
            b = jnp.stack([b & 15, b >> 4], axis=-3)  # [..., T, G, 2, n, i]
            b = jnp.swapaxes(b, -1, -2)  # [..., T, G, 2, i, n]
        else:
            b = jnp.swapaxes(b, -1, -2)  # [..., T, G, i, n]
        codes = (b - self.zero).reshape(*lead, T, -1, Q8_COLUMNS)  # [..., T, K, 16]
        nb = self.scale.shape[-2]
        K = codes.shape[-2]
        rows = lambda a, r: jnp.moveaxis(a.reshape(*lead, T, nb, r, Q8_COLUMNS), -4, -2).reshape(  # noqa: E731
            *lead, nb, r, T * Q8_COLUMNS)
        side = lambda a: None if a is None else rows(a, 1)  # noqa: E731
        return BlockQuant(rows(codes, K // nb).astype(jnp.int8), side(self.scale), side(self.offset), self.shape)


def pack_for_q8(w: BlockQuant):
    """`w` as Q8Tiles for the int8-activation kernel: 4-bit codes two per byte where every code
    fits in 4 bits, else one byte each; `w` unchanged where its shape does not fit the kernel
    (columns not in tiles of 16, a block size not a multiple of 8 (4 for 8-bit codes) that
    neither divides 32 nor is a multiple of it). On the host."""
    codes = np.asarray(w.codes)  # [..., nb, bs, N]
    *lead, nb, bs, N = codes.shape
    if N % Q8_COLUMNS or codes.size == 0 or bs % 4 or (bs % 32 and 32 % bs):
        return w
    lo, hi = int(codes.min()), int(codes.max())
    bits, zero = (4, 0) if 0 <= lo and hi <= 15 else (4, 8) if -8 <= lo and hi <= 7 else (8, 128)
    if bits == 4 and bs % 8:
        bits, zero = 8, 128
    u = (codes.astype(np.int32) + zero).astype(np.uint8).reshape(*lead, nb * bs, N // Q8_COLUMNS, Q8_COLUMNS)
    T, K = N // Q8_COLUMNS, nb * bs
    if bits == 4:
        u = u.reshape(*lead, K // 8, 2, 4, T, Q8_COLUMNS)  # [..., g, h, i, t, n]: row 8g + 4h + i
        u = u[..., 0, :, :, :] | (u[..., 1, :, :, :] << 4)  # [..., g, i, t, n]
    else:
        u = u.reshape(*lead, K // 4, 4, T, Q8_COLUMNS)  # [..., g, i, t, n]: row 4g + i
    n = len(lead)
    data = np.ascontiguousarray(np.transpose(u, (*range(n), n + 2, n, n + 3, n + 1)))  # [..., t, g, n, i]
    data = data.reshape(*lead, T, -1, 64)
    side = lambda a: None if a is None else jnp.asarray(np.ascontiguousarray(np.moveaxis(  # noqa: E731
        np.asarray(a).reshape(*lead, nb, T, Q8_COLUMNS), -2, -3)))
    return Q8Tiles(jnp.asarray(data), side(w.scale), side(w.offset), w.shape, bits, zero)
