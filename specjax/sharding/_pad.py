"""Head counts made to divide the model axis: zero heads appended (`attention="pad"`), or
each KV head repeated for the chips whose query heads read it (`attention="repeat_kv"`).

SmolLM2 has 9 query / 3 KV heads, which divide no model axis of 2, 4 or 8. Rather
than replicating the attention (and the KV cache) on every device of the model
axis, `pad_heads` appends KV heads with zero K/V weights, each with its group of
Q = H / G query heads with zero Q weights and zero rows of the output projection:

    G' = the smallest multiple of the model axis >= G,   H' = G' * Q

A padded query head scores 0 against every key, attends uniformly to zero values
and contributes exactly 0 through its zero `wo` rows, so the padded model computes
the same function; only the summation order of the output projection changes (as
any tensor-parallel contraction does). The grouping (query head h reads KV head
h // Q) is kept because whole groups are appended after the real ones. The cost:
G'/G times the attention work and cache, split over the model axis.

Wide tensor parallelism (`repeat_kv_heads`, docs/wide_tp.md): with more chips TP on the
model axis than KV heads G (Llama-3.1-70B's 8 KV heads on 16 chips), each chip takes
H / TP query heads and a copy of the one KV head they read. Repeating every KV head
r = G' / G times in place (G' = lcm(G, TP)) does exactly that: query head h reads KV
head h // (H / G') of the repeated model, a copy of its original h // (H / G), so the
function is the same bit for bit; H and G' both divide TP, so the ordinary rules split
the attention, and each chip holds G' / TP KV heads of weights and cache, not all G.
It needs H % G' == 0 (a chip's query heads all read one KV head).

Both work on real models (NumPy or jax arrays) and abstract ones (`jax.ShapeDtypeStruct`
leaves: the shapes change, nothing is allocated).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import quant
from specjax.models.config import Config

if TYPE_CHECKING:  # only named: sharding sits below the loader (tests/test_layering.py)
    from specjax.models.model import Model


def padded_counts(config: Config, model_axis: int) -> tuple[int, int]:
    """(H', G'): head counts padded so that both divide `model_axis`."""
    G = config.num_kv_heads
    G2 = -(-G // model_axis) * model_axis
    return G2 * config.group_size, G2


def _pad_axis(x, axis: int, new: int):
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract model: only the shape grows
        return jax.ShapeDtypeStruct(x.shape[:axis] + (new,) + x.shape[axis + 1:], x.dtype)
    x = np.asarray(x)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, new - x.shape[axis])
    return np.pad(x, widths)


def _pad_float(w, axis: int, new: int):
    return _pad_axis(w, axis, new)


def _pad_quant(w: quant.BlockQuant, head_axis: int, new_heads: int) -> quant.BlockQuant:
    """Pads a block-quantized weight's head dimension (logical axis `head_axis` of `w.shape`)
    with zero codes, scales and offsets (whole blocks: the dequantized weight is 0 there)."""
    shape = list(w.shape)
    n_in = w.codes.shape[-3] * w.codes.shape[-2]
    split = next(i for i in range(1, len(shape)) if int(np.prod(shape[:i])) == n_in)
    old = shape[head_axis]
    shape[head_axis] = new_heads
    if head_axis < split:  # heads among the inputs: whole blocks of the block axis
        if head_axis != 0:
            raise ValueError(f"cannot pad heads at input axis {head_axis} of a quantized weight {w.shape}")
        per_head = n_in // old
        bs = w.codes.shape[-2]
        if per_head % bs:
            raise ValueError(f"a head ({per_head} inputs) is not a whole number of {bs}-blocks: "
                             "quantized heads cannot be padded; use attention='replicate'")
        blocks = new_heads * per_head // bs
        pad = lambda a: None if a is None else _pad_axis(a, a.ndim - 3, blocks)  # noqa: E731
    else:  # heads among the outputs: the last axis, flattened (heads, head_dim)
        n_out = w.codes.shape[-1]
        if head_axis != split:
            raise ValueError(f"cannot pad heads at output axis {head_axis} of a quantized weight {w.shape}")
        outs = new_heads * (n_out // old)
        pad = lambda a: None if a is None else _pad_axis(a, a.ndim - 1, outs)  # noqa: E731
    return quant.BlockQuant(pad(w.codes), pad(w.scale), pad(w.offset), tuple(shape))


# (parameter, index of the head axis in the per-layer logical shape, "q" or "kv")
_HEAD_PARAMS = (("wq", 1, "q"), ("wk", 1, "kv"), ("wv", 1, "kv"), ("wo", 0, "q"),
                ("bq", 0, "q"), ("bk", 0, "kv"), ("bv", 0, "kv"))


def pad_heads(model: Model, model_axis: int) -> Model:
    """`model` with zero heads appended so that H and G divide `model_axis` (itself if they do)."""
    c = model.config
    H2, G2 = padded_counts(c, model_axis)
    if (H2, G2) == (c.num_heads, c.num_kv_heads):
        return model
    layers = dict(model.params["layers"])
    for name, axis, kind in _HEAD_PARAMS:
        if name not in layers:
            continue
        new = H2 if kind == "q" else G2
        w = layers[name]
        layers[name] = _pad_quant(w, axis, new) if isinstance(w, quant.BlockQuant) else _pad_float(w, axis + 1, new)
    config = dataclasses.replace(c, num_heads=H2, num_kv_heads=G2)
    return model.with_params({**model.params, "layers": layers}, config=config,
                             name=f"{model.name}+pad{H2}/{G2}" if model.name else model.name)


# --- KV heads repeated (wide tensor parallelism) --------------------------------------


def repeated_kv_heads(config: Config, model_axis: int) -> int | None:
    """G' = lcm(G, model_axis), the KV heads of the repeated model, or None where it cannot
    be placed: a chip's H / model_axis query heads must all read one KV head (H % G' == 0)."""
    G = config.num_kv_heads
    G2 = np.lcm(G, model_axis).item()
    return G2 if config.num_heads % G2 == 0 else None


def _repeat(x, axis: int, r: int, unit: int = 1):
    """`x` with each block of `unit` entries along `axis` repeated `r` times in place
    (unit: the flattened (heads, head_dim) axis of a quantized weight repeats whole heads)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[:axis] + (x.shape[axis] * r,) + x.shape[axis + 1:], x.dtype)
    xp = jnp if isinstance(x, jax.Array) else np  # a placed array stays on its devices
    x = x if xp is jnp else np.asarray(x)
    axis %= x.ndim
    n = x.shape[axis] // unit
    split = xp.reshape(x, x.shape[:axis] + (n, unit) + x.shape[axis + 1:])
    return xp.reshape(xp.repeat(split, r, axis=axis), x.shape[:axis] + (n * r * unit,) + x.shape[axis + 1:])


def _repeat_quant(w: quant.BlockQuant, head_axis: int, r: int) -> quant.BlockQuant:
    """A block-quantized wk / wv [D, G, Dh]: the KV heads are outputs, the last axis of its
    codes and scales flattened as (G, Dh); whole heads are repeated, codes and scales alike."""
    shape = list(w.shape)
    n_in = w.codes.shape[-3] * w.codes.shape[-2]
    split = next(i for i in range(1, len(shape)) if int(np.prod(shape[:i])) == n_in)
    if head_axis != split:
        raise ValueError(f"cannot repeat KV heads at axis {head_axis} of a quantized weight {w.shape}")
    unit = w.codes.shape[-1] // shape[head_axis]
    shape[head_axis] *= r
    rep = lambda a: None if a is None else _repeat(a, -1, r, unit)  # noqa: E731
    return quant.BlockQuant(rep(w.codes), rep(w.scale), rep(w.offset), tuple(shape))


_KV_PARAMS = tuple((name, axis) for name, axis, kind in _HEAD_PARAMS if kind == "kv")


def repeat_kv_heads(model: Model, model_axis: int) -> Model:
    """`model` with every KV head repeated G' / G times (G' = lcm(G, model_axis)) so that
    each chip of a model axis wider than G holds the KV head its query heads read; the same
    tokens. Raises ValueError when H does not allow it (`repeated_kv_heads` is None)."""
    c = model.config
    G2 = repeated_kv_heads(c, model_axis)
    if G2 is None:
        raise ValueError(f"{model.name or 'model'}: {c.num_heads} query heads / {c.num_kv_heads} KV heads cannot "
                         f"be placed on a model axis of {model_axis}: each chip would hold "
                         f"{c.num_heads}/{model_axis} query heads, which must be a whole number reading one KV "
                         f"head (needs {c.num_heads} % lcm({c.num_kv_heads}, {model_axis}) == 0); "
                         "use attention='pad' or 'replicate'")
    r = G2 // c.num_kv_heads
    if r == 1:
        return model
    layers = dict(model.params["layers"])
    for name, axis in _KV_PARAMS:
        if name in layers:
            w = layers[name]
            layers[name] = _repeat_quant(w, axis, r) if isinstance(w, quant.BlockQuant) else _repeat(w, axis + 1, r)
    config = dataclasses.replace(c, num_kv_heads=G2)
    return model.with_params({**model.params, "layers": layers}, config=config,
                             name=f"{model.name}+kv{G2}" if model.name else model.name)
