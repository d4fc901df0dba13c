"""The converted-parameter cache is used only when intact: a flipped byte in any of its files,
invalid metadata or a missing file means one warning and a rebuild from the source checkpoint."""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import pytest

from specjax import models
from specjax.models import model as model_lib

from test_models import _save_tiny_hf


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf")
    _save_tiny_hf("llama-gqa-tied", path)
    return path


def _load(path, caplog):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        m = models.load(path)
    return m, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _cache(tmp_path):
    (ckpt,) = [p for p in (tmp_path / "params").iterdir() if not p.name.count(".tmp")]
    return ckpt


def test_every_cache_file_is_checked_and_a_damaged_cache_rebuilt(tiny_dir, tmp_path, monkeypatch, caplog, capfd):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    fresh, _ = _load(tiny_dir, caplog)
    tokens = np.array([[1, 5, 9, 200]])
    want = np.asarray(fresh.logits(tokens))
    ckpt = _cache(tmp_path)
    files = sorted(f.relative_to(ckpt) for f in ckpt.rglob("*") if f.is_file())
    kinds = {f.name if "/d/" not in str(f) else "data" for f in files}
    assert {"data", "config.json", "quantized.json", "manifest.json", "_METADATA"} <= kinds, kinds
    i = 0
    while True:  # data files get new names, and orbax may split them differently, at each save: list again
        assert _load(tiny_dir, caplog)[0].load_source == "orbax-cache"
        listing = sorted(f.relative_to(ckpt) for f in ckpt.rglob("*") if f.is_file())
        if i >= len(listing):
            break
        rel, i = listing[i], i + 1
        f = ckpt / rel
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01  # one flipped bit
        f.write_bytes(bytes(data))
        m, warnings = _load(tiny_dir, caplog)
        assert m.load_source == "converted", rel
        assert len(warnings) == 1 and "failed its check" in warnings[0] and "rebuilding" in warnings[0], warnings
        np.testing.assert_array_equal(np.asarray(m.logits(tokens)), want)
    assert i >= len(kinds)
    os.unlink(next(ckpt.rglob("d/*")))  # a deleted data file
    m, warnings = _load(tiny_dir, caplog)
    assert m.load_source == "converted" and "manifest" in warnings[0]
    assert "Event loop is closed" not in capfd.readouterr().err


@pytest.mark.parametrize("metadata", ["[]", '{"/layers/wq": [64, 8, 8]}', '{"/embed": "x"}', "not json"])
def test_invalid_metadata_with_a_matching_manifest_is_rebuilt(metadata, tiny_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    _load(tiny_dir, caplog)
    ckpt = _cache(tmp_path)
    (ckpt / "quantized.json").write_text(metadata)
    # re-signed, so that only the metadata check can catch it
    (ckpt / "manifest.json").write_text(json.dumps({"version": 1, "sha256": model_lib._file_hashes(ckpt)}))
    with pytest.raises(model_lib.CacheError):
        model_lib._restore(ckpt, models.load(tiny_dir, cache=False).config)
    m, warnings = _load(tiny_dir, caplog)
    assert m.load_source == "converted" and len(warnings) == 1
    assert _load(tiny_dir, caplog)[0].load_source == "orbax-cache"  # and the rebuilt cache is used


def test_stale_temporaries_of_a_killed_save_are_removed(tiny_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    _load(tiny_dir, caplog)
    ckpt = _cache(tmp_path)
    dead = ckpt.with_name(ckpt.name + ".tmp99999999")  # no such process
    alive = ckpt.with_name(ckpt.name + f".tmp{os.getppid()}")  # a live process may still be saving
    for d in (dead, alive):
        (d / "params").mkdir(parents=True)
        (d / "params" / "blob").write_bytes(b"x" * 1000)
    m, warnings = _load(tiny_dir, caplog)
    assert m.load_source == "orbax-cache"
    assert not dead.exists() and alive.exists()
    assert any("interrupted save" in w for w in warnings)


def test_quantized_cache_with_emptied_metadata_is_refused(tiny_dir, tmp_path):
    """quantized.json of {} or [] for a cache that holds block-quantized layers (a GGUF's)."""
    from specjax.models import quant

    loaded = models.load(tiny_dir, cache=False)
    config, params = loaded.config, jax.tree.map(np.asarray, loaded.params)
    L, D, H, Dh = params["layers"]["wq"].shape
    params["layers"]["wq"] = quant.BlockQuant(np.ones((L, D // 32, 32, H * Dh), np.int8),
                                              np.ones((L, D // 32, 1, H * Dh), np.float32), None, (D, H, Dh))
    ckpt = tmp_path / "q"
    model_lib._save(ckpt, config, params)
    restored = model_lib._restore(ckpt, config)
    np.testing.assert_array_equal(restored["layers"]["wq"].dequantize(), np.ones((L, D, H, Dh), np.float32))
    for metadata in ("{}", "[]"):
        (ckpt / "quantized.json").write_text(metadata)
        (ckpt / "manifest.json").write_text(json.dumps({"version": 1, "sha256": model_lib._file_hashes(ckpt)}))
        with pytest.raises(model_lib.CacheError):
            model_lib._restore(ckpt, config)


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe"])
def test_tokenizer_state_rebuilds_the_same_tokenizer(pre, tmp_path):
    """The cache keeps the tokenizer as `to_state()`: what comes back encodes, decodes and
    templates as the one built from the GGUF's metadata, and a damaged state is refused."""
    pytest.importorskip("gguf")
    from _tokenizer_corpus import CONVERSATIONS, CORPUS, _write_gguf

    from specjax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", pre=pre, bos=1, add_bos=True))
    back = Tokenizer.from_state(json.loads(json.dumps(tok.to_state())))
    for name in Tokenizer._STATE_FIELDS:
        assert getattr(back, name) == getattr(tok, name), name
    for text in CORPUS:
        assert back.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    for messages in CONVERSATIONS:
        assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)
    state = tok.to_state()
    for bad in ({**state, "version": 2}, {**state, "backend": "{"}, {**state, "eos_token_id": 10 ** 6}, [],
                {k: v for k, v in state.items() if k != "eos_token_id"}):
        with pytest.raises(ValueError):
            Tokenizer.from_state(bad)


def test_a_warm_load_reads_nothing_of_the_source_but_its_stat(tmp_path, monkeypatch, caplog):
    """Config, tokenizer and weights all come from the cache: the source's files are not opened."""
    pytest.importorskip("gguf")
    from _tokenizer_corpus import CORPUS, _write_gguf

    from specjax.models import convert
    from specjax.models.tokenizer import Tokenizer

    src = tmp_path / "hf"
    _save_tiny_hf("llama-gqa-tied", src)
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf"))
    tok.backend.save(str(src / "tokenizer.json"))
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    fresh, _ = _load(src, caplog)
    assert fresh.load_source == "converted" and fresh.tokenizer is not None

    def refuse(*args, **kwargs):
        raise AssertionError("a warm load read the source")

    with monkeypatch.context() as m:
        for module, fn in ((model_lib, "_read_config_and_tokenizer"), (convert, "load_hf_dir"),
                           (convert, "config_from_json"), (Tokenizer, "from_dir")):
            m.setattr(module, fn, refuse)
        warm, warnings = _load(src, caplog)
    assert warm.load_source == "orbax-cache" and not warnings
    assert warm.config == fresh.config
    for text in CORPUS:
        assert warm.tokenizer.encode(text) == fresh.tokenizer.encode(text)
    tokens = np.array([[1, 5, 9, 200]])
    np.testing.assert_array_equal(np.asarray(warm.logits(tokens)), np.asarray(fresh.logits(tokens)))
    # a tokenizer file replaced in the source: its stat changes the key, so the cache is not served
    tok.backend.save(str(src / "tokenizer.json"))
    assert _load(src, caplog)[0].load_source == "converted"


@pytest.mark.parametrize("changes", [{}, {"qkv_bias": True}, {"tie_embeddings": True, "num_kv_heads": 4}])
def test_the_cache_check_expects_the_models_own_shapes(changes):
    """`_check_tree` compares with shapes from `convert.param_spec` (no tracing): they are the
    module's own, leaf for leaf."""
    import dataclasses

    from specjax.models import llama
    from specjax.models.config import Config

    config = dataclasses.replace(Config(vocab_size=211, hidden_size=64, intermediate_size=96, num_layers=3,
                                        num_heads=8, num_kv_heads=2, head_dim=8), **changes)
    want = jax.tree.map(lambda x: tuple(x.shape), llama.param_shapes(config))
    assert model_lib.expected_shapes(config) == want
    params = jax.tree.map(lambda s: np.zeros(s, np.float32), want, is_leaf=lambda x: isinstance(x, tuple))
    model_lib._check_tree(config, params)
    params["layers"]["wq"] = np.zeros((3, 64, 8, 4), np.float32)
    with pytest.raises(model_lib.CacheError, match="wq"):
        model_lib._check_tree(config, params)


def test_a_cache_without_the_tokenizer_is_served_then_completed(tiny_dir, tmp_path, monkeypatch, caplog):
    """A cache written before the tokenizer was kept (or by the per-shard path) still serves its
    weights, and is rewritten once with the tokenizer, so that later loads read only the cache."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    fresh = models.load(tiny_dir, cache=False)
    first, _ = _load(tiny_dir, caplog)
    ckpt = _cache(tmp_path)
    model_lib._save(ckpt, first.config, jax.tree.map(np.asarray, first.params))  # the older layout: no tokenizer
    assert not (ckpt / model_lib._TOKENIZER).exists()
    m, warnings = _load(tiny_dir, caplog)
    assert m.load_source == "orbax-cache" and not warnings and (ckpt / model_lib._TOKENIZER).is_file()
    model_lib._verify(ckpt)  # rewritten whole: its manifest lists the new file
    tokens = np.array([[1, 5, 9, 200]])
    np.testing.assert_array_equal(np.asarray(m.logits(tokens)), np.asarray(fresh.logits(tokens)))
    assert _load(tiny_dir, caplog)[0].load_source == "orbax-cache"
