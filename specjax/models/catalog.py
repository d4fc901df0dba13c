"""Configs of real models by name, as their published `config.json` files give them.

No weights: these feed `models.abstract` (parameters as `jax.ShapeDtypeStruct`s) for
compiling, planning and memory accounting at real size. Each entry is the model's
config.json (the fields that describe the computation, plus the ones the parser
ignores by name), parsed by `config.from_hf_dict`, so an unsupported field is
named exactly as it would be for a downloaded checkpoint.

The preset names (`smollm2-135m-instruct`, `qwen2.5-coder-{0.5b,1.5b}-instruct`) give
the same architecture as their GGUF files (checked in tests against the file).
"""

from __future__ import annotations

from specjax.models import config as config_lib
from specjax.models.config import Config

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama3(hidden, inter, layers, heads, kv, tie, factor, **extra):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
        "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": heads,
        "num_hidden_layers": layers, "num_key_value_heads": kv, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": factor}, "rope_theta": 500000.0,
        "tie_word_embeddings": tie, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256, **extra,
    }


def _qwen2(hidden, inter, layers, heads, kv, tie, vocab, max_pos, eos=151643, sliding=131072):
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": eos, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": max_pos,
        "max_window_layers": layers, "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": sliding,
        "tie_word_embeddings": tie, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": vocab,
    }


_SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
    "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49152,
}

# name -> config.json (Hugging Face repositories meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B,
# meta-llama/Llama-3.1-70B, meta-llama/Llama-3.1-405B, Qwen/Qwen2.5-7B, Qwen/Qwen2.5-Coder-{0.5B,1.5B,7B}[-Instruct],
# HuggingFaceTB/SmolLM2-135M-Instruct).
HF_CONFIGS: dict[str, dict] = {
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, True, 32.0, head_dim=64),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8, False, 8.0),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64, 8, False, 8.0),
    "llama-3.1-405b": _llama3(16384, 53248, 126, 128, 8, False, 8.0),
    "qwen2.5-7b": _qwen2(3584, 18944, 28, 28, 4, False, 152064, 131072),
    "qwen2.5-coder-7b": _qwen2(3584, 18944, 28, 28, 4, False, 152064, 32768),
    "qwen2.5-coder-1.5b": _qwen2(1536, 8960, 28, 12, 2, True, 151936, 32768, sliding=32768),
    "qwen2.5-coder-0.5b": _qwen2(896, 4864, 24, 14, 2, True, 151936, 32768, sliding=32768),
    "qwen2.5-coder-1.5b-instruct": _qwen2(1536, 8960, 28, 12, 2, True, 151936, 32768, eos=151645),
    "qwen2.5-coder-0.5b-instruct": _qwen2(896, 4864, 24, 14, 2, True, 151936, 32768, eos=151645),
    "smollm2-135m-instruct": _SMOLLM2_135M,
}
ALIASES = {"smollm2-135m": "smollm2-135m-instruct"}
NAMES = tuple(HF_CONFIGS) + tuple(ALIASES)


def config(name: str) -> Config:
    """The Config of a real model by name (see `NAMES`)."""
    key = ALIASES.get(name, name)
    if key not in HF_CONFIGS:
        raise KeyError(f"unknown model config {name!r} (known: {', '.join(NAMES)})")
    return config_lib.from_hf_dict(HF_CONFIGS[key])
