"""Checkpoint conversion: GGUF and HF safetensors tensors -> our parameter tree.

Both loaders name tensors in transformers' layout (torch Linear weights are
[out, in]) and hand them to `build_params`, which is the one place that knows
our tree (see `llama.Transformer`).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import numpy as np

from specjax.models import config as config_lib
from specjax.models import quant
from specjax.models.config import Config


class MissingTensorError(KeyError):
    def __str__(self):
        return str(self.args[0])


class CheckpointError(ValueError):
    """A checkpoint file that is not what it claims: unreadable, truncated, or with non-finite weights."""


def read_json(path: pathlib.Path) -> Any:
    """json.loads of a file, with an error that names the file."""
    try:
        return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def open_gguf(path):
    """A gguf.GGUFReader, with an error that names the file when it is empty, truncated or not a GGUF."""
    import gguf

    path = pathlib.Path(path)
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes), not a GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the library fails deep inside (reshape, struct, mmap errors)
        raise CheckpointError(f"{path} ({size} bytes) is not a readable GGUF file, or is truncated: "
                              f"{type(e).__name__}: {e}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise CheckpointError(f"{path} is truncated: its tensors need {end} bytes, the file has {size}")
    return reader


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
            raise CheckpointError(f"tensor {name!r} in {source} has non-finite {what} "
                                  f"({int((~np.isfinite(a)).sum())} of {a.size}): the file is corrupt")
    if peak is None:
        peak = float(np.abs(parts[0][1]).max(initial=0))
    if peak > _MAX_WEIGHT:
        raise CheckpointError(f"tensor {name!r} in {source} has weights up to {peak:.3g}, beyond any working "
                              f"checkpoint's (|w| <= {_MAX_WEIGHT:g}): a corrupt block scale?")
    return w


# Per-layer tensors, transformers names (the part after `model.layers.{i}.`).
_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
_BIAS_TENSORS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def expected_tensors(c: Config) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not c.tie_embeddings:
        names.append("lm_head.weight")
    per_layer = _LAYER_TENSORS + (_BIAS_TENSORS if c.qkv_bias else ())
    names += [f"model.layers.{i}.{t}" for i in range(c.num_layers) for t in per_layer]
    return names


def build_params(c: Config, get: Callable[[str], Any], source: str) -> dict:
    """Our parameter tree from a `get(hf_name)` accessor returning an array in transformers'
    layout, or `quant.RawBlocks` for a block-quantized GGUF tensor (kept quantized)."""
    D, H, G, Dh, F, V = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size

    def fetch(name, shape):
        try:
            x = get(name)
        except KeyError:
            raise MissingTensorError(f"missing tensor {name!r} in {source}") from None
        if not isinstance(x, quant.RawBlocks):
            x = np.asarray(x, np.float32)
        if tuple(x.shape) != shape:
            raise ValueError(f"tensor {name!r} in {source} has shape {tuple(x.shape)}, expected {shape}")
        return x

    def linear(name, in_shape, out_shape):  # torch [out, in] -> ours [*in, *out]
        w = fetch(name, (int(np.prod(out_shape)), int(np.prod(in_shape))))
        shape = (*in_shape, *out_shape)
        return w.as_linear(shape) if isinstance(w, quant.RawBlocks) else w.T.reshape(shape)

    def table(w):  # [V, D] -> ours [D, V], the tied head's layout
        return w.as_linear((D, V)) if isinstance(w, quant.RawBlocks) else np.ascontiguousarray(w.T)

    def vector(name, shape):
        return fetch(name, (int(np.prod(shape)),)).reshape(shape)

    def stack(make):
        return quant.stack_layers([make(f"model.layers.{i}.") for i in range(c.num_layers)])

    layers = {
        "attn_norm": {"scale": stack(lambda p: vector(p + "input_layernorm.weight", (D,)))},
        "mlp_norm": {"scale": stack(lambda p: vector(p + "post_attention_layernorm.weight", (D,)))},
        "wq": stack(lambda p: linear(p + "self_attn.q_proj.weight", (D,), (H, Dh))),
        "wk": stack(lambda p: linear(p + "self_attn.k_proj.weight", (D,), (G, Dh))),
        "wv": stack(lambda p: linear(p + "self_attn.v_proj.weight", (D,), (G, Dh))),
        "wo": stack(lambda p: linear(p + "self_attn.o_proj.weight", (H, Dh), (D,))),
        "w_gate": stack(lambda p: linear(p + "mlp.gate_proj.weight", (D,), (F,))),
        "w_up": stack(lambda p: linear(p + "mlp.up_proj.weight", (D,), (F,))),
        "w_down": stack(lambda p: linear(p + "mlp.down_proj.weight", (F,), (D,))),
    }
    if c.qkv_bias:
        layers["bq"] = stack(lambda p: vector(p + "self_attn.q_proj.bias", (H, Dh)))
        layers["bk"] = stack(lambda p: vector(p + "self_attn.k_proj.bias", (G, Dh)))
        layers["bv"] = stack(lambda p: vector(p + "self_attn.v_proj.bias", (G, Dh)))
    params = {
        "embed": table(fetch("model.embed_tokens.weight", (V, D))),  # [D, V]
        "layers": layers,
        "final_norm": {"scale": vector("model.norm.weight", (D,))},
    }
    if not c.tie_embeddings:
        params["lm_head"] = linear("lm_head.weight", (D,), (V,))
    return params


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


def gguf_fields(reader) -> dict:
    """Decoded GGUF metadata {key: python value}."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def load_gguf(path: str | pathlib.Path, *, keep_quantized: bool = True):
    """(Config, params, metadata) from a GGUF file.

    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weight matrices (layers, embedding, LM head) stay
    block-quantized (`quant.BlockQuant`, bit-identical values) when `keep_quantized`; every
    other tensor is dequantized to float32 by gguf.quants.
    """
    import gguf  # the format library: parsing and dequantization

    reader = open_gguf(path)
    fields = gguf_fields(reader)
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = None
    if "rope_freqs.weight" in tensors:
        rope_freqs = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
    c = config_lib.from_gguf_fields(fields, tensor_names=tensors.keys(), rope_freqs=rope_freqs)
    by_hf = {}
    for name in tensors:
        hf = _hf_name(name)
        if hf is None and name != "rope_freqs.weight":
            raise config_lib.ConfigError(f"unsupported tensor {name!r} in {path} (not part of a "
                                         f"{c.architecture} decoder this library implements)")
        if hf is not None:
            by_hf[hf] = tensors[name]
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
                raise CheckpointError(f"tensor {t.name!r} in {path} is corrupt: {why}") from None
        else:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if permute and hf_name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_rope_rows(w, c.num_heads)
        elif permute and hf_name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_rope_rows(w, c.num_kv_heads)
        elif permute and (hf_name.endswith("q_proj.bias") or hf_name.endswith("k_proj.bias")):
            w = _unpermute_rope_rows(w, c.num_heads if "q_proj" in hf_name else c.num_kv_heads)
        return w

    params = build_params(c, lambda name: check_tensor(by_hf[name].name, get(name), str(path)), str(path))
    return c, params, fields


# --- Hugging Face directory (config.json + safetensors) ----------------------

def safetensors_weight_map(path: pathlib.Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a Hugging Face directory (one file, or sharded with an index)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return read_json(index)["weight_map"]
    if (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", framework="numpy") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def load_hf_dir(path: str | pathlib.Path):
    """(Config, float32 params) from a directory with config.json and safetensors
    (one file, or shards listed in model.safetensors.index.json)."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    c = config_lib.from_hf_dict(read_json(cfg_file))
    weight_map = safetensors_weight_map(path)
    handles = {}

    def get(name):
        if name not in weight_map:
            raise KeyError(name)
        shard = weight_map[name]
        if shard not in handles:
            # framework="flax" reads bfloat16 too (numpy has no bfloat16).
            handles[shard] = safe_open(path / shard, framework="flax")
        return np.asarray(handles[shard].get_tensor(name).astype("float32"))

    params = build_params(c, lambda name: check_tensor(name, get(name), str(path)), str(path))
    if c.tie_embeddings:
        weight_map.pop("lm_head.weight", None)  # some exports write the tied head anyway
    unknown = sorted(set(weight_map) - set(expected_tensors(c)) - {"lm_head.weight"})
    if unknown:
        raise config_lib.ConfigError(f"unsupported tensor(s) in {path}: {', '.join(unknown[:5])}")
    return c, params
