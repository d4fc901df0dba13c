"""train_draft.py under faults: outputs that cannot be written, a diverged run, damaged checkpoints
and data, a work directory made with other settings or before checksums, a failed export, Ctrl-C.
(The commands of its docstring run in tests/test_docstring_commands.py.) Each case asserts one clear
line and nothing lost, or a result equal to the undisturbed run. All on random:tiny with a handful
of steps."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments import _models, _paths
from experiments import _train_loop as TL
from experiments import _train_work as TW
from experiments import train_draft as T
from specjax import _files, models
from _interrupt import interrupt_when, interruptible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "experiments", "train_draft.py")
MESSAGES = ["hello there", "write a poem about the sea", "def add(a, b):", "what is 2 + 2?",
            "tell me a story", "list three colours", "explain recursion", "translate 'cat'"]
# small sizes for the binary on random:tiny (a later flag of the same name wins)
SMALL = ["--num_data_prompts=8", "--package_prompts=8", "--gen_tokens=12", "--gen_batch=8", "--seq_len=32",
         "--val_sequences=2", "--eval_every=4", "--ckpt_every=2", "--log_every=2", "--timing_rounds=0", "--steps=4"]


@pytest.fixture(scope="module")
def target():
    return _models.random_tiny(0)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    seqs, plens = T.generate_data(target, MESSAGES, tmp_path_factory.mktemp("data"), gen_tokens=16, batch=4)
    return T.pack(seqs, plens, 32)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONPATH=ROOT,
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    return env


def _train(target, data, work, *, steps=8, stop_after=0, lr=1e-2):
    tokens, mask = data
    cfg = T.draft_config(target.config, T.Arch(32, 1, head_dim=16, kv_heads=1))
    params, frozen = T.init_draft(target, cfg, 0)
    return T.train(cfg, params, frozen, tokens, mask, tokens[:2], mask[:2], work, steps=steps, batch=4, lr=lr,
                   warmup=2, weight_decay=0.0, clip=1.0, seed=0, log_every=2, eval_every=100, ckpt_every=2, k=2,
                   stop_after=stop_after, diverged_hint="likely cause: --lr")


def _flip_bit(path, at=None):
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2 if at is None else at
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def _largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file() and p.name != _files.MANIFEST),
               key=lambda p: p.stat().st_size)


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- training: divergence and checkpoints -----------------------------------------------------------


def test_a_diverged_run_stops_at_once_with_one_line_and_saves_nothing_after(target, data, tmp_path):
    with pytest.raises(_paths.RunError) as e:
        _train(target, data, tmp_path, steps=40, lr=1e30)
    msg = str(e.value)
    assert re.match(r"step \d+: loss (nan|inf)", msg) and "diverged (likely cause: --lr)" in msg, msg
    assert "\n" not in msg and "nothing exported" in msg
    step = int(msg.split()[1].rstrip(":"))
    assert step < 40  # at once, not at the end
    saved = TL.checkpoint_steps(tmp_path / "ckpt")
    assert all(s < step for s in saved)  # nothing after the bad step
    last = f"step {saved[0]} in {tmp_path / 'ckpt'}" if saved else "none"
    assert f"the last good checkpoint: {last}" in msg


def test_a_flipped_bit_in_the_newest_checkpoint_resumes_from_the_one_before(target, data, tmp_path, capsys):
    whole = _train(target, data, tmp_path / "whole")
    assert _train(target, data, tmp_path / "cut", stop_after=4) is None
    assert TL.checkpoint_steps(tmp_path / "cut" / "ckpt") == [4, 2]
    _flip_bit(_largest_file(tmp_path / "cut" / "ckpt" / "4"))
    capsys.readouterr()
    resumed = _train(target, data, tmp_path / "cut")
    err = capsys.readouterr().err
    assert re.search(r"checkpoint of step 4 is damaged \(.*SHA-256 differs.*\); moved to .*damaged/ckpt_4_.*; "
                     r"resuming from step 2", err), err
    assert "resumed from the checkpoint of step 2" in err
    _same(whole, resumed)  # the same batches from step 2 on: the undisturbed run's parameters, bit for bit


def test_no_intact_checkpoint_refuses_naming_the_directory_to_remove(target, data, tmp_path):
    assert _train(target, data, tmp_path, stop_after=4) is None
    (tmp_path / "ckpt" / "4" / _files.MANIFEST).unlink()  # a save cut short
    _flip_bit(_largest_file(tmp_path / "ckpt" / "2"))
    with pytest.raises(_paths.RunError, match=rf"no intact checkpoint in {tmp_path / 'ckpt'} .*remove "
                                              rf"{tmp_path / 'ckpt'} to train from the start"):
        _train(target, data, tmp_path)
    assert TL.checkpoint_steps(tmp_path / "ckpt") == [4, 2]  # refused: nothing moved


def test_a_work_directory_from_before_checksums_is_adopted_after_its_checkpoint_checks(target, data, tmp_path,
                                                                                         capsys):
    """No checkpoint has a manifest (an earlier version's work directory): the newest restores into this
    run's shapes with finite values, so it is adopted with one line and its manifest written; the run
    ends as the undisturbed one. One that does not restore, or holds NaN, refuses in one line."""
    whole = _train(target, data, tmp_path / "whole")
    for name in ("old", "wider", "nan"):
        assert _train(target, data, tmp_path / name, stop_after=4) is None
        for step in (2, 4):
            (tmp_path / name / "ckpt" / str(step) / _files.MANIFEST).unlink()
    capsys.readouterr()
    resumed = _train(target, data, tmp_path / "old")
    err = capsys.readouterr().err
    assert ("the checkpoint of step 4 has no checksums (made before they were recorded): it restores with this "
            "run's shapes and its values are finite, so it is adopted and its checksums written now") in err, err
    assert "resumed from the checkpoint of step 4" in err
    _same(whole, resumed)
    _files.check_manifest(tmp_path / "old" / "ckpt" / "8")
    # another width than the one that made it: refused, naming what to do, nothing moved or written
    tokens, mask = data
    cfg = T.draft_config(target.config, T.Arch(48, 1, head_dim=16, kv_heads=1))
    params, frozen = T.init_draft(target, cfg, 0)
    with pytest.raises(_paths.RunError) as e:
        T.train(cfg, params, frozen, tokens, mask, tokens[:2], mask[:2], tmp_path / "wider", steps=8, batch=4,
                lr=1e-2, warmup=2, weight_decay=0.0, clip=1.0, seed=0, log_every=2, eval_every=100, ckpt_every=2, k=2)
    ckpt = tmp_path / "wider" / "ckpt"
    assert str(e.value).startswith(f"cannot restore the checkpoint {ckpt / '4'} (") and str(e.value).endswith(
        f"(without checksums: an earlier version's; run with the settings that made it, or remove {ckpt} to train "
        "from the start)") and "\n" not in str(e.value), str(e.value)
    assert TL.checkpoint_steps(ckpt) == [4, 2] and not (ckpt / "4" / _files.MANIFEST).exists()
    # a NaN in it (the bytes changed where orbax does not look): refused
    import orbax.checkpoint as ocp

    ckpt = tmp_path / "nan" / "ckpt"
    with ocp.CheckpointManager(ckpt.resolve()) as mngr:
        state = mngr.restore(4)
        state["train"] = jax.tree.map(lambda x: np.full_like(x, np.nan), state["train"])
        mngr.save(6, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    with pytest.raises(_paths.RunError, match=rf"^the checkpoint {ckpt / '6'} holds values that are not finite "
                                              r"\(without checksums"):
        _train(target, data, tmp_path / "nan")


def test_a_damaged_data_chunk_is_named_and_made_again(target, tmp_path, capsys):
    seqs, plens = T.generate_data(target, MESSAGES, tmp_path, gen_tokens=8, batch=4)
    chunk = tmp_path / "chunk_00001.npz"
    _flip_bit(chunk, at=chunk.stat().st_size // 3)
    capsys.readouterr()
    again, plens2 = T.generate_data(target, MESSAGES, tmp_path, gen_tokens=8, batch=4)
    err = capsys.readouterr().err
    assert f"data: {chunk} is damaged" in err and "making it again" in err, err
    assert plens2 == plens and all(np.array_equal(a, b) for a, b in zip(seqs, again, strict=True))
    chunk.write_bytes(chunk.read_bytes()[:100])  # cut short
    again, _ = T.generate_data(target, MESSAGES, tmp_path, gen_tokens=8, batch=4)
    assert all(np.array_equal(a, b) for a, b in zip(seqs, again, strict=True))


def test_a_damaged_feature_chunk_is_named_and_computed_again(target, data, tmp_path, capsys):
    from experiments import _feature_distill as FD

    tokens, _ = data
    feats, tops = FD.cached_features(target, tokens, tmp_path, chunk=4)
    chunk = sorted((tmp_path / "features").iterdir())[0]
    _flip_bit(chunk, at=chunk.stat().st_size // 3)
    capsys.readouterr()
    again, tops2 = FD.cached_features(target, tokens, tmp_path, chunk=4)
    assert f"features: {chunk} is damaged" in capsys.readouterr().err
    np.testing.assert_array_equal(again, feats)
    np.testing.assert_array_equal(tops2, tops)


# --- the work directory's record -------------------------------------------------------------------


def test_a_rerun_with_other_settings_refuses_naming_the_setting(tmp_path, capsys):
    work = tmp_path / "w"
    data = {"target": "random:tiny", "gen_tokens": 32, "num_data_prompts": 8}
    training = {"arch": "model", "width": 32, "lr": 0.003}
    TW.check_record(work, data=data, training=training, steps=10)
    # nothing made yet: other settings simply replace the record
    TW.check_record(work, data={**data, "gen_tokens": 64}, training=training, steps=10)
    TW.check_record(work, data=data, training=training, steps=10)
    (work / "data").mkdir()
    (work / "data" / "chunk_00000.npz").write_bytes(b"x")
    with pytest.raises(_paths.RunError) as e:
        TW.check_record(work, data={**data, "gen_tokens": 128}, training=training, steps=10)
    assert str(e.value) == (f"--gen_tokens=128 differs from the work directory's 32 ({work / 'made_by.json'}): "
                            f"use another --work_dir or remove {work}")
    with pytest.raises(_paths.RunError, match="--target=random:tiny:1 differs from the work directory's random:tiny"):
        TW.check_record(work, data={**data, "target": "random:tiny:1"}, training=training, steps=10)
    # data only: the draft and recipe are free until a checkpoint exists
    TW.check_record(work, data=data, training={**training, "width": 64}, steps=10)
    (work / "ckpt" / "5").mkdir(parents=True)
    with pytest.raises(_paths.RunError, match="--width=32 differs from the work directory's 64"):
        TW.check_record(work, data=data, training={**training, "width": 32}, steps=10)
    capsys.readouterr()
    TW.check_record(work, data=data, training={**training, "width": 64}, steps=20)  # --steps may change
    assert "--steps=20 differs from the work directory's 10: the learning-rate schedule changes" in \
        capsys.readouterr().err
    assert json.loads((work / "made_by.json").read_text())["steps"] == 20


def test_a_target_directory_whose_files_changed_refuses(tmp_path):
    tgt = tmp_path / "model"
    tgt.mkdir()
    (tgt / "model.safetensors").write_bytes(b"a" * 10)
    work = tmp_path / "w"
    TW.check_record(work, data=TW.target_identity(str(tgt)), training={}, steps=1)
    (work / "data").mkdir()
    (work / "data" / "chunk_00000.npz").write_bytes(b"x")
    (tgt / "model.safetensors").write_bytes(b"b" * 11)  # other weights at the same path
    with pytest.raises(_paths.RunError, match="the target's files changed since"):
        TW.check_record(work, data=TW.target_identity(str(tgt)), training={}, steps=1)


# --- export ------------------------------------------------------------------------------------------


def _draft(target):
    cfg = T.draft_config(target.config, T.Arch(32, 1, head_dim=16, kv_heads=1))
    params, frozen = T.init_draft(target, cfg, 0)
    return cfg, jax.device_get({**frozen, **params})


def _export(target, cfg, params, out, work):
    TW.export_checked(out, lambda d: T.export(cfg, params, target.tokenizer, d),
                      lambda d: TW.verify_model_draft(d, cfg), work)


def _contents(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_failed_export_leaves_the_earlier_draft_as_it_was(target, tmp_path, monkeypatch):
    cfg, params = _draft(target)
    out, work = tmp_path / "draft", tmp_path / "draft.work"
    _export(target, cfg, params, out, work)
    assert models.load(out, cache=False).config == cfg
    _files.check_manifest(out)  # the export carries its checksums, which models.load verifies
    before = _contents(out)
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    for name, raw in before.items():
        (flipped / name).write_bytes(raw)
    _flip_bit(flipped / "model.safetensors")  # inside the weights: a finite value, still in range
    with pytest.raises(models.LoadError, match="model.safetensors: SHA-256 differs"):
        models.load(flipped, cache=False)
    import shutil

    shutil.rmtree(flipped)

    import safetensors.numpy

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)  # half written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(_paths.RunError) as e:
        _export(target, cfg, {k: v for k, v in params.items()}, out, work)
    assert "No space left on device" in str(e.value) and f"the earlier draft at {out} is unchanged" in str(e.value)
    assert f"the trained checkpoint is in {work / 'ckpt'}" in str(e.value)
    monkeypatch.undo()
    assert _contents(out) == before and sorted(os.listdir(tmp_path)) == ["draft"]  # no temporary left

    # a draft that is not finite is never exported
    bad = jax.tree.map(lambda x: np.array(x), params)
    bad["embed"][0, 0] = np.nan
    with pytest.raises(_paths.RunError, match="does not check .*finite.*the earlier draft at .* is unchanged"):
        _export(target, cfg, bad, out, work)
    assert _contents(out) == before and sorted(os.listdir(tmp_path)) == ["draft"]
    with pytest.raises(_paths.RunError, match=f"nothing was written at {tmp_path / 'new'}"):
        _export(target, cfg, bad, tmp_path / "new", work)
    assert sorted(os.listdir(tmp_path)) == ["draft"]


# --- the binary -------------------------------------------------------------------------------------


def _start(args, env, **kw):
    return subprocess.Popen([sys.executable, BINARY, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)


def test_outputs_that_cannot_be_written_are_refused_naming_the_path(tmp_path):
    from absl import app

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    d = tmp_path / "d"
    cases = [(a_file, d, f"--out {a_file}: is a file; a directory is needed"),
             (a_file / "d", d, f"--out {a_file}/d: lies below {a_file}, which is a file"),
             (tmp_path / "new" / "draft", d, None),  # fine: created at the export
             (pathlib.Path("/proc/specjax-draft"), d, "--out /proc/specjax-draft: cannot write in /proc"),
             (other, d, f"--out {other}: a directory that holds other files, not a draft"),
             (d, a_file, f"--work_dir {a_file}: is a file"),
             (d, d / "w", f"--work_dir {d / 'w'} lies inside --out {d}")]
    for out, work, want in cases:
        if want is None:
            TW.check_paths(out, work)
            continue
        with pytest.raises(app.UsageError) as e:
            TW.check_paths(out, work)
        assert want in str(e.value) and "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "other"] and os.listdir(other) == ["notes.txt"]
    TW.check_paths(other / "new", d)  # an earlier draft, or a new directory, is fine
    (other / "config.json").write_text("{}")
    TW.check_paths(other, d)


def test_the_binary_refuses_before_any_work_in_seconds(env, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [([f"--out={a_file}"], f"--out {a_file}: is a file; a directory is needed"),
             ([f"--out={tmp_path}/d", "--num_data_prompts=3"], "--num_data_prompts=3: training needs at least 4")]
    t0 = time.monotonic()
    procs = [(_start(["--target=random:tiny", *args], env), want) for args, want in cases]
    for proc, want in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-2000:]
        assert err.strip().splitlines() == [f"error: {err.strip()[7:]}"] and want in err, err[-2000:]
    assert time.monotonic() - t0 < 60  # seconds: the imports, nothing else
    assert sorted(os.listdir(tmp_path)) == ["a_file"]




def test_ctrl_c_while_training_says_where_the_run_stands_and_how_to_go_on(env, tmp_path):
    out = tmp_path / "d"
    args = ["--target=random:tiny", f"--out={out}", "--width=32", "--head_dim=16", "--layers=1", *SMALL,
            "--steps=1000000", "--ckpt_every=5", "--log_every=5", "--eval_every=1000000"]
    proc = _start(args, env, preexec_fn=interruptible)
    rest = interrupt_when(proc, "step 10/")  # training, with a checkpoint saved
    assert proc.returncode == 130, rest[-2000:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest[-2000:]
    m = re.search(r"training stopped at step (\d+)/1000000; the last checkpoint is step (\d+) in (\S+), where the "
                  r"same command continues", rest)
    assert m and int(m.group(2)) >= 5 and m.group(3) == str(tmp_path / "d.work" / "ckpt"), rest[-2000:]
    cmd = rest.split("to go on (or run it again): ")[1].splitlines()[0]
    assert shlex.split(cmd) == ["python", os.path.relpath(BINARY, ROOT), *args]  # as its cwd, the root, reaches it
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
