"""Checkpoint conversion: GGUF and HF safetensors tensors -> our parameter tree.

Both loaders name tensors in transformers' layout (torch Linear weights are
[out, in]) and hand them to `build_params`. `param_spec` is the one place that
maps checkpoint tensors to our tree (see `llama.Transformer`); `shards` reads
the same leaves by region from it. Every damaged or inconsistent input is a
`LoadError` naming the file (`_files`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable

import numpy as np

from specjax._files import LoadError
from specjax.models import config as config_lib
from specjax.models import quant
from specjax.models.config import Config


class CheckpointError(LoadError):
    """A checkpoint file that is not what it claims: unreadable, truncated, or with non-finite weights."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the config needs is not in the checkpoint (a KeyError too, as it always was)."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is not there (a FileNotFoundError too, as it always was)."""


def read_json(path: pathlib.Path) -> Any:
    """json.loads of a file, with an error that names the file."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MissingFileError(path, "no such file") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"not valid JSON: not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise CheckpointError(path, f"not valid JSON ({e}): damaged or truncated") from None


def config_from_json(path: pathlib.Path) -> Config:
    """The Config of a Hugging Face config.json, every error naming the file (a missing key too)."""
    d = read_json(path)
    if not isinstance(d, dict):
        raise CheckpointError(path, f"a JSON {type(d).__name__}, not an object of config fields")
    try:
        return config_lib.from_hf_dict(d)
    except LoadError as e:
        raise e.with_path(path) from e.__cause__


def open_gguf(path):
    """A gguf.GGUFReader, with an error that names the file when it is empty, truncated or not a GGUF."""
    import gguf

    path = pathlib.Path(path)
    if not path.is_file():
        raise MissingFileError(path, "GGUF file not found")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(path, "empty (0 bytes), not a GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the library fails deep inside (reshape, struct, mmap errors)
        raise CheckpointError(path, f"not a readable GGUF file of {size} bytes, or truncated "
                                    f"({type(e).__name__}: {e})") from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(path, f"truncated: its tensors need {end} bytes, the file has {size}")
    return reader


def gguf_config(reader, path) -> tuple[Config, dict]:
    """(Config, decoded metadata) of an open GGUF, every error naming the file."""
    import gguf

    try:
        fields = gguf_fields(reader)
        names = [t.name for t in reader.tensors]
        rope_freqs = None
        if "rope_freqs.weight" in names:
            t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
            rope_freqs = gguf.quants.dequantize(t.data, t.tensor_type)
        return config_lib.from_gguf_fields(fields, tensor_names=names, rope_freqs=rope_freqs), fields
    except LoadError as e:
        raise e.with_path(path) from e.__cause__
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as e:  # damaged metadata
        raise CheckpointError(path, f"unreadable GGUF metadata ({type(e).__name__}: {e})") from e


def open_safetensors(path, framework: str = "numpy"):
    """safetensors.safe_open, with an error naming the file (damaged header, truncated file)."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    if not path.is_file():
        raise MissingFileError(path, "no such file")
    try:
        return safe_open(str(path), framework=framework)
    except Exception as e:  # SafetensorError: "invalid JSON in header", "header too small", ...
        why = str(e).removeprefix("Error while deserializing header: ")
        raise CheckpointError(path, f"not a readable safetensors file ({why}): damaged or truncated") from e


# Beyond float16's range: no weight of a working checkpoint (its GGUF block scales are float16).
_MAX_WEIGHT = 65504.0


def check_tensor(name: str, w, source: str):
    """Refuses non-finite or absurdly large weights (a corrupt block scale), naming the tensor; returns w."""
    if isinstance(w, quant.RawBlocks):
        parts = [("scale", np.asarray(w.scale))] + ([] if w.offset is None else [("offset", np.asarray(w.offset))])
        peak = float(np.abs(parts[0][1]).max(initial=0)) * float(np.abs(np.asarray(w.codes)).max(initial=0))
        peak += 0.0 if w.offset is None else float(np.abs(parts[1][1]).max(initial=0))
    else:
        parts = [("values", np.asarray(w))]
        peak = None
    for what, a in parts:
        if not np.isfinite(a).all():
            raise CheckpointError(source, f"tensor {name!r} has non-finite {what} "
                                          f"({int((~np.isfinite(a)).sum())} of {a.size}): the file is corrupt")
    if peak is None:
        peak = float(np.abs(parts[0][1]).max(initial=0))
    if peak > _MAX_WEIGHT:
        raise CheckpointError(source, f"tensor {name!r} has weights up to {peak:.3g}, beyond any working "
                                      f"checkpoint's (|w| <= {_MAX_WEIGHT:g}): a corrupt block scale?")
    return w


@dataclasses.dataclass(frozen=True)
class Leaf:
    """How one leaf of our parameter tree comes from the checkpoint's tensors (transformers names
    and layout): the one place that maps checkpoints to our tree (`llama.Transformer`), used by
    `build_params` here and by `shards` (which reads the same leaves by region).

    kind "linear": ours [*in_shape, *out_shape] from torch [out, in]; "vector": [*in_shape] from
    a flat vector. `stacked`: one tensor per layer (`name` is the part after
    `model.layers.{i}.`), stacked on a leading layer axis; otherwise one tensor named `name`."""

    kind: str
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...] = ()
    stacked: bool = True

    @property
    def torch_shape(self) -> tuple[int, ...]:
        n_in = int(np.prod(self.in_shape))
        return (n_in,) if self.kind == "vector" else (int(np.prod(self.out_shape)), n_in)

    def names(self, c: Config) -> list[str]:
        return [f"model.layers.{i}.{self.name}" for i in range(c.num_layers)] if self.stacked else [self.name]


def param_spec(c: Config) -> dict:
    """Our parameter tree with a `Leaf` at every leaf."""
    D, H, G, Dh, F, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size
    layers = {
        "attn_norm": {"scale": Leaf("vector", "input_layernorm.weight", (D,))},
        "mlp_norm": {"scale": Leaf("vector", "post_attention_layernorm.weight", (D,))},
        "wq": Leaf("linear", "self_attn.q_proj.weight", (D,), (H, Dh)),
        "wk": Leaf("linear", "self_attn.k_proj.weight", (D,), (G, Dh)),
        "wv": Leaf("linear", "self_attn.v_proj.weight", (D,), (G, Dh)),
        "wo": Leaf("linear", "self_attn.o_proj.weight", (H, Dh), (D,)),
        "w_gate": Leaf("linear", "mlp.gate_proj.weight", (D,), (F,)),
        "w_up": Leaf("linear", "mlp.up_proj.weight", (D,), (F,)),
        "w_down": Leaf("linear", "mlp.down_proj.weight", (F,), (D,)),
    }
    if c.qkv_bias:
        layers["bq"] = Leaf("vector", "self_attn.q_proj.bias", (H, Dh))
        layers["bk"] = Leaf("vector", "self_attn.k_proj.bias", (G, Dh))
        layers["bv"] = Leaf("vector", "self_attn.v_proj.bias", (G, Dh))
    params = {
        "embed": Leaf("linear", "model.embed_tokens.weight", (D,), (V,), stacked=False),  # [V, D] -> [D, V]
        "layers": layers,
        "final_norm": {"scale": Leaf("vector", "model.norm.weight", (D,), stacked=False)},
    }
    if not c.tie_embeddings:
        params["lm_head"] = Leaf("linear", "lm_head.weight", (D,), (V,), stacked=False)
    return params


def map_spec(c: Config, make: Callable[[Leaf], Any]) -> dict:
    """`param_spec(c)` with `make(leaf)` at every leaf, in the tree's order."""
    def walk(tree):
        return {k: walk(v) if isinstance(v, dict) else make(v) for k, v in tree.items()}

    return walk(param_spec(c))


def expected_tensors(c: Config) -> list[str]:
    names = []
    map_spec(c, lambda leaf: names.extend(leaf.names(c)))
    return names


def missing_tensor(source, name: str, present: dict[str, str], c: Config) -> MissingTensorError:
    """A tensor the config needs that the file `source` lacks, with the file's names nearest to it
    among those the config does not use (`present`: our name -> the file's own, e.g. a GGUF's
    blk.0.ffn_up.weight): a renamed or misnumbered tensor shows up beside the one expected."""
    import difflib

    used = set(expected_tensors(c))
    near = difflib.get_close_matches(name, [n for n in present if n not in used], n=3, cutoff=0.8)
    hint = f"; nearest in the file: {', '.join(repr(present[n]) for n in near)}" if near else ""
    return MissingTensorError(source, f"missing tensor {name!r}, which the config needs{hint}")


def shape_error(source: str, name: str, got, want) -> CheckpointError:
    return CheckpointError(source, f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)} from the "
                                   "config: the weights and config.json (or the GGUF metadata) disagree")


def build_params(c: Config, get: Callable[[str], Any], source: str | Callable[[str], str]) -> dict:
    """Our parameter tree from a `get(hf_name)` accessor returning an array in transformers'
    layout, or `quant.RawBlocks` for a block-quantized GGUF tensor (kept quantized). `source`:
    the file errors name, or a function of the tensor's name giving it (a sharded checkpoint).
    `get` raises KeyError for a missing tensor, or its own MissingTensorError."""
    where = source if callable(source) else (lambda name: source)

    def fetch(name, shape):
        try:
            x = get(name)
        except MissingTensorError:
            raise
        except KeyError:
            raise MissingTensorError(where(name), f"missing tensor {name!r}") from None
        if not isinstance(x, quant.RawBlocks):
            x = np.asarray(x, np.float32)
        if tuple(x.shape) != shape:
            raise shape_error(where(name), name, x.shape, shape)
        return x

    def make(leaf: Leaf):
        def one(name):
            x = fetch(name, leaf.torch_shape)
            if leaf.kind == "vector":
                return x.reshape(leaf.in_shape)
            shape = (*leaf.in_shape, *leaf.out_shape)  # torch [out, in] -> ours [*in, *out]
            if isinstance(x, quant.RawBlocks):
                return x.as_linear(shape)
            return x.T.reshape(shape) if leaf.stacked else np.ascontiguousarray(x.T).reshape(shape)

        names = leaf.names(c)
        return quant.stack_layers([one(n) for n in names]) if leaf.stacked else one(names[0])

    return map_spec(c, make)


# --- GGUF -------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute_rope_rows(w, num_heads: int):
    # llama.cpp's converter interleaves each head's two RoPE halves (for its adjacent-pair
    # rotation); transformers rotates halves (rotate_half). Undo: rows [h, Dh/2, 2] -> [h, 2, Dh/2].
    rows = w.shape[0]
    perm = np.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return w.permute_rows(perm) if isinstance(w, quant.RawBlocks) else w[perm]


def gguf_tensors(reader, c: Config, path) -> dict:
    """{transformers name: GGUF tensor}; a tensor this decoder has no use for is refused, named."""
    by_hf = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is None and t.name != "rope_freqs.weight":
            raise config_lib.ConfigError(path, f"unsupported tensor {t.name!r} (not part of a "
                                               f"{c.architecture} decoder this library implements)")
        if hf is not None:
            by_hf[hf] = t
    return by_hf


def gguf_fields(reader) -> dict:
    """Decoded GGUF metadata {key: python value}."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def load_gguf(path: str | pathlib.Path, *, keep_quantized: bool = True, reader=None):
    """(Config, params, metadata) from a GGUF file.

    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weight matrices (layers, embedding, LM head) stay
    block-quantized (`quant.BlockQuant`, bit-identical values) when `keep_quantized`; every
    other tensor is dequantized to float32 by gguf.quants. `reader`: the file's `open_gguf`,
    when the caller has one (parsing a GGUF's metadata costs seconds: its tokenizer's fields).
    """
    import gguf  # the format library: parsing and dequantization

    reader = open_gguf(path) if reader is None else reader
    c, fields = gguf_config(reader, path)
    by_hf = gguf_tensors(reader, c, path)
    permute = c.architecture == "llama"

    def get(hf_name):
        t = by_hf[hf_name]
        # Layer weights, the embedding and the LM head stay quantized: inside the layer scan XLA
        # dequantizes each layer's blocks into a buffer that the matmul reads (measured 1.4-1.6x
        # faster than float32 weights on CPU); on the CPU the head is read a vocabulary chunk at
        # a time inside its own scan (`quant.matmul_columns`), since an unscanned dequantization
        # fused into the dot becomes a slow naive loop (measured 10x slower).
        matrix = hf_name.endswith(".weight") and "norm" not in hf_name
        if keep_quantized and matrix and quant.supports(t.tensor_type):
            try:
                w = quant.extract_codes(t.data, t.tensor_type)
            except ValueError as e:  # codes and scales that do not round-trip: say why, naming the tensor
                values = gguf.quants.dequantize(t.data, t.tensor_type)
                why = (f"{int((~np.isfinite(values)).sum())} non-finite weights (a NaN or inf block scale)"
                       if not np.isfinite(values).all() else str(e))
                raise CheckpointError(path, f"tensor {t.name!r} is corrupt: {why}") from None
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if permute and hf_name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_rope_rows(w, c.num_heads)
        elif permute and hf_name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_rope_rows(w, c.num_kv_heads)
        elif permute and (hf_name.endswith("q_proj.bias") or hf_name.endswith("k_proj.bias")):
            w = _unpermute_rope_rows(w, c.num_heads if "q_proj" in hf_name else c.num_kv_heads)
        return w

    def checked(name):
        if name not in by_hf:
            raise missing_tensor(path, name, {hf: t.name for hf, t in by_hf.items()}, c)
        t = by_hf[name]
        try:
            w = get(name)
        except CheckpointError:
            raise
        except (ValueError, NotImplementedError, TypeError, IndexError) as e:  # gguf's own, or a shape
            raise CheckpointError(path, f"tensor {t.name!r} ({getattr(t.tensor_type, 'name', t.tensor_type)}, "
                                        f"shape {tuple(int(n) for n in t.shape)}) is unreadable: {e}") from e
        return check_tensor(t.name, w, str(path))

    params = build_params(c, checked, str(path))
    return c, params, fields


# --- Hugging Face directory (config.json + safetensors) ----------------------

def safetensors_weight_map(path: pathlib.Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a Hugging Face directory (one file, or sharded with an index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(index, "has no 'weight_map' of tensor name -> file")
        return weight_map
    if (path / "model.safetensors").is_file():
        with open_safetensors(path / "model.safetensors") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise MissingFileError(path, "has neither model.safetensors nor model.safetensors.index.json")


def files_read(path: pathlib.Path) -> list[pathlib.Path]:
    """Every file that loading the Hugging Face directory `path` reads (config, weights,
    tokenizer, our checksum manifest), those that exist: what the parameter cache is keyed by."""
    from specjax import _files

    names = ["config.json", "model.safetensors.index.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", _files.MANIFEST]
    found = [path / n for n in names if (path / n).is_file()]
    if (path / "model.safetensors.index.json").is_file():
        found += [path / f for f in sorted(set(safetensors_weight_map(path).values())) if (path / f).is_file()]
    return found


def check_ours(path: pathlib.Path) -> None:
    """A directory that specjax wrote (with a checksum manifest) must match it, bit for bit:
    a flipped bit in our own files is caught, not only values out of range."""
    from specjax import _files

    if (path / _files.MANIFEST).is_file():
        _files.check_manifest(path)


def load_hf_dir(path: str | pathlib.Path):
    """(Config, float32 params) from a directory with config.json and safetensors
    (one file, or shards listed in model.safetensors.index.json)."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise MissingFileError(path, "no config.json (not a Hugging Face model directory)")
    check_ours(path)
    c = config_from_json(cfg_file)
    weight_map = safetensors_weight_map(path)
    handles = {}
    # where a tensor is, or would be: its shard, else the file that lists the tensors
    listing = path / ("model.safetensors.index.json" if (path / "model.safetensors.index.json").is_file()
                      else "model.safetensors")

    def where(name):
        return str(path / weight_map[name]) if name in weight_map else str(listing)

    def get(name):
        if name not in weight_map:
            raise missing_tensor(listing, name, {n: n for n in weight_map}, c)
        shard = weight_map[name]
        if shard not in handles:
            # framework="flax" reads bfloat16 too (numpy has no bfloat16).
            handles[shard] = open_safetensors(path / shard, framework="flax")
        try:
            return np.asarray(handles[shard].get_tensor(name).astype("float32"))
        except Exception as e:  # an unreadable tensor (dtype, data): name the file and the tensor
            raise CheckpointError(path / shard, f"tensor {name!r} is unreadable ({type(e).__name__}: {e})") from e

    params = build_params(c, lambda name: check_tensor(name, get(name), where(name)), where)
    if c.tie_embeddings:
        weight_map.pop("lm_head.weight", None)  # some exports write the tied head anyway
    unknown = sorted(set(weight_map) - set(expected_tensors(c)) - {"lm_head.weight"})
    if unknown:
        raise config_lib.ConfigError(path, f"unsupported tensor(s): {', '.join(unknown[:5])}")
    return c, params
