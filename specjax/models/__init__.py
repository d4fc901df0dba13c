"""Llama-family decoder, configs, loaders and tokenizer.

    m = models.load("smollm2-135m-instruct")   # preset, .gguf path, or HF directory
    m.config, m.params, m.tokenizer
    logits = m.logits(tokens)                   # int32[B, T] -> float32[B, T, V]
    m = models.load(..., dtype=jnp.bfloat16)    # params and KV caches in bfloat16, logits float32
    a = models.abstract("llama-3.1-8b", jnp.bfloat16)  # params as ShapeDtypeStructs (compile only)
    d = feature_draft.load(DIR)                 # a FeatureDraft: Engine(m, draft=d)
    except models.LoadError as e: ...           # any damaged or inconsistent input: "<file>: <problem>"
"""

from specjax._files import LoadError
from specjax.models.config import Config, ConfigError, RopeScaling, from_hf_dict
from specjax.models.convert import CheckpointError, MissingTensorError
from specjax.models.feature_draft import FeatureDraft
from specjax.models.llama import (KVCache, cast_params, forward, forward_cached, forward_features, init_cache,
                                  init_params)
from specjax.models.catalog import NAMES as CONFIG_NAMES
from specjax.models.model import Model, abstract, is_abstract, load, pad_vocab, random_model
from specjax.models.presets import DEFAULT_PRESET, PRESETS, PresetError

__all__ = [
    "LoadError", "CheckpointError", "Config", "ConfigError", "FeatureDraft", "forward_features", "RopeScaling", "from_hf_dict", "MissingTensorError", "KVCache", "forward",
    "forward_cached", "init_cache", "init_params", "Model", "load", "random_model", "DEFAULT_PRESET",
    "PRESETS", "PresetError", "CONFIG_NAMES", "abstract", "cast_params", "is_abstract", "pad_vocab",
]
