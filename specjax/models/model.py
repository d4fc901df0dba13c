"""`Model = (config, params, tokenizer)` and `load()`: presets, GGUF files, HF dirs.

Dequantizing a GGUF costs seconds; the converted parameters (block codes kept) are saved
under the cache directory (`_param_cache`: one safetensors file and a chunked SHA-256
manifest), keyed by the source's identity, with the config and the tokenizer beside them, so
the second load reads only the cache (parsing a GGUF's metadata alone costs seconds: its
tokenizer fields), and hands its checked, aligned buffer to the device without a copy.

Over 450 lines: what the cache holds (config, tokenizer, tree) and its checks stay beside the
two load paths (one process, per shard) that share them; the file format is `_param_cache`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
from specjax._files import LoadError
from specjax.models import _param_cache, convert, llama, presets, quant
from specjax.models._param_cache import CacheError
from specjax.models.config import Config, RopeScaling

# bump when the parameter tree, the conversion or the cache's files change (4: safetensors and
# chunk hashes, where 3 was orbax); older entries are left where they are, never read
_CONVERTER_VERSION = 4


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A decoder: static config, a parameter pytree, and (for real checkpoints) a tokenizer."""

    config: Config
    params: Any
    tokenizer: Any = None
    name: str = ""
    dtype: Any = jnp.float32  # compute dtype: the float params and the KV caches are stored in it
    load_seconds: float | None = None  # wall time of the load that produced this model
    load_source: str | None = None  # "converted" (first load) or "cache"

    def logits(self, tokens_BT) -> jax.Array:
        """Full causal forward, no cache: int32[B, T] -> float32[B, T, V] at positions 0..T-1."""
        from specjax import _checks

        tokens_BT = _checks.token_ids("Model.logits", tokens_BT, self.config.vocab_size)
        if tokens_BT.ndim != 2 or tokens_BT.shape[1] == 0:
            raise ValueError(f"tokens must be int32[B, T] with T >= 1, got shape {tokens_BT.shape}")
        llama.check_positions("Model.logits", self.config, tokens_BT.shape[1], "T")
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        return _logits(self.config, self.dtype, self.params, tokens_BT)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            return (int(self.tokenizer.eos_token_id),)
        return self.config.eos_token_ids

    def with_params(self, params, **changes) -> "Model":
        return dataclasses.replace(self, params=params, **changes)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _logits(config, dtype, params, tokens_BT):
    return llama.forward(config, params, tokens_BT, dtype=dtype)


def random_model(config: Config, seed: int = 0, dtype=jnp.float32) -> Model:
    """A model with random weights in `dtype` (tests, and real-shape checks where no checkpoint is at hand)."""
    return Model(config, llama.init_params(config, seed, dtype), None, f"random-{seed}", dtype)


def abstract(config: Config | str, dtype=jnp.float32) -> Model:
    """A Model whose params are `jax.ShapeDtypeStruct`s (no memory): for `Engine(...).lower`,
    the sharding plan and the memory report at real size. `config`: a Config, or a name
    from `catalog.NAMES` (e.g. "llama-3.1-8b")."""
    from specjax.models import catalog

    name = config if isinstance(config, str) else "abstract"
    if isinstance(config, str):
        config = catalog.config(config)
    return Model(config, llama.param_shapes(config, dtype), None, name, dtype)


def is_abstract(params) -> bool:
    """True when every leaf is a ShapeDtypeStruct (a model to compile, not to run)."""
    leaves = jax.tree.leaves(params)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def pad_vocab(model: Model, vocab_size: int) -> Model:
    """`model` with its embedding (and head) padded by zero columns to `vocab_size` ids, whose
    logits are -inf (`Config.vocab_used`): a draft whose table is narrower than its target's
    although the tokenizer is the same (Qwen2.5 0.5B/1.5B: 151936 ids; 7B: 152064)."""
    c = model.config
    if vocab_size == c.vocab_size:
        return model
    if vocab_size < c.vocab_size:
        raise ValueError(f"cannot pad a vocabulary of {c.vocab_size} ids down to {vocab_size}")
    extra = vocab_size - c.vocab_size

    def pad(w):
        if isinstance(w, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((*w.shape[:-1], vocab_size), w.dtype)
        if isinstance(w, quant.BlockQuant):
            return quant.pad_columns(w, extra)
        return jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, extra)])

    params = dict(model.params)
    for name in ("embed", "lm_head"):
        if name in params:
            params[name] = pad(params[name])
    config = dataclasses.replace(c, vocab_size=vocab_size, vocab_used=c.vocab_used or c.vocab_size)
    return model.with_params(params, config=config)


def load(source: str | os.PathLike, *, dtype=jnp.float32, cache: bool = True,
         keep_quantized: bool = True, mesh=None, role: str = "target") -> Model:
    """Loads a preset name, a `.gguf` file or a Hugging Face directory.

    `keep_quantized`: a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K weight matrices (layers,
    embedding, LM head) stay block-quantized (the same values, about a quarter of the bytes;
    see `quant`); False expands them to float32.
    `mesh`: a `jax.sharding.Mesh` or `sharding.MeshConfig`: the params come back placed as
    `Engine(..., mesh=mesh)` places them (`role` "target", or "draft" for a draft model, which
    follows `MeshConfig.draft`), and each process reads only the parts of the checkpoint that
    its devices hold (`shards`, the quantized embedding and head included; of a cached conversion,
    the 8 MiB chunks that hold those parts). Where the Engine would repeat the KV heads (a
    model axis wider than them, docs/wide_tp.md) the model comes back as the Engine prepares
    the whole load (`sharding.prepare_model`), each device's copy of a KV head read from the file's.
    Pass the same mesh to the Engine: it keeps the placed params as they are.

    A damaged, truncated or inconsistent input raises `LoadError` ("<file>: <problem>"); a
    missing file is also a FileNotFoundError, a missing tensor also a KeyError. The cache is
    keyed by every file read (see `_source_key`) and optional: failing to write it is a warning.
    """
    start = time.perf_counter()
    src = str(source)
    if src in presets.PRESETS:
        path = presets.resolve(src)  # its SHA-256 checked (again whenever the file's stat changed)
        key = f"{src}-{presets.PRESETS[src].sha256[:16]}"
        name = src
    elif src.endswith(".gguf") or pathlib.Path(src).is_dir() or pathlib.Path(src).is_file():
        path = pathlib.Path(src)
        if not path.exists():
            raise convert.MissingFileError(path, "no such checkpoint file or directory")
        if not path.is_file() and not (path / "config.json").is_file():
            from specjax.models import feature_draft

            raise convert.MissingFileError(path, "a feature draft: load it with models.feature_draft.load"
                                           if feature_draft.is_feature_draft(path) else
                                           "no config.json: not a Hugging Face model directory")
        if path.is_file() and not src.endswith(".gguf") and _magic(path) != b"GGUF":
            raise convert.CheckpointError(path, "not a GGUF file (no GGUF magic) and not a model directory")
        key = None  # made from the files read, below
        name = path.name
    else:
        raise presets.PresetError(f"unknown preset {src!r} (known presets: {', '.join(presets.PRESETS)}; "
                                  "or pass a .gguf file or a Hugging Face model directory)")

    is_gguf = path.is_file()
    try:
        if key is None:
            key = _source_key(path, is_gguf)
        restore = True
        if mesh is None and cache:
            model, restore = _load_cached(path, name, key, is_gguf, start, dtype, keep_quantized)
            if model is not None:
                return model
        reader = convert.open_gguf(path) if is_gguf else None  # read once, for the config, tokenizer and weights
        config, tokenizer = _read_config_and_tokenizer(path, is_gguf, reader)
        return _load_params(path, name, key, is_gguf, config, tokenizer, start, dtype, cache and restore,
                            keep_quantized, mesh, role, save=cache, reader=reader)
    except LoadError as e:  # a problem found where the file was not known yet: name the source
        raise e.with_path(path) from e.__cause__


def _magic(path: pathlib.Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _source_key(path: pathlib.Path, is_gguf: bool) -> str:
    """The cache key of a checkpoint: every file that loading it reads (weights, config,
    tokenizer), each by path, device, inode, size, mtime and ctime. Writing a file changes its
    ctime, which (unlike mtime) no utime() call can set back, so replaced or altered weights are
    converted afresh; a warm load only stats the files (no hash of the weights)."""
    files = [path] if is_gguf else convert.files_read(path)
    stamps = []
    for f in files:
        st = f.stat()
        stamps.append(f"{f.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    return hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:24]


def _cache_dir(key: str, is_gguf: bool, keep_quantized: bool) -> pathlib.Path:
    quantized = keep_quantized and is_gguf
    return presets.cache_dir() / "params" / f"{key}-v{_CONVERTER_VERSION}{'-q' if quantized else ''}"


def _load_cached(path, name, key, is_gguf, start, dtype, keep_quantized) -> tuple[Model | None, bool]:
    """(the model from the cache alone, or None; whether the caller should still try the cache).
    A warm load stats the source (its key) and reads the cache: config, tokenizer and arrays,
    every file checked against the manifest. A cache written without the tokenizer (by the
    per-shard path) is left to `_load_params`, which reads those from the source."""
    ckpt_dir = _cache_dir(key, is_gguf, keep_quantized)
    if ckpt_dir.parent.is_dir():
        try:
            _param_cache.remove_stale_temporaries(ckpt_dir.parent)
        except OSError:  # a read-only cache: its temporaries stay, as does the load
            pass
    if not (ckpt_dir / _TOKENIZER).is_file():
        return None, True
    try:
        config, params, tokenizer = _restore_model(ckpt_dir)
    except Exception as e:  # a corrupt, partial or altered cache is rebuilt, never trusted
        logging.warning("parameter cache %s failed its check (%s); rebuilding it from %s", ckpt_dir,
                        str(e).splitlines()[0][:300], path)
        return None, False
    params = jax.device_put(llama.cast_params(params, dtype))  # the aligned views: no copy on a CPU
    return Model(config, params, tokenizer, name, dtype, time.perf_counter() - start, "cache"), False


def _load_params(path, name, key, is_gguf, config, tokenizer, start, dtype, cache, keep_quantized, mesh, role,
                 save=None, reader=None):
    save = cache if save is None else save  # restore=False, save=True: a cache already found damaged
    ckpt_dir = _cache_dir(key, is_gguf, keep_quantized)
    keep_quantized = keep_quantized and is_gguf
    if mesh is not None:
        config, name, params, how = _load_sharded(path, name, is_gguf, config, ckpt_dir, dtype, cache,
                                                  keep_quantized, mesh, role)
        return Model(config, params, tokenizer, name, dtype, time.perf_counter() - start, how)
    params, how = None, "converted"
    if cache and ckpt_dir.exists():
        try:
            params = _restore(ckpt_dir, config)
            how = "cache"
        except Exception as e:  # a corrupt, partial or altered cache is rebuilt, never trusted
            logging.warning("parameter cache %s failed its check (%s); rebuilding it from %s", ckpt_dir,
                            str(e).splitlines()[0][:300], path)
    if params is not None and save and not (ckpt_dir / _TOKENIZER).is_file():
        # a cache from before the tokenizer was kept (or from the per-shard path): rewritten whole
        # once, with it, so that later loads need not parse the source
        _save_or_warn(ckpt_dir, config, params, tokenizer)
    if params is None:
        params = (convert.load_gguf(path, keep_quantized=keep_quantized, reader=reader)[1] if is_gguf
                  else convert.load_hf_dir(path)[1])
        if save:
            _save_or_warn(ckpt_dir, config, params, tokenizer)
    # stored in the compute dtype (cast on the host for converted arrays: no float32 device copy).
    # The cache's buffer is ours alone and aligned: the device takes it as it is. Converted arrays
    # are copied (jnp.asarray): one may be a view of the source's memory map.
    params = llama.cast_params(params, dtype)
    params = jax.device_put(params) if how == "cache" else jax.tree.map(jnp.asarray, params)
    return Model(config, params, tokenizer, name, dtype, time.perf_counter() - start, how)


def _load_sharded(path, name, is_gguf, config, ckpt_dir, dtype, cache, keep_quantized, mesh, role):
    """(config, name, placed params, how) where each process reads only its devices' parts (`shards`).

    The model comes back as `sharding.prepare_model` makes it for this mesh and role: where that
    repeats the KV heads (a model axis wider than them), each device's copy of a KV head is read
    from the file's head (`shards.repeat_kv`), so no process reads the KV heads it does not hold."""
    import numpy as np

    from specjax import sharding
    from specjax.models import shards

    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    mesh_config = sharding.MeshConfig.of(mesh)
    if mesh_config.attention == "pad" and (role == "target" or mesh_config.draft == "shard"):
        n = mesh_config.rules.size(mesh_config.mesh, "heads")
        if sharding.padded_counts(config, n) != (config.num_heads, config.num_kv_heads):
            raise ValueError(f"loading per shard with attention='pad' would need zero heads appended to "
                             f"{config.num_heads}/{config.num_kv_heads} heads, which is not done per shard; "
                             "load with attention='auto' or 'replicate' (or without mesh=)")

    def lazy(dt):
        return (shards.lazy_gguf(path, dt, keep_quantized=keep_quantized) if is_gguf
                else shards.lazy_hf_dir(path, dt))[1]

    # the plan needs shapes only: the lazy tree reads nothing but the checkpoint's metadata
    converted = lazy(np.float32)
    prepared = (role == "target" or mesh_config.draft == "shard") and sharding.needs_preparing(mesh_config)
    if prepared:  # the engine's own step, on the abstract model: the same decision and the same errors
        planned = sharding.prepare_model(mesh_config, Model(config, shards.abstract(converted), name=name), role)
        r = planned.config.num_kv_heads // config.num_kv_heads
        if r > 1:  # KV heads repeated (wide tensor parallelism); the cache holds the repeated layout
            config, name, ckpt_dir = planned.config, planned.name, ckpt_dir.with_name(f"{ckpt_dir.name}-kv{r}")
            converted = shards.repeat_kv(converted, r)
    else:
        r = 1
    plan_config = mesh_config
    if role == "draft" and mesh_config.draft == "replicate":  # a replicated draft's plan ignores the heads
        plan_config = dataclasses.replace(mesh_config, attention="replicate")
    layout = sharding.make_layout(plan_config, config, config if role == "draft" else None)
    shardings = layout.param_shardings(shards.abstract(converted), role)
    if cache and (ckpt_dir / "config.json").is_file():
        try:
            params = _restore(ckpt_dir, config, shards.abstract(converted), shardings)
            return config, name, llama.cast_params(params, dtype), "cache"
        except Exception as e:  # a corrupt or partial cache is ignored, as in the one-process path
            logging.warning("ignoring unreadable parameter cache %s: %s", ckpt_dir, e)
    if cache and jax.process_count() == 1:  # several processes write no cache (see shards)
        params = shards.place(converted, shardings)
        _save_or_warn(ckpt_dir, config, params)
        return config, name, llama.cast_params(params, dtype), "converted"
    return config, name, shards.place(shards.repeat_kv(lazy(jnp.dtype(dtype)), r), shardings), "converted"


def _read_config_and_tokenizer(path: pathlib.Path, is_gguf: bool, reader=None):
    from specjax.models import tokenizer as tokenizer_lib

    if is_gguf:
        reader = convert.open_gguf(path) if reader is None else reader
        config = convert.gguf_config(reader, path)[0]
        try:
            return config, tokenizer_lib.Tokenizer.from_gguf(reader)
        except LoadError as e:
            raise e.with_path(path) from e.__cause__
    config = convert.config_from_json(path / "config.json")
    tok = tokenizer_lib.Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return config, tok


def _save_or_warn(ckpt_dir: pathlib.Path, config: Config, params, tokenizer=False) -> None:
    """The cache is optional: a read-only or full cache directory (or any failure to write it)
    is one warning, and the load goes on with the converted parameters."""
    try:
        _save(ckpt_dir, config, params, tokenizer)
    except Exception as e:  # OSError (EROFS, ENOSPC, EACCES), or any other failure to write
        logging.warning("could not write the parameter cache %s (%s); loading on without it",
                        ckpt_dir, str(e).splitlines()[0][:300] if str(e) else type(e).__name__)


_CONFIG = "config.json"  # `dataclasses.asdict(config)`
_QUANTIZED = "quantized.json"  # {flat path: logical shape} of the block-quantized leaves
_TOKENIZER = "tokenizer_state.json"  # `Tokenizer.to_state()`, or null for a model without one


def _save(ckpt_dir: pathlib.Path, config: Config, params, tokenizer=False) -> None:
    """`tokenizer`: the model's (None: it has none) is kept beside the weights, so that a warm
    load need not read the source; False (the default) keeps none."""
    import numpy as np

    plain, quantized = quant.to_plain(params)
    arrays = {k: np.asarray(v) for k, v in _param_cache.flatten(plain).items()}
    meta = {_CONFIG: json.dumps(dataclasses.asdict(config)).encode(), _QUANTIZED: json.dumps(quantized).encode()}
    if tokenizer is not False:
        meta[_TOKENIZER] = json.dumps(None if tokenizer is None else tokenizer.to_state()).encode()
    _param_cache.write(ckpt_dir, arrays, meta)


def _verify(ckpt_dir: pathlib.Path) -> None:
    """Every file is listed in the manifest with its size and chunk hashes, and nothing else is there."""
    _param_cache.check(ckpt_dir)


def expected_shapes(config: Config) -> dict:
    """The shape of every leaf of this config's parameter tree, from `convert.param_spec` (the map
    from checkpoints to `llama.Transformer`'s tree; tests pin the two equal): pure Python, where
    tracing the module's init costs a third of a second."""
    L = config.num_layers

    def shape(leaf: convert.Leaf):
        own = (*leaf.in_shape, *leaf.out_shape) if leaf.kind == "linear" else leaf.in_shape
        return (L, *own) if leaf.stacked else tuple(own)

    return convert.map_spec(config, shape)


def _check_tree(config: Config, params) -> None:
    """The restored tree has exactly the structure and shapes of this config's parameters."""
    is_leaf = lambda x: isinstance(x, (quant.BlockQuant, tuple))  # noqa: E731
    got = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)[0]
    want = jax.tree_util.tree_flatten_with_path(expected_shapes(config), is_leaf=is_leaf)[0]
    if [p for p, _ in got] != [p for p, _ in want]:
        raise CacheError("parameter tree differs from the model's")
    for (path, x), (_, w) in zip(got, want):
        shape = (*x.codes.shape[: x.codes.ndim - 3], *x.shape) if isinstance(x, quant.BlockQuant) else tuple(x.shape)
        if shape != w:
            raise CacheError(f"{jax.tree_util.keystr(path)} has shape {shape}, expected {w}")


def _restore(ckpt_dir: pathlib.Path, config: Config, abstract_params=None, shardings=None):
    """The cached params (host arrays); with `abstract_params` and `shardings` (matching trees),
    global arrays at those shardings, of which this process read and checked only the 8 MiB
    chunks that hold its devices' parts. Nothing is used before its chunk's hash matched."""
    targets = None
    if abstract_params is not None:
        targets = _param_cache.flatten(quant.to_plain(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, shardings))[0])
        meta, flat = _param_cache.read_regions(ckpt_dir, (_CONFIG, _QUANTIZED),
                                               _param_cache.device_regions(targets))
    else:
        meta, flat = _param_cache.read(ckpt_dir, (_CONFIG, _QUANTIZED))
    if _json(meta, _CONFIG) != json.loads(json.dumps(dataclasses.asdict(config))):
        raise CacheError("cached config differs from the checkpoint's")
    params = _tree(meta, flat, config)
    if targets is None:
        return params
    if set(flat) != set(targets):
        raise CacheError("the cached arrays are not the ones this load places")
    placed = {}
    for k, t in targets.items():
        if flat[k].dtype != t.dtype:
            raise CacheError(f"{k} is cached as {flat[k].dtype}, expected {t.dtype}")
        placed[k] = jax.make_array_from_callback(t.shape, t.sharding, lambda index, a=flat[k]: a[index])
    return quant.from_plain(_param_cache.unflatten(placed), _json(meta, _QUANTIZED))


def _restore_model(ckpt_dir: pathlib.Path):
    """(config, host params, tokenizer) from the cache alone, every byte checked first. The
    config and tokenizer are built, and the device started, while the weights are read."""
    from specjax.models import tokenizer as tokenizer_lib

    built = {}

    def during(meta):
        saved = _json(meta, _CONFIG)
        try:
            config = Config(**{**saved, "rope_scaling": saved["rope_scaling"] and RopeScaling(**saved["rope_scaling"]),
                               "rope_freq_factors": saved["rope_freq_factors"] and tuple(saved["rope_freq_factors"]),
                               "eos_token_ids": tuple(saved["eos_token_ids"])})
        except (TypeError, KeyError, LoadError) as e:
            raise CacheError(f"config.json is not a config: {e}") from None
        if json.loads(json.dumps(dataclasses.asdict(config))) != saved:
            raise CacheError("config.json does not round-trip to the same config")
        state = _json(meta, _TOKENIZER)
        try:
            built["tokenizer"] = None if state is None else tokenizer_lib.Tokenizer.from_state(state)
        except ValueError as e:
            raise CacheError(f"{_TOKENIZER}: {e}") from None
        built["config"] = config
        jax.devices()  # the backend's start, which the arrays' placement would wait for

    meta, flat = _param_cache.read(ckpt_dir, (_CONFIG, _QUANTIZED, _TOKENIZER), during)
    return built["config"], _tree(meta, flat, built["config"]), built["tokenizer"]


def _json(meta: dict, name: str):
    try:
        return json.loads(meta[name])
    except ValueError as e:
        raise CacheError(f"unreadable metadata {name}: {e}") from None


def _tree(meta: dict, flat: dict, config: Config):
    """The parameter tree of the flat arrays, its quantized leaves rebuilt and every shape checked."""
    quantized = _json(meta, _QUANTIZED)
    if not isinstance(quantized, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and v and all(isinstance(d, int) and d > 0 for d in v)
            for k, v in quantized.items()):
        raise CacheError("quantized.json is not a {path: shape} map")
    plain = _param_cache.unflatten(flat)
    try:
        params = quant.from_plain(plain, quantized)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        raise CacheError(f"quantized.json does not match the saved arrays: {e!r}") from None
    _check_tree(config, params)
    return params
