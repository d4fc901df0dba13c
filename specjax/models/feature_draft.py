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
             dtype=jnp.float32):
    """Predicted next features f^[B, T, D] at `positions_BT` (and the cache with their keys and
    values written; None: attend over this call's tokens only, as in training)."""
    z_BTD = jnp.concatenate([embed_BTD.astype(dtype), feat_BTD.astype(dtype)], axis=-1)
    z_BTD = z_BTD @ params["fc_w"].astype(dtype) + params["fc_b"].astype(dtype)
    kv = (None, None) if cache is None else (cache.k, cache.v)
    (f_BTD, k, v), _ = llama.Block(config, dtype).apply(
        {"params": params["layer"]}, (z_BTD, *kv), 0, positions_BT, None if cache is None else positions_BT)
    return f_BTD, (None if cache is None else llama.KVCache(k, v, cache.lengths))


def logits(config: Config, params, feat_BTD, dtype=jnp.float32):
    """float32[B, T, Vd] over the reduced vocabulary."""
    h = llama.RMSNorm(config.rms_norm_eps).apply({"params": {"scale": params["norm"]}}, feat_BTD.astype(dtype))
    return (h @ params["head"].astype(dtype)).astype(jnp.float32)


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


# -- files ------------------------------------------------------------------------------------

def _flat(params, prefix=""):
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float32)
    return out


def _nest(flat):
    out: dict = {}
    for key, v in flat.items():
        *path, leaf = key.split("/")
        d = out
        for p in path:
            d = d.setdefault(p, {})
        d[leaf] = jnp.asarray(v)
    return out


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
    """Writes the directory (files replaced atomically, one by one)."""
    from safetensors.numpy import save_file

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _flat(draft.params)
    tensors["vocab_ids"] = np.asarray(draft.vocab_ids, np.int32)
    tmp = out / (PARAMS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, out / PARAMS_FILE)
    meta = {"format": FORMAT, "name": draft.name, "target": draft.target_name, "draft_vocab": draft.draft_vocab,
            "config": _config_dict(draft.config), **(extra or {})}
    tmp = out / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / CONFIG_FILE)


def is_feature_draft(directory: str | os.PathLike) -> bool:
    return (pathlib.Path(directory) / CONFIG_FILE).is_file()


def load(directory: str | os.PathLike, dtype=jnp.float32) -> FeatureDraft:
    from safetensors.numpy import load_file

    d = pathlib.Path(directory)
    if not is_feature_draft(d):
        raise FileNotFoundError(f"{d} is not a feature draft directory (no {CONFIG_FILE})")
    meta = json.loads((d / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{d / CONFIG_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
    flat = load_file(str(d / PARAMS_FILE))
    vocab_ids = np.asarray(flat.pop("vocab_ids"), np.int32)
    return FeatureDraft(_config_from(meta["config"]), _nest(flat), vocab_ids, meta.get("name") or d.name,
                        meta.get("target"), dtype)
