"""Per-shard loading: each process reads only the parts of a checkpoint that its devices hold.

`lazy_params(path)` describes the parameter tree that `convert.build_params` makes (the same
tree, leaf for leaf) without reading a weight: every leaf is a `Lazy`, its shape and dtype and
how to read any region of it. `place(lazy, shardings)` builds each array with
`jax.make_array_from_callback`, so a process reads only the regions of its own devices:

- safetensors: `safe_open(...).get_slice(name)[rows, cols]` of the transformers [out, in]
  tensor that the region of our [*in, *out] layout comes from, per stacked layer;
- GGUF: row and block ranges of the tensor in the reader's memory map, dequantized (or their
  block codes extracted, `quant.extract_codes`, for the layer weights, the embedding and the head
  that stay block-quantized) after slicing. GGUF's formats and our transposes,
  stacking and rebinning act element by element or block by block, so the values are those of the
  whole-tensor path, bit for bit (llama.cpp's RoPE row order is undone per head, and a region is
  widened to whole heads and whole GGUF blocks before it is trimmed).

A region is read at the granularity of the first dimension of each group of the torch tensor's
flattened axes (heads for [D, H, Dh], rows of the head): the rest is sliced after reading. Our
sharding rules split only those first dimensions, so nothing beyond the region is read then.

`repeat_kv(lazy, r)` lays the KV projections out as `sharding.repeat_kv_heads` repeats them
(wide tensor parallelism, docs/wide_tp.md): KV head j of the result is the file's head j // r,
and a region reads only the file's heads it covers, each once per `place` however many of this
process's devices hold a copy of it.

`BYTES_READ` counts the checkpoint bytes this process has read, by what they were read for
("layers" for the per-layer tensors, "other" for the embedding, head and final norm).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
from typing import Callable

import jax
import numpy as np

from specjax.models import config as config_lib
from specjax.models import convert, quant
from specjax.models.config import Config

BYTES_READ: collections.Counter = collections.Counter()  # {"layers": n, "other": n}


@dataclasses.dataclass(frozen=True, eq=False)
class Lazy:
    """A parameter not read yet: `read(index)` gives the region `index` (a tuple of slices, as
    `jax.make_array_from_callback` passes it) as a host array of `dtype`."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[tuple], np.ndarray]

    def abstract(self, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)


def abstract(lazy_tree):
    """The tree as `jax.ShapeDtypeStruct`s (what the sharding plan needs)."""
    return jax.tree.map(lambda x: x.abstract(), lazy_tree)


def place(lazy_tree, shardings):
    """Global arrays of `lazy_tree` at `shardings` (a matching tree of shardings); this process
    reads the regions of its addressable devices, each region once."""
    out = jax.tree.map(_place_one, lazy_tree, shardings)
    for group in _groups(lazy_tree):
        group.clear()
    return out


def _place_one(x: Lazy, sharding):
    done = {}

    def region(index):
        key = _key(index, x.shape)
        if key not in done:  # devices that hold the same region (replicas) share one read
            done[key] = x.read(tuple(slice(a, b) for a, b in key))
        return done[key]

    return jax.make_array_from_callback(x.shape, sharding, region)


def _key(index, shape) -> tuple[tuple[int, int], ...]:
    key = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided region {index} is not supported")
        key.append((start, stop))
    return tuple(key)


def _groups(tree):
    seen = {}
    for x in jax.tree.leaves(tree):
        group = getattr(x.read, "group", None)
        if group is not None:
            seen[id(group)] = group
    return seen.values()


# --- checkpoint tensors in transformers' [out, in] layout, read by region -------------


class _SafetensorsTensor:
    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(int(n) for n in self._slice.get_shape())

    def floats(self, rows, cols, what) -> np.ndarray:
        index = (slice(*rows),) if len(self.shape) == 1 else (slice(*rows), slice(*cols))
        x = self._slice[index]  # numpy (bfloat16 through ml_dtypes): no device copy
        BYTES_READ[what] += x.nbytes
        return np.asarray(x, np.float32)


class _GGUFTensor:
    """A GGUF tensor; `rope_heads`: llama.cpp's interleaved RoPE rows are undone per head."""

    def __init__(self, t, rope_heads: int | None):
        import gguf

        self.t, self.qtype, self.rope_heads = t, t.tensor_type, rope_heads
        self.shape = tuple(int(n) for n in reversed([int(n) for n in t.shape]))
        self.block, self.type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        self.quantized = quant.supports(self.qtype)
        if self.quantized:
            self.sub, self.has_offset = _code_layout(self.qtype)

    def _rows(self, rows):
        if not self.rope_heads:
            return rows, (0, rows[1] - rows[0])
        per = self.shape[0] // self.rope_heads  # whole heads: the permutation stays inside one
        wide = (rows[0] // per * per, -(-rows[1] // per) * per)
        return wide, (rows[0] - wide[0], rows[1] - wide[0])

    def _raw(self, rows, cols, what):
        """The bytes of rows x whole blocks covering cols, copied out of the memory map."""
        data = self.t.data
        if len(self.shape) == 1:
            if self.block != 1:  # a block-quantized vector: small, read whole
                raw = np.array(data)
                BYTES_READ[what] += raw.nbytes
                return raw, (rows[0], rows[1])
            raw = np.array(data[rows[0]:rows[1]])
            BYTES_READ[what] += raw.nbytes
            return raw, (0, rows[1] - rows[0])
        units = data.shape[-1] * self.block // self.shape[1]  # storage units per block
        b0, b1 = cols[0] // self.block, -(-cols[1] // self.block)
        raw = np.array(data[rows[0]:rows[1], b0 * units:b1 * units])
        BYTES_READ[what] += raw.nbytes
        return raw, (cols[0] - b0 * self.block, cols[1] - b0 * self.block)

    def floats(self, rows, cols, what) -> np.ndarray:
        import gguf

        wide, keep = self._rows(rows)
        raw, trim = self._raw(wide, cols, what)
        x = gguf.quants.dequantize(raw, self.qtype).astype(np.float32)
        x = x[trim[0]:trim[1]] if x.ndim == 1 else x[:, trim[0]:trim[1]]
        if self.rope_heads:
            x = convert._unpermute_rope_rows(x, len(x) * self.rope_heads // self.shape[0])
        return x[keep[0]:keep[1]]

    def blocks(self, rows, cols, bs: int, with_offset: bool, what):
        """(codes int8[r, c], scale f32[r, c/bs], offset or None) of rows x cols, in blocks of bs
        (a divisor of this type's code block: scales repeated, as `quant.stack_layers` does)."""
        wide, keep = self._rows(rows)
        raw, trim = self._raw(wide, cols, what)
        rb = quant.extract_codes(raw, self.qtype)
        if self.rope_heads:
            rb = convert._unpermute_rope_rows(rb, rb.codes.shape[0] * self.rope_heads // self.shape[0])
        rep = rb.block_size // bs
        scale = np.repeat(rb.scale, rep, axis=1)
        offset = (np.repeat(rb.offset, rep, axis=1) if rb.offset is not None
                  else np.zeros_like(scale) if with_offset else None)
        r, c = slice(*keep), slice(trim[0], trim[1])
        cb = slice(trim[0] // bs, trim[1] // bs)
        return rb.codes[r, c], scale[r, cb], None if offset is None else offset[r, cb]


def _code_layout(qtype) -> tuple[int, bool]:
    """(sub-block size of the scales, whether there is an offset) of a supported GGUF type."""
    legacy = quant._gguf_types()
    if qtype in legacy:
        import gguf

        return gguf.GGML_QUANT_SIZES[qtype][0], legacy[qtype]
    sub, _, offset_probe = quant._k_probes()[qtype]
    return sub, offset_probe is not None


# --- our leaves from those tensors -----------------------------------------------------


def _ranges(key):
    return [slice(a, b) for a, b in key]


def _group_rows(slices, dims) -> tuple[tuple[int, int], int, tuple]:
    """Flat [start, stop) of a row-major group of dims selected at the granularity of its first
    dim; the first dim's count; the slices of the rest (applied after reading)."""
    rest = math.prod(dims[1:])
    first = slices[0]
    return (first.start * rest, first.stop * rest), first.stop - first.start, tuple(slices[1:])


def _linear(tensors, in_shape, out_shape, dtype, what) -> Lazy:
    """Our [L, *in, *out] (or [*in, *out] for one tensor) from torch [out, in] tensors."""
    stacked = isinstance(tensors, list)
    shape = ((len(tensors),) if stacked else ()) + tuple(in_shape) + tuple(out_shape)

    def read(index):
        s = _ranges(_key(index, shape))
        lead, ins, outs = s[:stacked], s[stacked:stacked + len(in_shape)], s[stacked + len(in_shape):]
        cols, n_in, in_rest = _group_rows(ins, in_shape)
        rows, n_out, out_rest = _group_rows(outs, out_shape)

        def one(t):
            x = t.floats(rows, cols, what).T.reshape(n_in, *in_shape[1:], n_out, *out_shape[1:])
            return x[(slice(None), *in_rest, slice(None), *out_rest)]

        x = np.stack([one(tensors[i]) for i in range(lead[0].start, lead[0].stop)]) if stacked else one(tensors)
        return np.ascontiguousarray(x).astype(dtype)

    return Lazy(shape, np.dtype(dtype), read)


def _vector(tensors, vshape, dtype, what) -> Lazy:
    stacked = isinstance(tensors, list)
    shape = ((len(tensors),) if stacked else ()) + tuple(vshape)

    def read(index):
        s = _ranges(_key(index, shape))
        rows, n, rest = _group_rows(s[stacked:], vshape)

        def one(t):
            return t.floats(rows, None, what).reshape(n, *vshape[1:])[(slice(None), *rest)]

        x = np.stack([one(tensors[i]) for i in range(s[0].start, s[0].stop)]) if stacked else one(tensors)
        return x.astype(dtype)

    return Lazy(shape, np.dtype(dtype), read)


class _QuantGroup:
    """The codes, scale and offset of one block-quantized weight (stacked layers, or one tensor:
    the embedding / head) come from one extraction per region; kept until `clear` (the end of
    `place`)."""

    def __init__(self, tensors, bs, with_offset, what):
        self.tensors, self.bs, self.with_offset, self.what, self.memo = tensors, bs, with_offset, what, {}

    def region(self, layers, blocks, rows):
        key = (layers, blocks, rows)
        if key not in self.memo:
            ts = self.tensors if layers is None else self.tensors[layers[0]:layers[1]]
            parts = [t.blocks(rows, (blocks[0] * self.bs, blocks[1] * self.bs), self.bs, self.with_offset,
                              self.what) for t in ts]
            # torch [rows, cols] -> ours: codes [cols/bs, bs, rows], scale/offset [cols/bs, 1, rows]
            codes = np.stack([c.reshape(c.shape[0], -1, self.bs).transpose(1, 2, 0) for c, _, _ in parts])
            side = lambda i: None if parts[0][i] is None else np.stack(  # noqa: E731
                [p[i].T[:, None, :] for p in parts])
            arrays = (codes, side(1), side(2))
            if layers is None:  # one tensor: no layer axis
                arrays = tuple(None if a is None else a[0] for a in arrays)
            self.memo[key] = arrays
        return self.memo[key]

    def clear(self):
        self.memo.clear()


def _quant_linear(tensors, in_shape, out_shape, what="layers") -> quant.BlockQuant:
    """A BlockQuant of Lazy codes/scale/offset: stacked as `quant.stack_layers` stacks a list of
    layer tensors, or one tensor as `quant.RawBlocks.as_linear` lays it out (the embedding / head)."""
    stacked = isinstance(tensors, list)
    ts = tensors if stacked else [tensors]
    bs = math.gcd(*[t.sub for t in ts])
    with_offset = any(t.has_offset for t in ts)
    group = _QuantGroup(ts, bs, with_offset, what)
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    lead = (len(ts),) if stacked else ()

    def leaf(which, shape, dtype):
        def read(index):
            key = _key(index, shape)
            layers, (blocks, inner, outs) = (key[0], key[1:]) if stacked else (None, key)
            arrays = group.region(layers, blocks, outs)
            return arrays[which][..., inner[0]:inner[1], :]

        read.group = group
        return Lazy(shape, np.dtype(dtype), read)

    side = (*lead, n_in // bs, 1, n_out)
    return quant.BlockQuant(leaf(0, (*lead, n_in // bs, bs, n_out), np.int8), leaf(1, side, np.float32),
                            leaf(2, side, np.float32) if with_offset else None,
                            (*in_shape, *out_shape))


def _tree(c: Config, tensor, where: Callable[[str], str], missing: Callable[[str], Exception], dtype,
          quantized: Callable[[list], bool]) -> dict:
    """The lazy tree, leaf for leaf the tree of `convert.build_params` (both follow
    `convert.param_spec`); `tensor(hf_name)` opens a checkpoint tensor (KeyError when missing).
    Errors name the file: `where(hf_name)` holds the tensor, `missing(hf_name)` is the error for
    one the file lacks (as the whole-model loaders raise it, with the nearest names)."""

    def fetch(name, shape):
        try:
            t = tensor(name)
        except KeyError:
            raise missing(name) from None
        if t.shape != shape:
            raise convert.shape_error(where(name), name, t.shape, shape)
        return t

    def make(leaf: convert.Leaf):
        what = "layers" if leaf.stacked else "other"  # the embedding, head and final norm: "other"
        ts = [fetch(n, leaf.torch_shape) for n in leaf.names(c)]
        arg = ts if leaf.stacked else ts[0]
        if leaf.kind == "vector":
            return _vector(arg, leaf.in_shape, dtype, what)
        if quantized(ts):  # block-quantized: the layers as stacked, the embedding / head as one tensor
            return _quant_linear(arg, leaf.in_shape, leaf.out_shape, what)
        return _linear(arg, leaf.in_shape, leaf.out_shape, dtype, what)

    return convert.map_spec(c, make)


# --- KV heads repeated (wide tensor parallelism) ----------------------------------------

# The KV head axis of each KV leaf in our stacked layout: wk / wv [L, D, G, Dh], bk / bv [L, G, Dh]
_KV_HEAD_AXES = {"wk": 2, "wv": 2, "bk": 1, "bv": 1}


class _Reads:
    """The file's regions read for one repeated leaf, kept until `clear` (the end of `place`):
    the devices holding copies of one KV head share one read. `clear` also clears the group of
    the leaf it wraps (a block-quantized weight's shared extraction)."""

    def __init__(self, inner):
        self.inner, self.memo = inner, {}

    def clear(self):
        self.memo.clear()
        if self.inner is not None:
            self.inner.clear()


def _repeated(x: Lazy, axis: int, r: int, unit: int) -> Lazy:
    """`x` with each block of `unit` entries along `axis` (a head) repeated r times in place, as
    `np.repeat` of the heads does (block j of the result is the file's block j // r)."""
    axis %= len(x.shape)
    shape = x.shape[:axis] + (x.shape[axis] * r,) + x.shape[axis + 1:]
    reads = _Reads(getattr(x.read, "group", None))

    def read(index):
        key = _key(index, shape)
        a, b = key[axis]
        h0, h1 = a // unit // r, max(b - 1, a) // unit // r + 1  # the file's heads the region covers
        inner = _key(tuple(slice(*k) for k in key[:axis]) + (slice(h0 * unit, h1 * unit),)
                     + tuple(slice(*k) for k in key[axis + 1:]), x.shape)
        if inner not in reads.memo:
            reads.memo[inner] = x.read(tuple(slice(*k) for k in inner))
        part = reads.memo[inner]
        heads = part.reshape(part.shape[:axis] + (h1 - h0, unit) + part.shape[axis + 1:])
        part = np.repeat(heads, r, axis=axis).reshape(part.shape[:axis] + (-1,) + part.shape[axis + 1:])
        start = h0 * r * unit
        return np.ascontiguousarray(part[(slice(None),) * axis + (slice(a - start, b - start),)])

    read.group = reads
    return Lazy(shape, x.dtype, read)


def repeat_kv(lazy_tree, r: int):
    """The lazy tree with every KV head of wk / wv (and bk / bv) repeated r times in place, in the
    order of `sharding.repeat_kv_heads`; `lazy_tree` itself when r == 1. A block-quantized wk / wv
    ([D, G, Dh] with (G, Dh) flattened on the codes' and scales' last axis) repeats whole heads."""
    if r == 1:
        return lazy_tree
    layers = dict(lazy_tree["layers"])
    for name, axis in _KV_HEAD_AXES.items():
        if name not in layers:
            continue
        w = layers[name]
        if isinstance(w, quant.BlockQuant):
            D, G, Dh = w.shape
            rep = lambda a: None if a is None else _repeated(a, -1, r, Dh)  # noqa: E731
            layers[name] = quant.BlockQuant(rep(w.codes), rep(w.scale), rep(w.offset), (D, G * r, Dh))
        else:
            layers[name] = _repeated(w, axis, r, 1)
    return {**lazy_tree, "layers": layers}


# --- the two formats ----------------------------------------------------------------------


def lazy_hf_dir(path, dtype=np.float32):
    """(Config, lazy tree) of a directory with config.json and safetensors (as `convert.load_hf_dir`)."""
    path = pathlib.Path(path)
    convert.check_ours(path)
    c = convert.config_from_json(path / "config.json")
    weight_map = convert.safetensors_weight_map(path)
    handles = {}

    def tensor(name):
        shard = weight_map[name]
        if shard not in handles:
            handles[shard] = convert.open_safetensors(path / shard)
        return _SafetensorsTensor(handles[shard], name)

    listing = path / ("model.safetensors.index.json" if (path / "model.safetensors.index.json").is_file()
                      else "model.safetensors")
    tree = _tree(c, tensor, lambda name: str(path / weight_map.get(name, listing)),
                 lambda name: convert.missing_tensor(listing, name, {n: n for n in weight_map}, c),
                 dtype, quantized=lambda ts: False)
    if c.tie_embeddings:
        weight_map.pop("lm_head.weight", None)
    unknown = sorted(set(weight_map) - set(convert.expected_tensors(c)) - {"lm_head.weight"})
    if unknown:
        raise config_lib.ConfigError(path, f"unsupported tensor(s): {', '.join(unknown[:5])}")
    return c, tree


def lazy_gguf(path, dtype=np.float32, *, keep_quantized: bool = True):
    """(Config, lazy tree) of a GGUF file (as `convert.load_gguf`): the reader memory-maps the file;
    nothing but the metadata (and a rope_freqs vector) is read here."""
    reader = convert.open_gguf(path)
    c, _ = convert.gguf_config(reader, path)
    by_hf = convert.gguf_tensors(reader, c, path)
    permute = c.architecture == "llama"

    def tensor(hf_name):
        heads = None
        if permute and (hf_name.endswith("q_proj.weight") or hf_name.endswith("q_proj.bias")):
            heads = c.num_heads
        elif permute and (hf_name.endswith("k_proj.weight") or hf_name.endswith("k_proj.bias")):
            heads = c.num_kv_heads
        return _GGUFTensor(by_hf[hf_name], heads)

    # as convert.load_gguf: weight matrices (layers, embedding, head) stay block-quantized when
    # every layer's type (the tensor's, for the embedding / head) is supported
    tree = _tree(c, tensor, lambda name: str(path),
                 lambda name: convert.missing_tensor(path, name, {hf: t.name for hf, t in by_hf.items()}, c),
                 dtype, quantized=lambda ts: keep_quantized and all(t.quantized for t in ts))
    return c, tree
