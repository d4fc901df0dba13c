"""Nothing lost: saving never removes what it did not write, output paths are checked before
any work, writes are whole or absent, and Ctrl-C ends a binary promptly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _presets import resolve_or_skip

from specjax import verify

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # experiments/ is not an installed package
EXP = ROOT / "experiments"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", PYTHONPATH=str(ROOT),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")))
    return env


def _memory():
    return verify.csd_memory(8, np.array([[1, 2], [3, 4]]), np.array([5, 1]))


# --- data loss: save_csd_memory ----------------------------------------------------------------


def test_save_csd_memory_refuses_what_it_did_not_write(tmp_path):
    memory = _memory()
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    full = tmp_path / "project"
    full.mkdir()
    (full / "a.py").write_text("print(1)")
    for path in (plain, full):
        with pytest.raises(FileExistsError, match="refusing to replace"):
            verify.save_csd_memory(path, memory)
        with pytest.raises(FileExistsError, match="refusing to replace"):
            verify.save_csd_memory(path, memory, overwrite=True)  # overwrite is for memories only
    assert plain.read_text() == "mine" and (full / "a.py").read_text() == "print(1)"
    cwd = os.getcwd()
    os.chdir(full)
    try:
        with pytest.raises(FileExistsError):
            verify.save_csd_memory(".", memory, overwrite=True)
    finally:
        os.chdir(cwd)
    assert sorted(os.listdir(full)) == ["a.py"]  # no temporaries left either


def test_save_csd_memory_replaces_a_memory_only_with_overwrite(tmp_path):
    path = tmp_path / "m"
    verify.save_csd_memory(path, _memory())
    assert verify.is_saved_memory(path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        verify.save_csd_memory(path, verify.csd_memory(4))
    assert verify.load_csd_memory(path).to_dict() == {(1, 2): 5, (3, 4): 1}
    verify.save_csd_memory(path, verify.csd_memory(4, np.array([[7, 8]])), overwrite=True)
    assert verify.load_csd_memory(path).to_dict() == {(7, 8): 1}
    assert sorted(os.listdir(tmp_path)) == ["m"]  # written beside, then moved: no leftovers
    os.unlink(path / "specjax_csd_memory.json")  # a memory saved before the marker existed
    assert verify.is_saved_memory(path)
    verify.save_csd_memory(path, verify.csd_memory(4), overwrite=True)
    assert verify.load_csd_memory(path).to_dict() == {}


def test_csd_memory_of_another_vocabulary_is_refused(tmp_path):
    import specjax
    from specjax.models import Config, random_model

    model = random_model(Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=8))
    big = verify.csd_memory(8, np.array([[40, 2]]))
    with pytest.raises(ValueError, match="token id 40, outside the target's vocabulary of 32"):
        specjax.Engine(model, "pld", method="csd", k=2, csd_memory=big)


# --- output paths, checked before any work ----------------------------------------------------


def test_check_output_names_the_problem(tmp_path):
    from absl import app

    from experiments import _paths

    a_file = tmp_path / "f"
    a_file.write_text("x")
    a_dir = tmp_path / "d"
    a_dir.mkdir()
    _paths.check_output("output", tmp_path / "new" / "deeper" / "out.json")  # creatable
    _paths.check_output("output_dir", a_dir, dir=True)
    _paths.check_output("output", None)
    cases = [("output_dir", a_file, True, "is a file; a directory is needed"),
             ("output", a_dir, False, "is a directory; a file path is needed"),
             ("output", a_file / "out.json", False, f"lies below {a_file}, which is a file"),
             ("output_dir", a_file / "sub" / "x", True, "which is a file"),
             ("csv", "/proc/specjax.csv", False, "cannot write in /proc")]
    for flag, path, is_dir, message in cases:
        with pytest.raises(app.UsageError, match=message) as e:
            _paths.check_output(flag, path, dir=is_dir)
        assert f"--{flag} {path}" in str(e.value)


def test_an_output_check_output_accepts_is_written(tmp_path):
    """A path below directories that do not exist yet passes the check, so the write makes them
    (calibrate_asd once failed at its very end on such a path, after the whole calibration)."""
    from experiments import _paths

    path = tmp_path / "new" / "deeper" / "out.json"
    _paths.check_output("output", path)
    _paths.write_text(path, "done")
    assert path.read_text() == "done" and os.listdir(path.parent) == ["out.json"]


def test_an_atomic_write_gets_the_mode_a_plain_open_would_give(tmp_path):
    """The temporary comes from mkstemp (0600); a result file must not stay private to its writer."""
    from experiments import _paths

    old = os.umask(0o022)
    try:
        _paths.write_text(tmp_path / "run.json", "{}")
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"run.json": 0o644, "plain.json": 0o644}


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path):
    from experiments import _paths

    path = tmp_path / "out.json"
    _paths.write_text(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with _paths.atomic_open(path) as f:
            f.write("half")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


BAD_OUTPUTS = {  # binary: (args, flag); the path lies below a regular file
    "generate": (["--model", "random:tiny"], "output"),
    "calibrate_csd": (["--model", "random:tiny", "--draft", "random:tiny:1"], "output"),
    "calibrate_asd": (["--model", "random:tiny", "--draft", "random:tiny:1", "--output", "{ok}/a.json"],
                      "cache_dir"),
    "sweep": (["--model", "random:tiny"], "output_dir"),
    "audit": (["--model", "random:tiny"], "output_dir"),
    "benchmark": ([], "csv"),
    "device_check": ([], "out"),
    "bench_kernels": ([], "json_out"),
}


def test_every_binary_checks_its_output_path_before_any_work(env, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    procs = {}
    for name, (args, flag) in BAD_OUTPUTS.items():
        args = [a.replace("{ok}", str(tmp_path)) for a in args] + [f"--{flag}", str(blocker / "sub" / "out")]
        procs[name] = (flag, subprocess.Popen([sys.executable, str(EXP / f"{name}.py"), *args], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    for name, (flag, proc) in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 1, f"{name}: {out[-2000:]}{err[-2000:]}"
        assert f"--{flag} {blocker}/sub/out: lies below {blocker}, which is a file" in err, f"{name}: {err[-2000:]}"
        assert "Traceback" not in err and "[specjax]" not in err, f"{name} started work: {err[-2000:]}"


def test_empty_prompts_file_is_refused(env, tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    proc = subprocess.run([sys.executable, str(EXP / "generate.py"), "--model", "random:tiny", "--prompts_file",
                           str(empty)], env=env, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 1 and "no prompts in it" in proc.stderr, proc.stderr[-2000:]


# --- interrupts ---------------------------------------------------------------------------------


def _signal_state(pid: int) -> str:
    """What a stuck child's SIGINT handling looks like: is it blocked, ignored or caught, which
    threads run, and whether the wakeup pipe of `_paths.exit_promptly_on_interrupt` is still open."""
    try:
        bit = 1 << (signal.SIGINT - 1)
        status = {line.split(":")[0]: line.split()[1] for line in open(f"/proc/{pid}/status")
                  if line.startswith(("SigBlk", "SigIgn", "SigCgt", "SigPnd", "ShdPnd"))}
        flags = {k: bool(int(v, 16) & bit) for k, v in status.items()}
        threads = sorted(open(f"/proc/{pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{pid}/task"))
        pipes = 0
        for f in os.listdir(f"/proc/{pid}/fd"):
            try:
                pipes += os.readlink(f"/proc/{pid}/fd/{f}").startswith("pipe:")
            except OSError:  # closed meanwhile
                pass
        return f"SIGINT bits {flags}; threads {threads}; pipes open {pipes}"
    except OSError as e:
        return f"(state not readable: {e})"


def _interruptible():
    """In the child before exec: SIGINT at its default. A shell starts background jobs with SIGINT
    ignored and children inherit that (the suite run as `pytest ... &`), and a program that finds
    SIGINT ignored rightly keeps ignoring it: that is the shell's intent, not this test's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_generation_exits_promptly_with_nothing_half_written(env, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, str(EXP / "generate.py"), "--model", "random:tiny",
                             "--max_new_tokens", "200000", "--ignore_eos", "--output", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=_interruptible)
    err = ""
    try:
        while "generating" not in err:  # compiled; now inside the one long XLA program
            line = proc.stderr.readline()
            assert line or proc.poll() is None, err
            err += line
        time.sleep(1.0)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _, rest = proc.communicate(timeout=60)  # unfixed: minutes (the program runs to its end)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit 60 s after SIGINT; the child then: {_signal_state(proc.pid)}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 15, f"exit took {took:.1f}s after SIGINT"
    assert proc.returncode == 130, (proc.returncode, rest[-2000:])
    assert "interrupted" in rest
    assert os.listdir(tmp_path) == []  # no output, no temporary


@pytest.mark.heavy  # two binaries through data generation: about 40 s of CPU
def test_ctrl_c_in_the_calibrations_says_where_they_stand_and_how_to_go_on(env, tmp_path):
    """calibrate_asd stopped while teacher-forcing (nothing saved, --cache_dir not given), calibrate_csd
    stopped in its held-out evaluation (the memory is saved by then): each says so in its own words,
    gives the command that continues, exits 130 with no traceback, and leaves no temporary behind."""
    import shlex

    from _interrupt import interrupt_when

    common = ["--model", "random:tiny", "--draft", "random:tiny:1", "--max_new_tokens", "48", "--num_prompts", "3"]
    runs = {"calibrate_asd": ([*common, "--output", str(tmp_path / "asd.json")], "teacher forcing both models"),
            "calibrate_csd": ([*common, "--output", str(tmp_path / "mem"), "--eval_prompts", "1",
                               "--cache_dir", str(tmp_path / "cache")], "eval exact: compiled")}
    procs = {name: subprocess.Popen([sys.executable, str(EXP / f"{name}.py"), *args], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=_interruptible)
             for name, (args, _) in runs.items()}
    rest = {name: interrupt_when(procs[name], marker, timeout=120) for name, (_, marker) in runs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 130 and "Traceback" not in rest[name], (name, rest[name][-2000:])
        cmd = rest[name].split("to go on (or run it again): ")[1].splitlines()[0]
        assert shlex.split(cmd) == ["python", os.path.relpath(EXP / f"{name}.py", ROOT), *runs[name][0]], cmd
    assert (f"stopped while teacher-forcing both models on the target's greedy sequences (0/3 done); the calibration "
            f"{tmp_path / 'asd.json'} is written only at the end, so it is not there; nothing is saved") in rest[
        "calibrate_asd"], rest["calibrate_asd"]
    assert f"the memory is saved, complete, in {tmp_path / 'mem'}; stopped during the held-out evaluation" in rest[
        "calibrate_csd"], rest["calibrate_csd"]
    assert sorted(os.listdir(tmp_path)) == ["cache", "mem"] and len(os.listdir(tmp_path / "cache")) == 1
    assert not [p for p in os.listdir(tmp_path / "mem") if p.startswith(".")]


# --- files that are not what they claim -----------------------------------------------------------


def test_preset_altered_in_place_with_size_and_mtime_kept_is_hashed_again(monkeypatch, tmp_path):
    import hashlib
    import importlib.metadata as md

    from specjax.models import presets

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    parts, blob = [], b""
    for dist in ("numpy", "pytest"):  # two installed distributions stand in for chunk wheels
        d = md.distribution(dist)
        rel = next(str(f) for f in d.files if str(f).endswith("METADATA"))
        parts.append(((dist, d.version), rel))
        blob += pathlib_read(d.locate_file(rel))
    fake = presets.Preset("fake-chunks", tuple(p[0] for p in parts), tuple(p[1] for p in parts),
                          hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(presets.PRESETS, "fake-chunks", fake)
    joined = presets.resolve("fake-chunks")
    assert presets.resolve("fake-chunks") == joined  # marker: not hashed again
    st = joined.stat()
    data = bytearray(joined.read_bytes())
    data[100] ^= 0x20
    joined.write_bytes(bytes(data))
    os.utime(joined, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    with pytest.raises(presets.PresetError, match="checksum mismatch"):
        presets.resolve("fake-chunks")


def pathlib_read(path) -> bytes:
    return Path(path).read_bytes()


@pytest.fixture(scope="module")
def smollm2_file():
    return resolve_or_skip("smollm2-135m-instruct")


def test_broken_checkpoint_files_are_named_errors(smollm2_file, tmp_path):
    from specjax import models
    from specjax.models import convert
    from specjax.models.convert import CheckpointError

    data = smollm2_file.read_bytes()
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "head.gguf").write_bytes(data[:1_000_000])  # cut inside the tensor data
    cases = [("empty.gguf", r"empty \(0 bytes\)"), ("head.gguf", "truncated")]
    import gguf

    q = next(t for t in gguf.GGUFReader(str(smollm2_file)).tensors if t.name == "blk.0.attn_q.weight")
    for name, scale, message in (("nan.gguf", np.float16(np.nan), "tensor 'blk.0.attn_q.weight' is corrupt: 32 "
                                                                  "non-finite weights"),
                                 ("huge.gguf", np.float16(60000.0), "tensor 'blk.0.attn_q.weight' has weights up to")):
        b = bytearray(data)
        b[int(q.data_offset): int(q.data_offset) + 2] = scale.tobytes()  # the first block's float16 scale
        (tmp_path / name).write_bytes(bytes(b))
        cases.append((name, message))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    for name, message in cases:  # models.load for the unreadable files; the converter itself for the rest
        load = models.load if name in ("empty.gguf", "head.gguf") else convert.load_gguf
        with pytest.raises(CheckpointError, match=message) as e:
            load(tmp_path / name, cache=False) if load is models.load else load(tmp_path / name)
        assert str(e.value).startswith(f"{tmp_path / name}: ")
    with pytest.raises(CheckpointError, match=f"{hf}/config.json: not valid JSON"):
        models.load(hf, cache=False)
