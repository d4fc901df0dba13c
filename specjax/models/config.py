"""Model configuration for the Llama family (Llama 1-3, SmolLM2, Qwen2).

A `Config` is a frozen, hashable dataclass so that it can be a static argument
of `jax.jit`. It is built from a Hugging Face `config.json` or from GGUF
metadata; both builders reject fields they do not implement, naming them,
rather than silently computing something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from specjax._files import LoadError


class ConfigError(LoadError):
    """A checkpoint asks for something this decoder does not implement, or lacks a field it needs."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type="llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class Config:
    """Dimensions (nanodo letters): V vocab, D width, F mlp width, L layers,
    H query heads, G kv heads (grouped-query attention), Dh head dim."""

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # G
    head_dim: int  # Dh
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors from a GGUF `rope_freqs.weight` tensor (llama.cpp's
    # precomputed form of Llama-3 scaling); a tuple so the config stays hashable.
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # Ids >= vocab_used are padding columns (a draft padded to its target's larger
    # embedding table, `models.pad_vocab`): their logits are -inf. None: all are real.
    vocab_used: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.vocab_used is not None and not 0 < self.vocab_used <= self.vocab_size:
            raise ConfigError(f"vocab_used={self.vocab_used} must be in [1, vocab_size={self.vocab_size}]")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ConfigError(f"rope_freqs has {len(self.rope_freq_factors)} entries, "
                              f"expected head_dim/2 = {self.head_dim // 2}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, h, g, dh = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        per_layer = d * h * dh * 2 + d * g * dh * 2 + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += (h + 2 * g) * dh
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + d


# --- Hugging Face config.json -------------------------------------------------

# Fields that describe training, serialization or the library: they do not change logits.
_HF_IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "initializer_range",
    "use_cache", "pad_token_id", "_name_or_path", "attention_dropout", "pretraining_tp",
    "output_attentions", "output_hidden_states", "return_dict", "tie_encoder_decoder", "is_decoder",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "tokenizer_class",
    "max_window_layers", "use_return_dict", "bos_token_id", "eos_token_id", "layer_types",
    "rope_parameters", "name_or_path", "use_mrope", "is_llama_config",
}
# Fields that change the computation, each with the only value we implement.
_HF_REQUIRED_VALUES = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "use_sliding_window": (False,),
    "rope_interleaved": (False,),  # nanotron's flag; False is transformers' rotate_half
    "head_dim": None,  # checked below against hidden_size / num_heads or used as given
}


def from_hf_dict(cfg: Mapping[str, Any]) -> Config:
    """Builds a Config from a transformers `config.json` dict (Llama or Qwen2)."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: llama, qwen2)")
    handled = {
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
        "rope_scaling", "max_position_embeddings", "sliding_window",
    } | _HF_IGNORED | set(_HF_REQUIRED_VALUES)
    unknown = sorted(k for k in cfg if k not in handled)
    if unknown:
        raise ConfigError(f"unsupported config field(s): {', '.join(unknown)}")
    for key, allowed in _HF_REQUIRED_VALUES.items():
        if allowed is not None and key in cfg and cfg[key] not in allowed:
            raise ConfigError(f"unsupported config field {key}={cfg[key]!r} (supported: {allowed})")
    num_heads = _int(cfg, "num_attention_heads")
    head_dim = _int(cfg, "head_dim") if cfg.get("head_dim") else _int(cfg, "hidden_size") // num_heads
    rope = _hf_rope(cfg)
    qkv_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    try:
        eos_ids = tuple(int(e) for e in eos_ids)
    except (TypeError, ValueError):
        raise ConfigError(f"field 'eos_token_id' = {eos!r} is not a token id or a list of them") from None
    return Config(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=_int(cfg, "hidden_size"),
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=_int(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else num_heads,
        head_dim=head_dim,
        rope_theta=_number(cfg, "rope_theta", _rope_theta(cfg)),
        rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        rope_scaling=rope,
        max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture="qwen2" if model_type == "qwen2" else "llama",
    )


_MISSING = object()


def _int(cfg: Mapping[str, Any], key: str, default: Any = _MISSING, prefix: str = "") -> int:
    """cfg[key] as an int; a missing key or a value that is not a whole number is a ConfigError
    naming the key (the caller names the file)."""
    value = cfg.get(prefix + key, default)
    if value is _MISSING or value is None:
        raise ConfigError(f"missing required field {prefix + key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or value != int(value):
        raise ConfigError(f"field {prefix + key!r} = {value!r} is not an integer")
    return int(value)


def _number(cfg: Mapping[str, Any], key: str, default: Any, prefix: str = "") -> float:
    value = cfg.get(prefix + key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(f"field {prefix + key!r} = {value!r} is not a number")
    return float(value)


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return cfg.get("rope_theta", params.get("rope_theta", 10000.0))


def _hf_rope(cfg: Mapping[str, Any]) -> RopeScaling | None:
    # transformers 4.x writes `rope_scaling`; 5.x writes `rope_parameters` (with rope_theta inside).
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"unsupported config field rope_scaling type {kind!r} (supported: llama3)")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ConfigError(f"missing required field 'rope_scaling.{key}' (rope_type llama3)")
    return RopeScaling(
        factor=_number(rs, "factor", None),
        low_freq_factor=_number(rs, "low_freq_factor", None),
        high_freq_factor=_number(rs, "high_freq_factor", None),
        original_max_position_embeddings=_int(rs, "original_max_position_embeddings"),
    )


# --- GGUF metadata ------------------------------------------------------------

_GGUF_ARCHES = ("llama", "qwen2")
# Metadata keys under the architecture prefix that this decoder implements or that do
# not change the computation.
_GGUF_HANDLED = {
    "block_count", "context_length", "embedding_length", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "rope.freq_base",
    "attention.layer_norm_rms_epsilon", "vocab_size", "rope.dimension_count",
    "attention.key_length", "attention.value_length", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.finetuned", "expert_count",
    "expert_used_count",
}


def from_gguf_fields(fields: Mapping[str, Any], *, tensor_names=(), rope_freqs=None) -> Config:
    """Builds a Config from decoded GGUF metadata {key: value}.

    `tensor_names` tells whether an output head exists (untied embeddings);
    `rope_freqs` is the decoded `rope_freqs.weight` tensor if the file has one.
    """
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCHES:
        raise ConfigError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_GGUF_ARCHES)})")
    prefix = arch + "."
    unknown = sorted(k for k in fields if k.startswith(prefix) and k[len(prefix):] not in _GGUF_HANDLED)
    if unknown:
        raise ConfigError(f"unsupported GGUF metadata field(s): {', '.join(unknown)}")
    get = lambda k, default=None: fields.get(prefix + k, default)  # noqa: E731
    if get("expert_count", 0):
        raise ConfigError(f"unsupported GGUF metadata field {prefix}expert_count={get('expert_count')} (MoE)")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ConfigError(f"unsupported GGUF metadata field {prefix}rope.scaling.type={scaling!r}")
    num_heads = _int(fields, "attention.head_count", prefix=prefix)
    width = _int(fields, "embedding_length", prefix=prefix)
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or width // num_heads)
    if get("rope.dimension_count") not in (None, head_dim):
        raise ConfigError(f"partial rotary embedding ({prefix}rope.dimension_count="
                          f"{get('rope.dimension_count')} < head_dim={head_dim}) is not supported")
    if get("attention.value_length") not in (None, head_dim):
        raise ConfigError(f"unsupported {prefix}attention.value_length != key_length")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(fields.get("tokenizer.ggml.tokens", ()))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return Config(
        vocab_size=int(vocab),
        hidden_size=width,
        intermediate_size=_int(fields, "feed_forward_length", prefix=prefix),
        num_layers=_int(fields, "block_count", prefix=prefix),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in set(tensor_names),
        qkv_bias=arch == "qwen2",
        rope_freq_factors=None if rope_freqs is None else tuple(float(x) for x in np.asarray(rope_freqs)),
        max_position_embeddings=int(get("context_length", 2048)),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        architecture=arch,
    )
