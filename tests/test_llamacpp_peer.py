"""llama.cpp as a benchmark peer: finding the binaries, their command lines, reading their output.

llama.cpp itself is not built in CI; stand-in executables print what its tools print.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import _llamacpp

EXP = pathlib.Path(__file__).resolve().parents[1] / "experiments"

BENCH_JSON = json.dumps([{"n_prompt": 0, "n_gen": 128, "n_depth": 164, "avg_ns": 1_000_000_000,
                          "avg_ts": 128.0, "samples_ts": [128.0]}], indent=2)
LOOKUP_TEXT = """encoded  164 tokens in    0.120 seconds, speed: 1366.667 t/s
decoded  129 tokens in    0.500 seconds, speed:  258.000 t/s

n_draft      = 8
n_predict    = 129
n_drafted    = 240
t_draft_flat = 0.10 ms
n_accept     = 60
accept       = 25.000%
"""


def fake_binary(directory: pathlib.Path, name: str, output: str, stream: str = "stdout") -> pathlib.Path:
    """An executable that prints `output` and records its arguments in <name>.args."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.out").write_text(output)
    path = directory / name
    redirect = "" if stream == "stdout" else " >&2"
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{directory}/{name}.args"\ncat "{directory}/{name}.out"'
                    f"{redirect}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_missing_directory_names_the_build_script(tmp_path):
    with pytest.raises(_llamacpp.MissingBinaryError, match="scripts/build_llamacpp.sh"):
        _llamacpp.find("llama-bench", str(tmp_path / "nope"))


def test_missing_binary_in_directory_and_on_path(tmp_path, monkeypatch):
    with pytest.raises(_llamacpp.MissingBinaryError, match=r"llama-lookup is not in .*build_llamacpp\.sh"):
        _llamacpp.find("llama-lookup", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(_llamacpp.MissingBinaryError, match=r"not on PATH.*build_llamacpp\.sh"):
        _llamacpp.find("llama-lookup")


def test_binaries_are_found_in_the_build_tree_and_on_path(tmp_path, monkeypatch):
    path = fake_binary(tmp_path / "build" / "bin", "llama-bench", "")
    assert _llamacpp.find("llama-bench", str(tmp_path)) == str(path)
    monkeypatch.setenv("PATH", str(path.parent))
    assert _llamacpp.find("llama-bench") == str(path)


def test_check_lists_every_missing_binary(tmp_path, gguf):
    fake_binary(tmp_path, "llama-bench", "")
    peer = _llamacpp.Peer(str(tmp_path), gguf, 128, 2)
    with pytest.raises(_llamacpp.MissingBinaryError, match="missing .*: llama-lookup, llama-speculative;"):
        peer.check(["llama-bench", "llama-lookup", "llama-speculative"])
    assert set(peer.check(["llama-bench"])) == {"llama-bench"}


def test_bad_peer_settings_are_refused(tmp_path, gguf):
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        _llamacpp.Peer(None, gguf, 0, 2)
    with pytest.raises(FileNotFoundError, match="draft model"):
        _llamacpp.Peer(None, gguf, 8, 2, draft_model=str(tmp_path / "absent.gguf"))
    with pytest.raises(ValueError, match="needs a draft model"):
        _llamacpp.Peer(None, gguf, 8, 2).speculative_args("llama-speculative", "p.txt")


def test_command_lines(gguf):
    peer = _llamacpp.Peer(None, gguf, 128, 2, k=6, draft_model=gguf)
    bench = peer.bench_args("llama-bench", 164)
    assert bench[bench.index("-d") + 1] == "164" and bench[bench.index("-n") + 1] == "128"
    assert bench[bench.index("-p") + 1] == "0" and bench[bench.index("-o") + 1] == "json"
    for args in (peer.lookup_args("llama-lookup", "p.txt"), peer.speculative_args("llama-speculative", "p.txt")):
        assert args[args.index("--spec-draft-n-max") + 1] == "6"
        assert args[args.index("--temp") + 1] == "0" and "--ignore-eos" in args
        assert args[args.index("-f") + 1] == "p.txt" and args[args.index("-t") + 1] == "2"
    spec = peer.speculative_args("llama-speculative", "p.txt")
    assert spec[spec.index("-md") + 1] == gguf
    stop = _llamacpp.Peer(None, gguf, 128, 2, ignore_eos=False)
    assert "--ignore-eos" not in stop.lookup_args("llama-lookup", "p.txt")
    assert "-ub" not in bench
    one = _llamacpp.Peer(None, gguf, 128, 2, ubatch=1).bench_args("llama-bench", 164)
    assert one[one.index("-ub") + 1] == "1"
    with pytest.raises(ValueError, match="ubatch must be positive"):
        _llamacpp.Peer(None, gguf, 128, 2, ubatch=0)


def test_build_script_turns_amx_off_unless_asked():
    """ggml's AMX matmul crashes on multi-token batches in VMs that report AMX (SIGSEGV seen here)."""
    script = (EXP.parent / "scripts" / "build_llamacpp.sh").read_text()
    assert "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in script and "--amx)" in script
    out = subprocess.run(["bash", str(EXP.parent / "scripts" / "build_llamacpp.sh"), "--bogus"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr


def test_runs_read_the_tools_output(tmp_path, gguf):
    fake_binary(tmp_path, "llama-bench", "build: x\n" + BENCH_JSON)
    fake_binary(tmp_path, "llama-lookup", LOOKUP_TEXT, stream="stderr")  # llama.cpp logs to stderr
    peer = _llamacpp.Peer(str(tmp_path), gguf, 128, 2)
    plain = peer.plain(164)
    assert (plain.tokens, plain.seconds, plain.tokens_per_s) == (128, 1.0, 128.0)
    assert "164" in (tmp_path / "llama-bench.args").read_text().split()
    look = peer.lookup("def f(x):\n    return")
    assert (look.tokens, look.seconds, look.drafted, look.accepted) == (129, 0.5, 240, 60)


def test_a_failing_tool_raises_with_its_output(tmp_path, gguf):
    path = tmp_path / "llama-lookup"
    path.write_text("#!/bin/sh\necho 'error: unknown argument: --spec-draft-n-max' >&2\nexit 1\n")
    path.chmod(0o755)
    with pytest.raises(RuntimeError, match="(?s)exited with 1.*unknown argument"):
        _llamacpp.Peer(str(tmp_path), gguf, 8, 2).lookup("x")


def test_unparseable_output_is_an_error():
    with pytest.raises(RuntimeError, match="no 'decoded N tokens"):
        _llamacpp.parse_decoded("nothing here")
    with pytest.raises(RuntimeError, match="no generation test"):
        _llamacpp.parse_bench("[]")


@pytest.mark.parametrize("binary, extra", [("benchmark.py", ["--peer=llamacpp", "--num_prompts=1"]),
                                           ("bench_decode.py", ["--peer=llamacpp"])])
def test_binaries_refuse_a_missing_llamacpp_before_loading(tmp_path, binary, extra):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no llama.cpp on PATH
    out = subprocess.run([sys.executable, str(EXP / binary), *extra, f"--llamacpp_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0 and "scripts/build_llamacpp.sh" in out.stderr, out.stderr[-2000:]
    assert "llama-bench" in out.stderr


def test_benchmark_refuses_an_unknown_peer():
    out = subprocess.run([sys.executable, str(EXP / "benchmark.py"), "--peer=vllm", "--num_prompts=1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "unknown --peer value(s): vllm" in out.stderr


def test_first_call_binary_documents_its_flags():
    out = subprocess.run([sys.executable, str(EXP / "first_call.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert "ladder_lengths" in out.stdout + out.stderr and "Traceback" not in out.stderr
