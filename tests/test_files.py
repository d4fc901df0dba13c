"""specjax._files: atomic writes keep what was there on any failure; manifests catch every change."""

from __future__ import annotations

import errno
import os
import pickle

import pytest

from specjax import _files
from specjax._files import LoadError


def _tree(d, files):
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)


def _snapshot(d):
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_load_error_names_the_file_and_the_problem():
    e = LoadError("/x/model.safetensors", "header too small")
    assert str(e) == "/x/model.safetensors: header too small" and e.path == "/x/model.safetensors"
    assert isinstance(e, ValueError) and e.problem == "header too small"
    bare = LoadError("missing key 'hidden_size'")
    assert str(bare) == "missing key 'hidden_size'" and bare.path is None
    assert str(bare.with_path("/x/config.json")) == "/x/config.json: missing key 'hidden_size'"
    assert str(pickle.loads(pickle.dumps(e))) == str(e)


def test_atomic_directory_replaces_dest_on_success(tmp_path):
    dest = tmp_path / "draft"
    _tree(dest, {"a": b"old", "sub/b": b"old"})
    with _files.atomic_directory(dest) as tmp:
        assert tmp.parent == dest.parent and tmp != dest and not any(tmp.iterdir())
        _tree(tmp, {"a": b"new"})
    assert _snapshot(dest) == {"a": b"new"}
    assert sorted(os.listdir(tmp_path)) == ["draft"]  # nothing left beside it


@pytest.mark.parametrize("failure", [RuntimeError("bug"), OSError(errno.ENOSPC, "No space left on device"),
                                     KeyboardInterrupt()])
def test_atomic_directory_leaves_an_earlier_dest_as_it_was(tmp_path, failure):
    dest = tmp_path / "draft"
    _tree(dest, {"config.json": b"{old}", "model.safetensors": b"old weights"})
    before = _snapshot(dest)
    with pytest.raises(type(failure)):
        with _files.atomic_directory(dest) as tmp:
            _tree(tmp, {"config.json": b"{new}"})  # half written when the disk fills
            raise failure
    assert _snapshot(dest) == before
    assert sorted(os.listdir(tmp_path)) == ["draft"]


def test_atomic_directory_failing_without_an_earlier_dest_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        with _files.atomic_directory(tmp_path / "new") as tmp:
            (tmp / "x").write_bytes(b"1")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(tmp_path) == []


def test_atomic_write_bytes(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    _files.atomic_write_bytes(path, b"old")
    _files.atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        _files.atomic_write_bytes(path, b"newer")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["t.json"]


@pytest.fixture
def signed(tmp_path):
    d = tmp_path / "d"
    _tree(d, {"config.json": b'{"a": 1}', "w/params.bin": bytes(range(256)) * 16, "tokenizer.json": b"{}"})
    _files.write_manifest(d)
    _files.check_manifest(d)
    return d


def test_manifest_catches_a_flipped_bit(signed):
    f = signed / "w" / "params.bin"
    data = bytearray(f.read_bytes())
    data[1000] ^= 0x04
    f.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="SHA-256 differs") as e:
        _files.check_manifest(signed)
    assert e.value.path == str(f)


def test_manifest_catches_a_truncated_file(signed):
    f = signed / "w" / "params.bin"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(LoadError, match="has 100 bytes.*truncated") as e:
        _files.check_manifest(signed)
    assert e.value.path == str(f)


def test_manifest_catches_an_extra_and_a_missing_file(signed):
    (signed / "w" / "extra.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match="not listed") as e:
        _files.check_manifest(signed)
    assert e.value.path.endswith("extra.bin")
    (signed / "w" / "extra.bin").unlink()
    (signed / "tokenizer.json").unlink()
    with pytest.raises(LoadError, match="missing") as e:
        _files.check_manifest(signed)
    assert e.value.path.endswith("tokenizer.json")


def test_manifest_missing_or_damaged(signed):
    text = (signed / _files.MANIFEST).read_text()
    (signed / _files.MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(LoadError, match="not a valid checksum manifest"):
        _files.check_manifest(signed)
    (signed / _files.MANIFEST).unlink()
    with pytest.raises(LoadError, match="missing") as e:
        _files.check_manifest(signed)
    assert e.value.path.endswith(_files.MANIFEST)


def test_manifest_exclude_and_name(tmp_path):
    d = tmp_path / "d"
    _tree(d, {"a": b"1", "log.txt": b"changes"})
    _files.write_manifest(d, name="sums.json", exclude=("log.txt",))
    (d / "log.txt").write_bytes(b"changed")  # excluded: may change, or go
    _files.check_manifest(d, name="sums.json")
    (d / "log.txt").unlink()
    _files.check_manifest(d, name="sums.json")
    (d / "a").write_bytes(b"2")
    with pytest.raises(LoadError, match="SHA-256 differs"):
        _files.check_manifest(d, name="sums.json")


def test_atomic_directory_replaces_a_file_or_link_without_leftovers(tmp_path):
    (tmp_path / "f").write_text("a file")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name in ("f", "link"):
        with _files.atomic_directory(tmp_path / name) as tmp:
            (tmp / "x").write_bytes(b"1")
        assert (tmp_path / name).is_dir() and not (tmp_path / name).is_symlink()
        assert _snapshot(tmp_path / name) == {"x": b"1"}
    assert sorted(os.listdir(tmp_path)) == ["f", "link", "target"] and not any((tmp_path / "target").iterdir())
