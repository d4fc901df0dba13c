"""Feature drafts lose nothing and say what is wrong: saved whole or not at all, under a SHA-256
manifest; a damaged file, a wrong shape or a non-finite weight is one LoadError naming the file."""

from __future__ import annotations

import dataclasses
import errno

import numpy as np
import pytest

from specjax import _files
from specjax._files import LoadError


def _one_line_naming(e, path) -> None:
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message



@pytest.fixture(scope="module")
def draft():
    from experiments._models import random_tiny
    from specjax.models import feature_draft as FD

    target = random_tiny(0)
    ids = np.arange(0, target.config.vocab_size, 3, dtype=np.int32)
    params = FD.init_params(target.config, target.params, ids, seed=1)
    return FD.FeatureDraft(FD.layer_config(target.config), params, ids, "test-draft")


def _saved(draft, path, **changes):
    from specjax.models import feature_draft as FD

    FD.save(draft if not changes else dataclasses.replace(draft, **changes), path)
    return path


def test_feature_draft_damage_is_named(draft, tmp_path):
    import jax

    from specjax.models import feature_draft as FD

    d = _saved(draft, tmp_path / "d")
    back = FD.load(d)
    for a, b in zip(jax.tree.leaves(draft.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params_file = d / FD.PARAMS_FILE
    data = bytearray(params_file.read_bytes())
    data[-3] ^= 0x01
    params_file.write_bytes(bytes(data))
    with pytest.raises(LoadError, match="SHA-256 differs") as e:
        FD.load(d)
    _one_line_naming(e, params_file)
    (d / _files.MANIFEST).unlink()  # no checksum (saved before manifests existed): the bit goes unseen
    FD.load(d)
    params_file.write_bytes(bytes(data[:5]))
    with pytest.raises(LoadError, match="not a readable safetensors file") as e:
        FD.load(d)
    _one_line_naming(e, params_file)
    (d / FD.CONFIG_FILE).write_text('{"format": "specjax-feature-draft-1"}')
    with pytest.raises(LoadError, match="missing field 'config'") as e:
        FD.load(d)
    _one_line_naming(e, d / FD.CONFIG_FILE)
    (d / FD.CONFIG_FILE).write_text('{"format": ')
    with pytest.raises(LoadError, match="not valid JSON") as e:
        FD.load(d)
    _one_line_naming(e, d / FD.CONFIG_FILE)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_feature_draft_with_a_non_finite_weight_is_refused(draft, tmp_path, value):
    from specjax.models import feature_draft as FD

    fc_w = np.array(draft.params["fc_w"])
    fc_w[0, 0] = value
    d = _saved(draft, tmp_path / "d", params=dict(draft.params, fc_w=fc_w))
    with pytest.raises(LoadError, match="'fc_w' has 1 non-finite values") as e:
        FD.load(d)
    _one_line_naming(e, d / FD.PARAMS_FILE)


def test_a_feature_draft_of_another_shape_is_refused(draft, tmp_path):
    from safetensors.numpy import load_file, save_file

    from specjax.models import feature_draft as FD

    d = _saved(draft, tmp_path / "d")
    (d / _files.MANIFEST).unlink()
    tensors = load_file(str(d / FD.PARAMS_FILE))
    tensors["fc_b"] = tensors["fc_b"][:-1]
    save_file(tensors, str(d / FD.PARAMS_FILE))
    with pytest.raises(LoadError, match="'fc_b' has shape") as e:
        FD.load(d)
    _one_line_naming(e, d / FD.PARAMS_FILE)
    del tensors["fc_b"]
    save_file(tensors, str(d / FD.PARAMS_FILE))
    with pytest.raises(LoadError, match="missing tensor 'fc_b'"):
        FD.load(d)


def test_feature_draft_save_is_atomic_and_refuses_what_it_did_not_write(draft, tmp_path, monkeypatch):
    from specjax.models import feature_draft as FD

    d = _saved(draft, tmp_path / "d")
    before = {f.name: f.read_bytes() for f in d.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "write_manifest", full)  # the disk fills at the last file
    with pytest.raises(OSError):
        FD.save(draft, d)
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    monkeypatch.undo()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a feature draft"):
        FD.save(draft, mine)
    assert (mine / "notes.txt").read_text() == "keep"
