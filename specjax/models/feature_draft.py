"""A feature draft: one decoder layer that extrapolates the target's own hidden state.

A standalone small draft must learn language from scratch; this one reads what the target
already computed (the design of EAGLE, Li et al. 2024). At position j it takes the target's
last-layer output f_j (before the final norm) and the embedding of the next token x_{j+1},
and predicts f_{j+1}; a head over a reduced vocabulary (the Vd tokens the target emits most)
turns the prediction into the draft token x_{j+2}. Drafting K tokens chains the layer on its
own predictions; the engine hands it the target's true features after every verification
(`specjax.drafters.FeatureDrafter`).

    z_BTD = [embed(x_{j+1}) ; f_j] @ fc_w + fc_b       fc_w [2D, D]
    f^_BTD = Block(z)                                   one Llama layer of the target's shape
    logits_BTVd = rmsnorm(f^) @ head                    head [D, Vd]; column i is token vocab_ids[i]

The input embedding is the target's own table (read by the drafter, never copied); the
draft's parameters are fc, the layer, the norm scale and the reduced head. A draft step
reads 4 D^2 + 3 D F + D Vd weights: for SmolLM2-135M with Vd = 8192, 8.8 M of the
target's 134 M (the full 49152-column head alone would be 28 M).

Saved as a directory: feature_draft.json (the layer's config, the target it was trained
for, the reduced vocabulary) and params.safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import llama, quant
from specjax.models.config import Config, RopeScaling

FORMAT = "specjax-feature-draft-1"
CONFIG_FILE = "feature_draft.json"
PARAMS_FILE = "params.safetensors"


@dataclasses.dataclass(frozen=True)
class FeatureDraft:
    """A trained feature draft for one target shape.

    config: the draft layer's Config (the target's, with num_layers = 1); vocab_ids: int32[Vd]
    full-vocabulary ids of the head's columns; params: {fc_w, fc_b, layer, norm, head}.
    """

    config: Config
    params: Any
    vocab_ids: np.ndarray
    name: str = "feature-draft"
    target_name: str | None = None
    dtype: Any = jnp.float32

    @property
    def draft_vocab(self) -> int:
        return int(len(self.vocab_ids))


def layer_config(target: Config) -> Config:
    return dataclasses.replace(target, num_layers=1)


def init_params(target_config: Config, target_params, vocab_ids, seed: int = 0):
    """Fresh parameters: a random layer and fc (normal 0.02, the target's initialiser), the
    target's final-norm scale and its head's columns for `vocab_ids` (a warm start: a
    prediction equal to the target's feature gives the target's own logits)."""
    cfg = layer_config(target_config)
    D = cfg.hidden_size
    k_fc, k_layer = jax.random.split(jax.random.PRNGKey(seed))
    x, pos = jnp.zeros((1, 1, D), jnp.float32), jnp.zeros((1, 1), jnp.int32)
    layer = llama.Block(cfg).init(k_layer, (x, None, None), 0, pos, None)["params"]
    head_DV = target_params["embed"] if target_config.tie_embeddings else target_params["lm_head"]
    ids = jnp.asarray(np.asarray(vocab_ids, np.int32))
    head_DVd = jnp.moveaxis(llama.embed_tokens(head_DV, ids[None], jnp.float32)[0], -1, 0)  # [D, Vd]
    return {
        "fc_w": 0.02 * jax.random.normal(k_fc, (2 * D, D), jnp.float32),
        "fc_b": jnp.zeros((D,), jnp.float32),
        "layer": jax.device_get(layer),
        "norm": jnp.asarray(quant.materialize(target_params["final_norm"]["scale"]), jnp.float32),
        "head": head_DVd,
    }


def features(config: Config, params, embed_BTD, feat_BTD, positions_BT, cache: llama.KVCache | None = None,
             dtype=jnp.float32, backend=None):
    """Predicted next features f^[B, T, D] at `positions_BT` (and the cache with their keys and
    values written; None: attend over this call's tokens only, as in training). backend: the
    matmul path (`specjax.backend.Backend`; None: XLA's dot)."""
    z_BTD = jnp.concatenate([embed_BTD.astype(dtype), feat_BTD.astype(dtype)], axis=-1)
    z_BTD = quant.contract("btd,de->bte", z_BTD, params["fc_w"], 1, dtype, backend=backend) + params["fc_b"].astype(dtype)
    kv = (None, None) if cache is None else (cache.k, cache.v)
    (f_BTD, k, v), _ = llama.Block(config, dtype, backend=backend).apply(
        {"params": params["layer"]}, (z_BTD, *kv), 0, positions_BT, None if cache is None else positions_BT)
    return f_BTD, (None if cache is None else llama.KVCache(k, v, cache.lengths))


def logits(config: Config, params, feat_BTD, dtype=jnp.float32, backend=None):
    """float32[..., Vd] over the reduced vocabulary, for features [..., D]."""
    h = llama.RMSNorm(config.rms_norm_eps).apply({"params": {"scale": params["norm"]}}, feat_BTD.astype(dtype))
    lead = h.shape[:-1]  # [B, T] or [B]
    h = h.reshape(1, -1, h.shape[-1])
    return quant.contract("btd,dv->btv", h, params["head"], 1, dtype,
                          backend=backend).astype(jnp.float32).reshape(*lead, -1)


LINEAR = {"fc_w": 1, "head": 1, "wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def quantize(draft: FeatureDraft, block: int = 32) -> FeatureDraft:
    """The draft with its matrices as int8 codes and a float32 scale per block of `block` input
    rows per output column (symmetric, like GGUF's Q8_0): a step reads ~1 byte per weight instead
    of 4, which is what a memory-bound CPU step costs. Norms and biases stay float."""

    def q(name, w):
        n_in = LINEAR.get(name)
        if n_in is None or quant.is_quantized(w):
            return w
        w = np.asarray(w, np.float32)
        shape = w.shape
        K, N = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
        if K % block:
            return w  # a width that blocks do not tile stays float
        w3 = w.reshape(K // block, block, N)
        scale = np.max(np.abs(w3), axis=1, keepdims=True) / 127.0
        codes = np.round(w3 / np.where(scale > 0, scale, 1.0)).astype(np.int8)
        return quant.BlockQuant(jnp.asarray(codes), jnp.asarray(scale.astype(np.float32)), None, shape)

    def walk(tree):
        return {k: walk(v) if isinstance(v, dict) else q(k, v) for k, v in tree.items()}

    return dataclasses.replace(draft, params=walk(draft.params))


def check_target(target_config: Config, draft: FeatureDraft) -> None:
    """A named error when `draft` was not made for a target of this shape."""
    want = layer_config(target_config)
    got = draft.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(want, field) != getattr(got, field):
            raise ValueError(f"feature draft {draft.name!r} does not fit this target: {field} "
                             f"{getattr(got, field)} in the draft, {getattr(want, field)} in the target")
    ids = np.asarray(draft.vocab_ids)
    if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= want.vocab_size:
        raise ValueError(f"feature draft {draft.name!r}: vocab_ids must be ids in [0, {want.vocab_size})")
    if len(np.unique(ids)) != ids.size:  # a repeated id would lose probability mass at T > 0
        raise ValueError(f"feature draft {draft.name!r}: vocab_ids repeat a token")
    head = draft.params.get("head")
    width = (head.shape[-1] if hasattr(head, "shape") else head.codes.shape[-1] if hasattr(head, "codes")
             else None)
    if width is not None and width != ids.size:
        raise ValueError(f"feature draft {draft.name!r}: the head scores {width} tokens, vocab_ids lists {ids.size}")


# -- files ------------------------------------------------------------------------------------

def _flat(params, prefix=""):
    """{path: array}; a BlockQuant w is saved as path@codes, path@scale (its shape is the
    parameter's, known from the config)."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        elif isinstance(v, quant.BlockQuant):
            out[f"{prefix}{k}@codes"] = np.asarray(v.codes, np.int8)
            out[f"{prefix}{k}@scale"] = np.asarray(v.scale, np.float32)
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float32)
    return out


def _nest(flat, shapes):
    out: dict = {}
    for key, v in flat.items():
        if key.endswith("@scale"):
            continue
        name = key.split("@")[0]
        *path, leaf = name.split("/")
        d = out
        for p in path:
            d = d.setdefault(p, {})
        if key.endswith("@codes"):
            d[leaf] = quant.BlockQuant(jnp.asarray(v), jnp.asarray(flat[name + "@scale"]), None, tuple(shapes[name]))
        else:
            d[leaf] = jnp.asarray(v)
    return out


def param_shapes(config: Config, draft_vocab: int) -> dict:
    """{path: logical shape} of every parameter."""
    D = config.hidden_size
    fresh = jax.eval_shape(lambda: llama.Block(config).init(
        jax.random.PRNGKey(0), (jnp.zeros((1, 1, D)), None, None), 0, jnp.zeros((1, 1), jnp.int32), None))
    shapes = {f"layer/{k}": v.shape for k, v in _flat_shapes(fresh["params"])}
    shapes.update({"fc_w": (2 * D, D), "fc_b": (D,), "norm": (D,), "head": (D, draft_vocab)})
    return shapes


def _flat_shapes(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat_shapes(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _config_dict(c: Config) -> dict:
    d = dataclasses.asdict(c)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _config_from(d: dict) -> Config:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    for k in ("eos_token_ids", "rope_freq_factors"):
        if d.get(k) is not None:
            d[k] = tuple(d[k])
    return Config(**d)


def save(draft: FeatureDraft, directory: str | os.PathLike, extra: dict | None = None) -> None:
    """Writes the directory whole or not at all: into a sibling temporary directory, with a
    SHA-256 manifest written last, then renamed into place (an earlier draft there is kept until
    the rename succeeded). A directory that exists and is not a feature draft is refused."""
    from safetensors.numpy import save_file

    from specjax import _files

    out = pathlib.Path(directory)
    if out.exists() and not (out.is_dir() and (is_feature_draft(out) or not any(out.iterdir()))):
        raise FileExistsError(f"{out} exists and is not a feature draft; refusing to replace it")
    tensors = _flat(draft.params)
    tensors["vocab_ids"] = np.asarray(draft.vocab_ids, np.int32)
    meta = {"format": FORMAT, "name": draft.name, "target": draft.target_name, "draft_vocab": draft.draft_vocab,
            "config": _config_dict(draft.config), **(extra or {})}
    with _files.atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / PARAMS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        _files.write_manifest(tmp)


def is_feature_draft(directory: str | os.PathLike) -> bool:
    return (pathlib.Path(directory) / CONFIG_FILE).is_file()


def load(directory: str | os.PathLike, dtype=jnp.float32) -> FeatureDraft:
    """The draft that `save` wrote. Every damaged or inconsistent file is a `LoadError` naming it:
    a checksum that differs from the manifest (a draft saved with one), unreadable JSON or
    safetensors, a missing field or tensor, a wrong shape, a non-finite weight."""
    from specjax import _files
    from specjax.models import convert

    d = pathlib.Path(directory)
    if not is_feature_draft(d):
        raise convert.MissingFileError(d, f"not a feature draft directory (no {CONFIG_FILE})")
    convert.check_ours(d)  # a draft saved before manifests existed has none: the checks below still run
    meta_file, params_file = d / CONFIG_FILE, d / PARAMS_FILE
    meta = convert.read_json(meta_file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _files.LoadError(meta_file, f"format {got!r}, expected {FORMAT!r}")
    try:
        config = _config_from(meta["config"])
    except KeyError as e:
        raise _files.LoadError(meta_file, f"missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:  # an unknown or missing config field, a bad value
        raise _files.LoadError(meta_file, f"invalid 'config' ({e})") from None
    with convert.open_safetensors(params_file) as f:
        try:
            flat = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise _files.LoadError(params_file, f"unreadable tensor data ({e}): damaged or truncated") from e
    if "vocab_ids" not in flat:
        raise _files.LoadError(params_file, "missing tensor 'vocab_ids'")
    vocab_ids = np.asarray(flat.pop("vocab_ids"), np.int32)
    shapes = param_shapes(config, len(vocab_ids))
    _check_flat(flat, shapes, params_file)
    return FeatureDraft(config, _nest(flat, shapes), vocab_ids, meta.get("name") or d.name, meta.get("target"), dtype)


def _check_flat(flat: dict, shapes: dict, source) -> None:
    """Every parameter present with its shape (codes and scale of a quantized one), finite."""
    from specjax import _files

    got = {}
    for key, v in flat.items():
        name, _, part = key.partition("@")
        if name not in shapes or part not in ("", "codes", "scale"):
            raise _files.LoadError(source, f"unexpected tensor {key!r}")
        got.setdefault(name, {})[part] = v
    for name, shape in shapes.items():
        parts = got.get(name)
        if parts is None:
            raise _files.LoadError(source, f"missing tensor {name!r}")
        if "" in parts:
            if tuple(parts[""].shape) != tuple(shape):
                raise _files.LoadError(source, f"tensor {name!r} has shape {tuple(parts[''].shape)}, "
                                               f"expected {tuple(shape)} from {CONFIG_FILE}")
        elif set(parts) != {"codes", "scale"} or parts["codes"].ndim != 3 or \
                int(np.prod(parts["codes"].shape)) != int(np.prod(shape)):
            raise _files.LoadError(source, f"quantized tensor {name!r} does not hold the {tuple(shape)} "
                                           f"parameter of {CONFIG_FILE}")
        for part, a in parts.items():
            if part != "codes" and not np.isfinite(a).all():
                raise _files.LoadError(source, f"tensor {name + ('@' + part if part else '')!r} has "
                                               f"{int((~np.isfinite(a)).sum())} non-finite values of {a.size}")
