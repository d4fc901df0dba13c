"""Llama-family decoder, configs, loaders and tokenizer.

    m = models.load("smollm2-135m-instruct")   # preset, .gguf path, or HF directory
    m.config, m.params, m.tokenizer
    logits = m.logits(tokens)                   # int32[B, T] -> float32[B, T, V]
"""

from specjax.models.config import Config, ConfigError, RopeScaling, from_hf_dict
from specjax.models.convert import MissingTensorError
from specjax.models.llama import KVCache, forward, forward_cached, init_cache, init_params
from specjax.models.model import Model, load, random_model
from specjax.models.presets import DEFAULT_PRESET, PRESETS, PresetError

__all__ = [
    "Config", "ConfigError", "RopeScaling", "from_hf_dict", "MissingTensorError", "KVCache", "forward",
    "forward_cached", "init_cache", "init_params", "Model", "load", "random_model", "DEFAULT_PRESET",
    "PRESETS", "PresetError",
]
