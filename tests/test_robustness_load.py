"""Loading loses nothing and says what is wrong: every damaged, truncated or inconsistent input is
one `LoadError` whose message starts with the file's path; the parameter cache is keyed by every
file the conversion reads, and an unwritable or full cache is a warning, not a failed load."""

from __future__ import annotations

import errno
import json
import logging
import os
import pathlib

import numpy as np
import pytest

from _checkpoints import write_gguf, write_hf

from specjax import _files, models
from specjax._files import LoadError

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
             head_dim=8)
GGUF_SMALL = dict(SMALL, vocab_size=320)  # the test GGUF's byte-level vocabulary needs 259 ids
TOKENS = np.array([[1, 5, 9, 20]])


def _tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path / "tokenizer.json"))


def _hf(path, seed=0, **kwargs) -> pathlib.Path:
    write_hf(path, seed=seed, shape=SMALL, **kwargs)
    _tokenizer(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _one_line_naming(e, path) -> None:
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message


# --- the cache is keyed by what was read -------------------------------------------------------


def test_replaced_weights_are_converted_afresh_not_served_from_the_cache(tmp_path, cache):
    src = _hf(tmp_path / "m", seed=0)
    first = models.load(src)
    assert first.load_source == "converted" and models.load(src).load_source == "cache"
    old = np.asarray(first.logits(TOKENS))
    write_hf(tmp_path / "other", seed=1, shape=SMALL)  # other weights of the same shape
    os.replace(tmp_path / "other" / "model.safetensors", src / "model.safetensors")
    again = models.load(src)
    assert again.load_source == "converted"
    want = np.asarray(models.load(src, cache=False).logits(TOKENS))
    np.testing.assert_array_equal(np.asarray(again.logits(TOKENS)), want)
    assert not np.array_equal(want, old)
    assert models.load(src).load_source == "cache"


def test_a_warm_load_hashes_none_of_the_source_files(tmp_path, cache, monkeypatch):
    """The key is made of stat() results: a warm load reads no byte of the weights to find it."""
    from specjax.models import presets

    src = _hf(tmp_path / "m")
    _files.write_manifest(src)  # even a directory of ours is hashed only when it is converted
    models.load(src)
    hashed = []
    for module in (presets, _files):
        real = module.sha256_file
        monkeypatch.setattr(module, "sha256_file", lambda p, *a, _real=real, **k: hashed.append(p) or _real(p, *a, **k))
    assert models.load(src).load_source == "cache"
    assert not [p for p in hashed if pathlib.Path(p).is_relative_to(src)], hashed


@pytest.mark.parametrize("changed", ["model.safetensors", "config.json", "tokenizer.json"])
def test_any_file_read_written_in_place_with_mtime_restored_misses_the_cache(changed, tmp_path, cache):
    src = _hf(tmp_path / "m")
    models.load(src)
    f = src / changed
    st = f.stat()
    f.write_bytes(f.read_bytes())  # the same bytes, written again: a new ctime
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back, as a copy tool would
    assert models.load(src).load_source == "converted"


def test_a_sharded_checkpoint_is_keyed_by_every_shard(tmp_path, cache):
    src = tmp_path / "m"
    write_hf(src, shape=SMALL, max_shard_bytes=20_000)
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    first = models.load(src)
    write_hf(tmp_path / "other", seed=1, shape=SMALL, max_shard_bytes=20_000)
    os.replace(tmp_path / "other" / shards[-1].name, shards[-1])
    again = models.load(src)
    assert again.load_source == "converted"
    assert not np.array_equal(np.asarray(again.logits(TOKENS)), np.asarray(first.logits(TOKENS)))


def test_a_gguf_rewritten_in_place_misses_the_cache(tmp_path, cache):
    path = write_gguf(tmp_path / "m.gguf", shape=GGUF_SMALL)
    first = models.load(path)
    assert models.load(path).load_source == "cache"
    write_gguf(tmp_path / "n.gguf", seed=1, shape=GGUF_SMALL)
    os.replace(tmp_path / "n.gguf", path)
    again = models.load(path)
    assert again.load_source == "converted"
    assert not np.array_equal(np.asarray(again.logits(TOKENS)), np.asarray(first.logits(TOKENS)))


# --- an unwritable or full cache is a warning ---------------------------------------------------


def _loads_uncached_with_one_warning(src, want, caplog, says: str) -> None:
    """models.load(src) converts, gives the logits `want`, and warns once with `says`: the cache is
    optional, so a cache that cannot be written never fails the load."""
    with caplog.at_level(logging.WARNING):
        m = models.load(src)
    assert m.load_source == "converted"
    np.testing.assert_array_equal(np.asarray(m.logits(TOKENS)), want)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and says in warnings[0], warnings


def test_an_unwritable_cache_is_one_warning_and_the_load_goes_on(tmp_path, monkeypatch, caplog):
    src = _hf(tmp_path / "m")
    want = np.asarray(models.load(src, cache=False).logits(TOKENS))
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")  # read-only for root too: nothing can be made below a file
    monkeypatch.setenv("SPECJAX_CACHE", str(blocked / "cache"))
    _loads_uncached_with_one_warning(src, want, caplog, "could not write the parameter cache")


def test_a_full_cache_disk_is_one_warning_and_leaves_no_partial_cache(tmp_path, cache, monkeypatch, caplog):
    from specjax.models import _param_cache

    src = _hf(tmp_path / "m")
    want = np.asarray(models.load(src, cache=False).logits(TOKENS))

    def full(path, arrays):
        pathlib.Path(path).write_bytes(b"x" * 100)  # half of the weights written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_param_cache, "_write_params", full)
    _loads_uncached_with_one_warning(src, want, caplog, "No space left")
    assert [p.name for p in (cache / "params").iterdir()] == []  # the half-written temporary is gone
    monkeypatch.undo()
    monkeypatch.setenv("SPECJAX_CACHE", str(cache))
    assert models.load(src).load_source == "converted" and models.load(src).load_source == "cache"


# --- damaged, truncated and foreign inputs: one error naming the file ---------------------------


def _damage_header(f: pathlib.Path, how: str) -> None:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if how == "header too small":
        f.write_bytes(data[:5])
    elif how == "invalid JSON in header":
        f.write_bytes(data[:8] + b"{" * n + data[8 + n:])
    elif how == "incomplete metadata":
        f.write_bytes(data[: len(data) - 100])
    elif how == "zeroed":
        f.write_bytes(bytes(len(data)))


@pytest.mark.parametrize("how", ["header too small", "invalid JSON in header", "incomplete metadata", "zeroed"])
def test_a_damaged_safetensors_file_is_named(how, tmp_path):
    src = _hf(tmp_path / "m")
    _damage_header(src / "model.safetensors", how)
    for mesh in (None, "one-device"):
        kwargs = {} if mesh is None else {"mesh": _one_device_mesh()}
        with pytest.raises(LoadError, match="not a readable safetensors file.*damaged or truncated") as e:
            models.load(src, cache=False, **kwargs)
        _one_line_naming(e, src / "model.safetensors")


def _one_device_mesh():
    import jax

    return jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


def test_a_truncated_tokenizer_json_is_named(tmp_path):
    src = _hf(tmp_path / "m")
    text = (src / "tokenizer.json").read_text()
    (src / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(LoadError, match="not a readable tokenizer.json") as e:
        models.load(src, cache=False)
    _one_line_naming(e, src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text('{"eos_token": ')
    _tokenizer(src)
    with pytest.raises(LoadError, match="not valid JSON") as e:
        models.load(src, cache=False)
    _one_line_naming(e, src / "tokenizer_config.json")


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("hidden_size"), "missing required field 'hidden_size'"),
    (lambda c: c.pop("num_hidden_layers"), "missing required field 'num_hidden_layers'"),
    (lambda c: c.update(vocab_size="many"), "field 'vocab_size' = 'many' is not an integer"),
    (lambda c: c.update(rms_norm_eps=[1]), "field 'rms_norm_eps' = \\[1\\] is not a number"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "missing required field 'rope_scaling.low_freq_factor'"),
    (lambda c: c.update(intermediate_size=48), "tensor 'model.layers.0.mlp.gate_proj.weight' has shape"),
    (lambda c: c.update(num_hidden_layers=2), "missing tensor 'model.layers.1"),
])
def test_config_json_without_a_key_or_at_odds_with_the_weights_is_named(edit, message, tmp_path):
    src = _hf(tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=message) as e:
        models.load(src, cache=False)
    # the file at fault: config.json for its own fields, the weights' file for weights it disagrees with
    where = src / "config.json" if "field" in message else src / "model.safetensors"
    _one_line_naming(e, where)


def test_config_json_that_is_not_an_object_or_is_gone(tmp_path):
    src = _hf(tmp_path / "m")
    (src / "config.json").write_text("[1, 2]")
    with pytest.raises(LoadError, match="not an object of config fields") as e:
        models.load(src, cache=False)
    _one_line_naming(e, src / "config.json")
    (src / "config.json").unlink()
    with pytest.raises(LoadError, match="no config.json") as e:
        models.load(src, cache=False)
    assert isinstance(e.value, FileNotFoundError)  # as before, for callers that catch that
    with pytest.raises(LoadError, match="no such checkpoint") as e:
        models.load(tmp_path / "nothing.gguf")
    assert isinstance(e.value, FileNotFoundError)


def test_missing_tensor_and_index_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = _hf(tmp_path / "m")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(LoadError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'") as e:
        models.load(src, cache=False)
    _one_line_naming(e, src / "model.safetensors")
    assert isinstance(e.value, KeyError) and isinstance(e.value, models.MissingTensorError)
    sharded = tmp_path / "s"
    write_hf(sharded, shape=SMALL, max_shard_bytes=20_000)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(LoadError, match="not valid JSON") as e:
        models.load(sharded, cache=False)
    _one_line_naming(e, sharded / "model.safetensors.index.json")


def _rename_in_place(path: pathlib.Path, old: str, new: str) -> None:
    """A tensor renamed in the file's header (a hand edit: same length, so nothing else moves)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert data.count(old.encode()) == 1
    path.write_bytes(data.replace(old.encode(), new.encode()))


def test_a_renamed_tensor_names_the_file_the_tensor_expected_and_the_name_beside_it(tmp_path):
    src = _hf(tmp_path / "m")
    _rename_in_place(src / "model.safetensors", "layers.0.mlp.up_proj", "layers.0.mlp.up_prok")
    with pytest.raises(models.MissingTensorError) as e:
        models.load(src, cache=False)
    _one_line_naming(e, src / "model.safetensors")
    assert str(e.value).endswith(": missing tensor 'model.layers.0.mlp.up_proj.weight', which the config needs; "
                                 "nearest in the file: 'model.layers.0.mlp.up_prok.weight'"), str(e.value)
    # sharded: the index lists the tensors, so the index is named
    sharded = tmp_path / "s"
    write_hf(sharded, shape=SMALL, max_shard_bytes=20_000)
    _rename_in_place(sharded / "model.safetensors.index.json", "layers.0.mlp.up_proj", "layers.0.mlp.up_prok")
    with pytest.raises(models.MissingTensorError, match="nearest in the file: 'model.layers.0.mlp.up_prok") as e:
        models.load(sharded, cache=False)
    _one_line_naming(e, sharded / "model.safetensors.index.json")
    # GGUF: the file's own names; a tensor moved to a layer the config lacks, or renamed to nothing known
    gguf = write_gguf(tmp_path / "m.gguf", shape=GGUF_SMALL)
    _rename_in_place(gguf, "blk.0.ffn_up.weight", "blk.7.ffn_up.weight")
    with pytest.raises(models.MissingTensorError) as e:
        models.load(gguf, cache=False)
    _one_line_naming(e, gguf)
    assert "missing tensor 'model.layers.0.mlp.up_proj.weight', which the config needs; nearest in the file: " \
           "'blk.7.ffn_up.weight'" in str(e.value), str(e.value)
    _rename_in_place(gguf, "blk.7.ffn_up.weight", "blk.0.ffn_upX.weigh")
    with pytest.raises(LoadError, match="unsupported tensor 'blk.0.ffn_upX.weigh'") as e:
        models.load(gguf, cache=False)
    _one_line_naming(e, gguf)


def test_damaged_gguf_files_are_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", shape=GGUF_SMALL)
    data = path.read_bytes()
    cases = {"empty.gguf": (b"", r"empty \(0 bytes\)"),
             "cut.gguf": (data[: len(data) // 2], "truncated"),
             "head.gguf": (data[:100], "not a readable GGUF file"),
             "foreign.gguf": (b"PK\x03\x04" + data[4:], "not a readable GGUF file"),
             "notes.txt": (b"some text", "not a GGUF file")}
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        for mesh in (None, "one-device"):
            kwargs = {} if mesh is None else {"mesh": _one_device_mesh()}
            with pytest.raises(LoadError, match=message) as e:
                models.load(tmp_path / name, cache=False, **kwargs)
            _one_line_naming(e, tmp_path / name)
    (tmp_path / "renamed").write_bytes(data)  # a GGUF without the suffix: known by its magic
    assert models.load(tmp_path / "renamed", cache=False).config.num_layers == GGUF_SMALL["num_layers"]


def test_a_gguf_without_a_required_metadata_key_is_named(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "m.gguf", shape=GGUF_SMALL)
    reader = gguf.GGUFReader(str(path))
    key = "llama.block_count"
    field = reader.fields[key]
    # rename the key in place (same length): the file stays well formed, the field is gone
    start = int(field.offset) + 8  # after the key's uint64 length
    data = bytearray(path.read_bytes())
    assert data[start:start + len(key)] == key.encode()
    data[start:start + len(key)] = b"llama.block_XXXXX"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="block_XXXXX|block_count") as e:
        models.load(bad, cache=False)
    _one_line_naming(e, bad)


# --- our own files: a checksum manifest, verified -----------------------------------------------


def test_a_flipped_bit_in_a_directory_specjax_wrote_is_caught(tmp_path):
    src = _hf(tmp_path / "m")
    want = np.asarray(models.load(src, cache=False).logits(TOKENS))
    _files.write_manifest(src)  # as an exported draft carries one
    np.testing.assert_array_equal(np.asarray(models.load(src, cache=False).logits(TOKENS)), want)
    f = src / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # the last bit of a mantissa: a finite value, no range check would see it
    f.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="SHA-256 differs") as e:
        models.load(src, cache=False)
    _one_line_naming(e, f)
    (src / _files.MANIFEST).unlink()  # a directory from elsewhere: no checksum, loads
    assert models.load(src, cache=False).config.hidden_size == SMALL["hidden_size"]


def test_a_non_finite_weight_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = _hf(tmp_path / "m")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][3, 4] = np.nan
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(LoadError, match="'model.layers.0.mlp.down_proj.weight' has non-finite values") as e:
        models.load(src, cache=False)
    _one_line_naming(e, src / "model.safetensors")


def test_gguf_metadata_at_odds_with_its_tensors_is_named(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "m.gguf", shape=GGUF_SMALL)
    reader = gguf.GGUFReader(str(path), "r+")  # edits the memory map: the file itself
    field = reader.fields["llama.attention.head_count"]
    field.parts[field.data[0]][0] = GGUF_SMALL["num_heads"] // 2
    del reader
    for mesh in (None, "one-device"):
        kwargs = {} if mesh is None else {"mesh": _one_device_mesh()}
        with pytest.raises(LoadError, match="'blk.0.attn_q.weight'.*has shape|'model.layers.0.self_attn.q_proj"
                                            ".weight' has shape") as e:
            models.load(path, cache=False, **kwargs)
        _one_line_naming(e, path)
