"""The Engine's parameters in the native kernel's layouts, packed once per weight.

`pack_params` turns a model's block-quantized stacked layers (and a tile-major copy of its
LM head) into `PackedQuant` (or, for the int8-activation path, `Q8Tiles`); the packed copy
is cached by the identity of the weight it came from and dropped with it, so engines of one
model share it (an audit of 13 methods over a 1.5B + 0.5B pair held 13 copies of both and
ran out of memory).
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp

from specjax.models import quant
from specjax.native._layouts import PackedQuant, Q8Tiles, pack_for_native, pack_for_q8, tile_codes


def pack_params(params, dtype, q8: bool = False):
    """Block codes in the native kernel's order (`PackedQuant`): the stacked layers' codes
    (4-bit ones two per byte), and a tile-major copy of the LM head's codes as `head_tiles` (the
    embedding lookup keeps the table as it is). With `q8`, `Q8Tiles` for the kernel's
    int8-activation path instead, where a weight's shape allows. Float32 models only: the kernel
    computes in float32; bfloat16 activations go to XLA's dot."""
    if not isinstance(params, dict) or "layers" not in params or jnp.dtype(dtype) != jnp.float32:
        return params

    def layer(w):
        q = pack_for_q8(w) if q8 else None
        return q if isinstance(q, Q8Tiles) else pack_for_native(w)

    def head_tiles(head):
        tiles = pack_for_q8(head) if q8 else head
        return tiles if isinstance(tiles, Q8Tiles) else tile_codes(head)

    layers = jax.tree.map(lambda w: _once(layer, w, q8) if isinstance(w, quant.BlockQuant) else w,
                          params["layers"], is_leaf=lambda w: isinstance(w, quant.BlockQuant))
    out = {**params, "layers": layers}
    head = params.get("lm_head", params.get("embed"))
    if isinstance(head, quant.BlockQuant) and head.codes.ndim == 3:
        tiles = _once(head_tiles, head, q8)
        if isinstance(tiles, (PackedQuant, Q8Tiles)):
            out["head_tiles"] = tiles
    return out


# (make, id(weight), q8) -> the packed copy, dropped when the weight is. A cache of host copies
# keyed by what they were made from: it never decides what a traced function computes.
_PACKED: dict[tuple, Any] = {}


def _once(make, w, q8: bool):
    key = (make.__name__, id(w), q8)
    if key not in _PACKED:
        packed = make(w)
        try:
            weakref.finalize(w, _PACKED.pop, key, None)
        except TypeError:  # not weakly referable: not shared
            return packed
        _PACKED[key] = packed
    return _PACKED[key]
