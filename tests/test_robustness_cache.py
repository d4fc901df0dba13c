"""The converted-parameter cache is used only when intact: a flipped bit in any of its files, a
truncated file, invalid metadata or a missing file means one warning and a rebuild from the source
checkpoint; what it serves equals the uncached load bit for bit, read without orbax."""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
import pytest

from specjax import models
from specjax.models import _param_cache
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


FILES = {"params.safetensors", "config.json", "quantized.json", "tokenizer_state.json", "manifest.json"}


def _flip(f, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0x01  # one flipped bit
    f.write_bytes(bytes(data))


def _assert_rebuilt(tiny_dir, caplog, want, says="failed its check"):
    m, warnings = _load(tiny_dir, caplog)
    assert m.load_source == "converted"
    assert len(warnings) == 1 and says in warnings[0] and "rebuilding" in warnings[0], warnings
    np.testing.assert_array_equal(np.asarray(m.logits(TOKENS)), want)
    return warnings[0]


TOKENS = np.array([[1, 5, 9, 200]])


def test_every_cache_file_is_checked_and_a_damaged_cache_rebuilt(tiny_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    want = np.asarray(_load(tiny_dir, caplog)[0].logits(TOKENS))
    ckpt = _cache(tmp_path)
    assert {f.name for f in ckpt.iterdir()} == FILES
    size = (ckpt / "params.safetensors").stat().st_size
    # every file in its middle; the weights also in their header's length, header and last byte
    places = [(name, None) for name in sorted(FILES)] + [("params.safetensors", at) for at in (2, 40, size - 1)]
    for name, at in places:
        assert _load(tiny_dir, caplog)[0].load_source == "cache"
        f = ckpt / name
        _flip(f, f.stat().st_size // 2 if at is None else at)
        _assert_rebuilt(tiny_dir, caplog, want)
    assert _load(tiny_dir, caplog)[0].load_source == "cache"
    (ckpt / "quantized.json").unlink()
    assert "manifest" in _assert_rebuilt(tiny_dir, caplog, want)
    (ckpt / "extra").write_bytes(b"")  # a file the save did not write
    assert "extra" in _assert_rebuilt(tiny_dir, caplog, want)
    assert _load(tiny_dir, caplog)[0].load_source == "cache"


@pytest.mark.parametrize("name,keep", [("params.safetensors", -1), ("params.safetensors", 100),
                                       ("manifest.json", -1), ("manifest.json", 40), ("manifest.json", 0)])
def test_a_truncated_cache_file_is_caught_and_rebuilt(name, keep, tiny_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    want = np.asarray(_load(tiny_dir, caplog)[0].logits(TOKENS))
    f = _cache(tmp_path) / name
    data = f.read_bytes()
    f.write_bytes(data[:keep])
    says = _assert_rebuilt(tiny_dir, caplog, want)
    assert ("bytes" in says) if name == "params.safetensors" else ("manifest" in says), says
    assert _load(tiny_dir, caplog)[0].load_source == "cache"


@pytest.mark.parametrize("metadata", ["[]", '{"/layers/wq": [64, 8, 8]}', '{"/embed": "x"}', "not json"])
def test_invalid_metadata_with_a_matching_manifest_is_rebuilt(metadata, tiny_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    _load(tiny_dir, caplog)
    ckpt = _cache(tmp_path)
    (ckpt / "quantized.json").write_text(metadata)
    _param_cache.sign(ckpt)  # re-signed, so that only the metadata check can catch it
    with pytest.raises(model_lib.CacheError):
        model_lib._restore(ckpt, models.load(tiny_dir, cache=False).config)
    m, warnings = _load(tiny_dir, caplog)
    assert m.load_source == "converted" and len(warnings) == 1
    assert _load(tiny_dir, caplog)[0].load_source == "cache"  # and the rebuilt cache is used


def test_a_re_signed_weights_header_that_lies_is_refused(tiny_dir, tmp_path, monkeypatch, caplog):
    """A safetensors header whose tensor overruns the file, or whose bytes do not match its shape."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    _load(tiny_dir, caplog)
    ckpt = _cache(tmp_path)
    f = ckpt / "params.safetensors"
    good = f.read_bytes()
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    name = next(k for k in header if k.startswith("layers/"))
    for change in ({"shape": [3, 7]}, {"data_offsets": [0, 10 ** 9]}, {"dtype": "X9"}):
        bad = json.dumps({**header, name: {**header[name], **change}}).encode()
        f.write_bytes(len(bad).to_bytes(8, "little") + bad + good[8 + n:])
        _param_cache.sign(ckpt)
        with pytest.raises(model_lib.CacheError, match="params.safetensors"):
            model_lib._restore(ckpt, models.load(tiny_dir, cache=False).config)


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
    assert m.load_source == "cache"
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
        _param_cache.sign(ckpt)
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
    assert warm.load_source == "cache" and not warnings
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
    assert m.load_source == "cache" and not warnings and (ckpt / model_lib._TOKENIZER).is_file()
    model_lib._verify(ckpt)  # rewritten whole: its manifest lists the new file
    tokens = np.array([[1, 5, 9, 200]])
    np.testing.assert_array_equal(np.asarray(m.logits(tokens)), np.asarray(fresh.logits(tokens)))
    assert _load(tiny_dir, caplog)[0].load_source == "cache"


@pytest.mark.parametrize("kind,kwargs", [
    ("hf", {}), ("hf-bf16-tied", {}), ("hf", {"dtype": "bfloat16"}),
    ("gguf-mixed", {}), ("gguf-mixed", {"keep_quantized": False}), ("gguf-mixed", {"dtype": "bfloat16"})])
def test_a_cached_load_equals_the_uncached_load_bit_for_bit(kind, kwargs, tmp_path, monkeypatch):
    """Float (float32, bf16 weights), block-quantized (Q8_0, K-quants, offsets) and expanded trees:
    the same structure, dtypes and bits from the cache as from the source."""
    import jax.numpy as jnp
    from _checkpoints import write_gguf, write_hf

    kwargs = {k: getattr(jnp, v) if k == "dtype" else v for k, v in kwargs.items()}
    path = (write_gguf(tmp_path / "m.gguf", layer_types=["Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q5_1"], tie=True)
            if kind.startswith("gguf") else
            write_hf(tmp_path / "hf", **({"tie": True, "dtype": "bfloat16"} if "bf16" in kind else {})))
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    want = models.load(path, cache=False, **kwargs)
    first, cached = models.load(path, **kwargs), models.load(path, **kwargs)
    assert (first.load_source, cached.load_source) == ("converted", "cache")
    assert cached.config == want.config
    assert jax.tree.structure(cached.params) == jax.tree.structure(want.params)
    for got, ref in zip(jax.tree.leaves(cached.params), jax.tree.leaves(want.params)):
        assert (got.dtype, got.shape) == (ref.dtype, ref.shape)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(ref).view(np.uint8))


def test_the_weights_file_is_aligned_safetensors(tmp_path):
    """Every tensor starts on a 64-byte boundary (what the CPU client needs to take the buffer
    without a copy), and the file is valid safetensors: the library's own reader agrees."""
    import ml_dtypes
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    arrays = {"a/x": rng.normal(size=(3, 5)).astype(np.float32), "a/y": np.arange(7, dtype=np.int8),
              "b": rng.normal(size=(2, 3)).astype(ml_dtypes.bfloat16), "c": np.zeros((0, 4), np.float32),
              "d": np.array(3.5, np.float16)}
    _param_cache.write(tmp_path / "e", arrays, {"m.json": b"{}"})
    f = tmp_path / "e" / "params.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 64 == 0
    header = json.loads(data[8:8 + n])
    assert all(v["data_offsets"][0] % 64 == 0 for k, v in header.items() if k in arrays)
    theirs = load_file(str(f))
    meta, ours = _param_cache.read(tmp_path / "e", ("m.json",))
    assert meta == {"m.json": b"{}"} and set(ours) == set(arrays)
    for k, a in arrays.items():
        assert ours[k].dtype == a.dtype and ours[k].shape == a.shape
        np.testing.assert_array_equal(ours[k], a)
        np.testing.assert_array_equal(theirs[k], a)
        assert ours[k].ctypes.data % 64 == 0 or ours[k].size == 0


def test_a_partial_read_reads_and_checks_only_the_chunks_it_needs(tmp_path, monkeypatch):
    """On a mesh each process reads the 8 MiB chunks that hold its devices' parts: damage
    elsewhere is not its concern (another process reads that part, and checks it), damage
    inside them is refused. The ranges come from the devices' index boxes."""
    import types

    rows, cols = 8, 1 << 19  # 8 rows of 2 MiB: 16 MiB, two chunks
    big = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    _param_cache.write(tmp_path / "e", {"w": big, "n": np.ones(3, np.float32)}, {"m.json": b"1"})
    row = cols * 4

    def held(*blocks):  # a sharding of which this process holds some row blocks
        boxes = {i: (slice(2 * b, 2 * b + 2), slice(None)) for i, b in enumerate(blocks)}
        return types.SimpleNamespace(addressable_devices_indices_map=lambda shape: boxes)

    target = lambda shape, *blocks: types.SimpleNamespace(shape=shape, sharding=held(*blocks))  # noqa: E731
    targets = {"w": target(big.shape, 0), "n": target((3,))}
    regions = _param_cache.device_regions(targets)
    layout = _param_cache._parse_params(_param_cache._read_file(
        tmp_path / "e" / "params.safetensors", _param_cache._manifest(tmp_path / "e")[1]["params.safetensors"],
        _param_cache.CHUNK))[1]
    assert regions(layout) == {"w": [(0, 2 * row)], "n": []}
    read = []
    real = _param_cache._read_into
    monkeypatch.setattr(_param_cache, "_read_into", lambda fd, view, off: read.append(view.size) or real(fd, view, off))
    _, got = _param_cache.read_regions(tmp_path / "e", ("m.json",), regions)
    np.testing.assert_array_equal(got["w"][:2], big[:2])
    assert sum(read) < 12 << 20  # chunk 0 (header and rows 0-1), not the second chunk
    f = tmp_path / "e" / "params.safetensors"
    _flip(f, f.stat().st_size - 10)  # in rows 6-7: unread here
    _param_cache.read_regions(tmp_path / "e", ("m.json",), regions)
    targets["w"] = target(big.shape, 0, 3)
    with pytest.raises(model_lib.CacheError, match="SHA-256 mismatch in params.safetensors"):
        _param_cache.read_regions(tmp_path / "e", ("m.json",), _param_cache.device_regions(targets))


def test_neither_the_conversion_nor_a_warm_load_imports_orbax(tmp_path):
    """A fresh process converts and then loads from the cache without orbax (whose import alone
    cost a warm load 0.2 s): the cache is read by specjax itself."""
    import subprocess
    import sys

    from _checkpoints import write_hf

    path = write_hf(tmp_path / "hf")
    code = ("import sys\nfrom specjax import models\n"
            f"a, b = models.load({str(path)!r}), models.load({str(path)!r})\n"
            "print(a.load_source, b.load_source, sorted(m for m in sys.modules if m.startswith('orbax')))\n")
    env = {**os.environ, "SPECJAX_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["converted", "cache", "[]"], out.stdout
